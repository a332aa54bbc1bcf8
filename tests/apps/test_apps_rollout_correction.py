"""verl 0.9.1's rollout correction in the apps (``rollout_correction``, both pipelines' shared keys): the section
loads typed, bad values and combinations are refused naming the key, the targets step applies it after the
advantages (rejected tokens leave the mask and get no advantage; IS weights go into the batch) with verl's
``rollout_corr/`` metrics, and in bypass mode the actor's objective is verl's bypass-mode loss. (Runs of both modes:
tests/apps/test_apps_rlvr_pipeline.py.)"""

from __future__ import annotations

import pytest
import torch

from apps.agentic.config import AgenticConfig
from apps.common.algorithm import AlgorithmSettings, TargetBuilder
from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from rl_core.batch import RolloutBatch
from rl_core.rollout_corr import rollout_correction
from rl_core.rollout_corr_config import RolloutCorrectionConfig
from rl_engines.config import WorkerConfigError
from tests.shared_dir import ROLL_EXAMPLES, require_shared

REWARDS = {"math": {"worker_cls": "x.ExactMatchRewardWorker"}}
MEGATRON_PP2 = {"strategy_name": "megatron_train", "strategy_config": {"pipeline_model_parallel_size": 2}}
MEGATRON_DYNAMIC = {"strategy_args": {"strategy_name": "megatron_train"}, "use_dynamic_batching_in_train": True,
                    "max_tokens_per_microbatch_in_train": 4096}  # fmt: skip
CORRECTION = {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "token_k1",
              "rollout_rs_threshold": "0.5_2.0"}  # fmt: skip


def test_the_section_loads_typed_in_both_pipelines():
    rlvr = RLVRConfig.from_dict({"rewards": REWARDS, "rollout_correction": CORRECTION})
    assert rlvr.rollout_correction == RolloutCorrectionConfig(**CORRECTION)
    raw = load_config(require_shared(ROLL_EXAMPLES / "qwen2.5-0.5B-agentic" / "agentic_sokoban_rollout_mock_dump.yaml"))
    raw["rollout_correction"] = {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0"}
    agentic = AgenticConfig.from_dict(raw).base.rollout_correction
    assert agentic == RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold="0.5_5.0")
    assert RLVRConfig.from_dict({"rewards": REWARDS}).rollout_correction is None


@pytest.mark.parametrize(
    ("section", "extra", "message"),
    [
        ({"rollout_is": "tokens"}, {}, r"rollout_correction\.rollout_is='tokens'; use one of \['token', 'sequence'\]"),
        (
            {"rollout_is": "token", "rollout_is_threshold": "5_0.5"},
            {},
            r"rollout_correction: rollout_is_threshold='5_0\.5': bounds",
        ),
        ({"rollout_rs": "token_k1"}, {}, r"rollout_correction: rollout_rs='token_k1' needs rollout_rs_threshold"),
        ({"rollout_is_thresold": 2.0}, {}, r"unknown key\(s\) \['rollout_correction\.rollout_is_thresold'\]"),
        (
            {"bypass_mode": True},
            {"pg_variant": "cispo"},
            r"bypass_mode: true trains with verl's bypass-mode loss .*'cispo'",
        ),
        ({"rollout_is": "token"}, {"rollout_is_threshold": 2.0}, r"rollout_correction and rollout_is_threshold=2\.0"),
        (
            {"bypass_mode": True, "rollout_is": "token", "rollout_is_batch_normalize": True},
            {"actor_train": {"strategy_args": MEGATRON_PP2}},
            r"only the last of its actor_train\.strategy_args\.strategy_config\.pipeline_model_parallel_size=2 stages",
        ),
        (
            {"bypass_mode": True, "rollout_is": "token", "rollout_is_batch_normalize": True},
            {
                "actor_train": {
                    "strategy_args": {"strategy_name": "megatron_train"},
                    "use_dynamic_batching_in_train": True,
                    "max_tokens_per_microbatch_in_train": 4096,
                }
            },
            r"replicas plan their own number of passes \(actor_train\.use_dynamic_batching_in_train\)",
        ),
    ],
    ids=[
        "level",
        "icepop-bounds",
        "rs-threshold",
        "unknown-key",
        "bypass",
        "both-apis",
        "bypass-norm-stages",
        "bypass-norm-dynamic-batching",
    ],
)
def test_bad_sections_are_refused_naming_the_key(section, extra, message):
    with pytest.raises(WorkerConfigError, match=message):
        RLVRConfig.from_dict({"rewards": REWARDS, "rollout_correction": section, **extra})


def test_the_targets_step_applies_it_after_the_advantages():
    """Row 0's tokens have pi_rollout / pi_train = e (outside [0.5, 2]): rejected, so they leave the mask and get
    no advantage; row 1 (e^-0.5) is kept. The weights are rl-core's (truncated at 1.5)."""
    config = RLVRConfig.from_dict({"adv_estimator": "reinforce", "rewards": REWARDS, "rollout_correction": CORRECTION})
    old, rollout = torch.full((2, 3), -2.0), torch.tensor([[-1.0] * 3, [-2.5] * 3])
    mask = torch.ones(2, 3)
    batch = RolloutBatch.from_dict({"response_mask": mask.clone(), "old_log_probs": old, "rollout_log_probs": rollout},
                                   {})  # fmt: skip
    metrics = TargetBuilder(AlgorithmSettings.from_config(config), config)(batch, torch.tensor([1.0, 2.0]), [0, 1])
    weights, kept, expected = rollout_correction(old, rollout, mask, **CORRECTION)
    assert kept.tolist() == [[0.0] * 3, [1.0] * 3]
    assert torch.equal(batch.batch["response_mask"], kept) and torch.equal(batch.batch["rollout_is_weights"], weights)
    assert bool((batch.batch["advantages"][0] == 0).all()) and bool((batch.batch["advantages"][1] != 0).all())
    assert {name: metrics[name] for name in expected} == expected
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5, abs=1e-6)


def test_bypass_mode_leaves_the_batch_alone_and_the_actor_trains_with_the_bypass_loss():
    from rl_core.losses import GlobalBatchInfo
    from rl_core.losses.policy_bypass import compute_policy_loss_bypass_mode

    section = {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token", "rollout_rs": "token_k1",
               "rollout_rs_threshold": "0.5_2.0"}  # fmt: skip
    config = RLVRConfig.from_dict({"adv_estimator": "reinforce", "rewards": REWARDS, "rollout_correction": section})
    settings = AlgorithmSettings.from_config(config)
    rollout = torch.tensor([[-1.0] * 3, [-2.5] * 3])
    batch = RolloutBatch.from_dict({"response_mask": torch.ones(2, 3), "old_log_probs": rollout.clone(),
                                    "rollout_log_probs": rollout}, {})  # fmt: skip
    metrics = TargetBuilder(settings, config)(batch, torch.tensor([1.0, 2.0]), [0, 1])
    assert "rollout_is_weights" not in batch.batch and bool(batch.batch["response_mask"].all())
    assert not any(name.startswith("rollout_corr/") for name in metrics)  # the actor's loss corrects
    log_probs = torch.full((2, 3), -2.0)  # the current policy: row 0 is rejected against the rollout's -1.0
    info = GlobalBatchInfo.from_mask(batch.batch["response_mask"])
    loss, got = settings.actor({"log_probs": log_probs}, batch, info)
    mask, advantages, policy = (
        batch.batch["response_mask"],
        batch.batch["advantages"],
        settings.actor.policy_loss_config,
    )
    expected, _ = compute_policy_loss_bypass_mode(
        rollout, log_probs, advantages, mask, config=policy, global_batch=info
    )
    assert float(loss) == pytest.approx(float(expected)) and got["rollout_corr/rollout_rs_masked_fraction"] == 0.5


def targets(rows_log_probs, rollout, mask, rewards, groups, section, estimator="grpo"):
    config = RLVRConfig.from_dict({"adv_estimator": estimator, "rewards": REWARDS, "rollout_correction": section})
    batch = RolloutBatch.from_dict({"response_mask": mask.clone(), "old_log_probs": rows_log_probs,
                                    "rollout_log_probs": rollout}, {})  # fmt: skip
    metrics = TargetBuilder(AlgorithmSettings.from_config(config), config)(batch, rewards, groups)
    return batch.batch, metrics


def test_a_rejected_sample_still_counts_in_its_group_as_in_verl():
    """GRPO, one group scored (1, 0, 1); sample 0 is rejected (seq_sum_k1): it gets no advantage, but the group's
    mean and std still see its score, so the others' advantages are those of no correction at all."""
    old = torch.full((3, 2), -2.0)
    rollout = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-2.0, -2.0]])  # sample 0: pi_rollout / pi_train = e^2
    mask, rewards = torch.ones(3, 2), torch.tensor([1.0, 0.0, 1.0])
    rejecting = {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"}
    corrected, metrics = targets(old, rollout, mask, rewards, [0, 0, 0], rejecting)
    plain, _ = targets(old, rollout, mask, rewards, [0, 0, 0], {"rollout_rs": None})
    assert corrected["response_mask"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert bool((corrected["advantages"][0] == 0).all())
    torch.testing.assert_close(corrected["advantages"][1:], plain["advantages"][1:])
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3, abs=1e-6)


def test_rows_the_sample_masks_emptied_are_not_corrected_or_counted():
    """Row 2 has no token left (a sample mask): the metrics are those of rows 0-1 alone (verl drops such rows), and
    a correction rejecting every token reports the batch empty so that the pipeline skips training."""
    old = torch.tensor([[-1.0, -2.0], [-1.5, -1.0], [-9.0, -9.0]])
    rollout = torch.tensor([[-1.2, -1.5], [-1.0, -1.5], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    section = {"rollout_is": "token", "rollout_is_threshold": 2.0}
    _, metrics = targets(old, rollout, mask, torch.tensor([1.0, 0.0, 1.0]), [0, 0, 1], section)
    _, _, alone = rollout_correction(old[:2], rollout[:2], mask[:2], **section)
    assert {name: metrics[name] for name in alone} == alone
    everything = {"rollout_rs": "token_k2", "rollout_rs_threshold": 1e-6}
    tensors, emptied = targets(old, rollout, mask, torch.tensor([1.0, 0.0, 1.0]), [0, 0, 1], everything)
    assert not bool(tensors["response_mask"].any()) and emptied["mask/final_mask_sum_eq_0"] == 1.0


class _NoCalls:
    """Roles with no worker: any call to one fails the test."""

    def __init__(self):
        self.groups = {}

    def activate(self, role):
        pass

    def __getitem__(self, role):
        raise AssertionError(f"{role} was asked for log-probs in bypass mode")


def test_bypass_mode_takes_the_old_log_probs_from_the_rollout_without_a_pass():
    from apps.common.training import score_with_roles

    section = {"bypass_mode": True, "rollout_is": "token"}
    config = RLVRConfig.from_dict({"rewards": REWARDS, "rollout_correction": section})
    assert config.reference is None and config.critic is None
    rollout = RolloutBatch.from_dict({"response_mask": torch.ones(2, 3), "rollout_log_probs": -torch.rand(2, 3)}, {})
    score_with_roles(_NoCalls(), rollout, config, 1.0)
    assert torch.equal(rollout.batch["old_log_probs"], rollout.batch["rollout_log_probs"])
    del rollout.batch["rollout_log_probs"]
    with pytest.raises(ValueError, match=r"rollout_correction\.bypass_mode: true trains against the rollout log-probs"):
        score_with_roles(_NoCalls(), rollout, config, 1.0)

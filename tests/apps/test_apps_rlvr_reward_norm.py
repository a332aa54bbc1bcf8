"""ROLL's RLVR reward stage: ``norm_mean_type`` / ``norm_std_type`` normalise the response-level rewards of every
estimator before ``reward_clip``, and ``grpo`` forces both to ``group`` and is then the reinforce return of the token
rewards (``reward_postprocess`` then ``compute_advantage`` in ROLL's ``roll/utils/functionals.py``). The reference
below is that recipe written out as plain loops."""

from __future__ import annotations

import pytest
import torch

from apps.common.algorithm import AlgorithmSettings, TargetBuilder
from apps.rlvr.config import RLVRConfig
from apps.rlvr.reward_stage import rlvr_reward_stage
from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfigError

REWARDS = {"math": {"worker_cls": "x.ExactMatchRewardWorker"}}
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
SCORES = torch.tensor([0.0, 0.5, 3.0, 10.0, 1.0, 2.0, 2.0, 5.0])
LENGTHS = [5, 3, 5, 1, 4, 5, 2, 5]
MASK = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in LENGTHS])


def roll_reference(mean_type, std_type, clip=None, gamma=1.0):
    """Per ROLL: centre by the batch's / each group's mean (or 0), divide by the unbiased std + 1e-6 (or not),
    clip, put the reward on the last response token, and take the discounted return-to-go."""
    rewards = SCORES.tolist()

    def members(i):
        return [j for j in range(len(rewards)) if GROUPS[j] == GROUPS[i]]

    def moments(rows):
        values = torch.tensor([rewards[j] for j in rows])
        return float(values.mean()), float(values.std())

    out = []
    for i, r in enumerate(rewards):
        rows = {"batch": list(range(len(rewards))), "group": members(i), None: None}
        mean = moments(rows[mean_type])[0] if mean_type else 0.0
        value = r - mean
        if std_type:
            value /= moments(rows[std_type])[1] + 1e-6
        out.append(value if clip is None else min(max(value, -clip), clip))
    advantages = torch.zeros_like(MASK)
    for i, length in enumerate(LENGTHS):
        running = 0.0
        for t in reversed(range(5)):
            running = (out[i] if t == length - 1 else 0.0) + gamma * running
            advantages[i, t] = running if t < length else 0.0
    return advantages


def advantages(**keys):
    config = RLVRConfig.from_dict({"rewards": REWARDS, "num_return_sequences_in_group": 4, **keys})
    settings = rlvr_reward_stage(AlgorithmSettings.from_config(config), config)
    batch = RolloutBatch.from_dict({"response_mask": MASK.clone(), "old_log_probs": torch.zeros(8, 5)}, {})
    TargetBuilder(settings, config)(batch, SCORES.clone(), GROUPS)
    return batch.batch["advantages"]


@pytest.mark.parametrize(
    ("mean_type", "std_type"),
    [("batch", "batch"), ("group", "group"), ("batch", None), ("group", None), (None, "batch")],
)
def test_norm_mean_and_std_types_normalise_the_rewards_as_roll(mean_type, std_type):
    found = advantages(adv_estimator="reinforce", norm_mean_type=mean_type, norm_std_type=std_type)
    assert torch.allclose(found, roll_reference(mean_type, std_type), atol=1e-5)
    assert not torch.allclose(found, roll_reference(None, None), atol=1e-3)  # they had been read nowhere


@pytest.mark.parametrize("keys", [{"reward_clip": 1.0}, {"gamma": 0.9}, {"reward_clip": 0.5, "gamma": 0.8}])
def test_grpo_is_the_reinforce_return_of_group_normalised_clipped_rewards_as_in_roll(keys):
    """ROLL clips after the group normalisation and discounts the return; an outcome advantage (the old grpo here)
    clipped the raw scores first and gave every token the same value."""
    found = advantages(adv_estimator="grpo", **keys)
    expected = roll_reference("group", "group", keys.get("reward_clip"), keys.get("gamma", 1.0))
    assert torch.allclose(found, expected, atol=1e-5)


def test_plain_grpo_is_still_the_group_normalised_outcome_on_every_token():
    found = advantages(adv_estimator="grpo")
    assert torch.allclose(found, roll_reference("group", "group"), atol=1e-6)
    outcome = (SCORES.view(2, 4) - SCORES.view(2, 4).mean(-1, keepdim=True)) / (SCORES.view(2, 4).std(-1) + 1e-6)[
        :, None
    ]
    assert torch.allclose(found, outcome.reshape(8, 1) * MASK, atol=1e-6)


def test_grpo_overrides_the_norm_types_as_roll_does_with_a_note():
    from apps.rlvr.preflight import reward_norm_notes

    config = RLVRConfig.from_dict({"rewards": REWARDS, "adv_estimator": "grpo", "norm_mean_type": "batch"})
    assert torch.allclose(advantages(adv_estimator="grpo", norm_mean_type="batch"), roll_reference("group", "group"))
    assert any("adv_estimator grpo normalises each prompt group" in note for note in reward_norm_notes(config))
    assert not reward_norm_notes(RLVRConfig.from_dict({"rewards": REWARDS, "adv_estimator": "grpo"}))
    unbuilt = RLVRConfig.from_dict({"rewards": REWARDS, "adv_estimator": "grpo", "norm_std_type": "group"})
    assert any("adv_estimator grpo normalises each prompt group" in note for note in reward_norm_notes(unbuilt))


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"norm_mean_type": None, "norm_std_type": "group"}, r"norm_mean_type=None with norm_std_type='group' is not"),
        ({"norm_mean_type": "batch", "norm_std_type": "group"}, r"norm_mean_type='batch' with norm_std_type='group'"),
        ({"norm_mean_type": "group", "norm_std_type": "batch"}, r"a group mean with the batch std is not built"),
        ({"adv_estimator": "grpo", "reward_norm": "batch"}, r"reward_norm='batch' .* with adv_estimator: grpo"),
        ({"adv_estimator": "reinforce", "reward_norm": "batch", "norm_mean_type": "batch"}, r"both set a reward"),
    ],
)
def test_reward_normalisations_that_roll_breaks_on_or_that_conflict_are_refused(keys, message):
    with pytest.raises(WorkerConfigError, match=message):
        RLVRConfig.from_dict({"rewards": REWARDS, "adv_estimator": "reinforce", **keys})


def test_grpo_accepts_reward_norm_none_which_normalises_nothing():
    """ROLL's RAFT++ guide example (docs_examples/example_raft_pp.yaml) sets reward_norm: None, reward_shift: false
    and reward_scale: false beside grpo: nothing for grpo's group normalisation to replace, so not refused, and the
    advantages are plain grpo's."""
    keys = {"reward_norm": "None", "reward_shift": False, "reward_scale": False}
    RLVRConfig.from_dict({"rewards": REWARDS, "adv_estimator": "grpo", **keys})
    assert torch.equal(advantages(adv_estimator="grpo", **keys), advantages(adv_estimator="grpo"))
    with pytest.raises(WorkerConfigError, match=r"reward_shift / reward_scale with adv_estimator: grpo"):
        RLVRConfig.from_dict({"rewards": REWARDS, "adv_estimator": "grpo", **keys, "reward_shift": True})


@pytest.mark.parametrize(
    ("keys", "low_high", "noted"),
    [
        ({"pg_clip": 0.3, "pg_clip_low": 0.1, "pg_clip_high": 0.28}, (None, None), True),  # pg_clip both sides
        ({"pg_clip": 0.3, "use_pg_clip_range": True}, (0.2, 0.2), False),  # ROLL's defaults, not pg_clip
        ({"use_pg_clip_range": True, "pg_clip_low": 0.1, "pg_clip_high": 0.28}, (0.1, 0.28), False),
    ],
)
def test_pg_clip_low_and_high_clip_only_with_use_pg_clip_range_as_in_roll(keys, low_high, noted):
    """ROLL's actor workers clip by pg_clip_low / pg_clip_high only when use_pg_clip_range is true (both 0.2 by
    default), else by pg_clip on both sides; use_pg_clip_range had been refused and the pair always applied."""
    from apps.common.preflight import clip_range_notes

    config = RLVRConfig.from_dict({"rewards": REWARDS, **keys})
    policy = AlgorithmSettings.from_config(config).actor.policy_loss_config
    assert (policy.clip_ratio_low, policy.clip_ratio_high) == low_high
    assert policy.clip_ratio == keys.get("pg_clip", 0.2)
    assert bool(clip_range_notes(config)) == noted


def test_a_negative_entropy_coefficient_which_roll_ignores_is_refused():
    with pytest.raises(WorkerConfigError, match=r"entropy_loss_coef=-0\.01: ROLL adds the entropy term only when"):
        RLVRConfig.from_dict({"rewards": REWARDS, "entropy_loss_coef": -0.01})


def test_grpo_normalises_a_group_with_the_true_score_of_a_masked_sample_as_roll():
    """ROLL normalises every sample's true score and masks afterwards (``final_response_mask``): a correct but
    truncated response that max_len_mask takes out still counts 1 in its group's mean and std."""
    from apps.common.sample_filters import SampleShaping, apply_sample_masks

    config = RLVRConfig.from_dict({"rewards": REWARDS, "adv_estimator": "grpo", "max_len_mask": True,
                                   "num_return_sequences_in_group": 4, "response_length": 5})  # fmt: skip
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 2 + [0.0] * 3, [1.0] * 4 + [0.0]])
    others = {"finish_reasons": ["length", "stop", "stop", "stop"]}
    batch = RolloutBatch.from_dict({"response_mask": mask, "old_log_probs": torch.zeros(4, 5)}, others)
    scores, _ = apply_sample_masks(batch, scores, [0, 0, 0, 0], SampleShaping.from_config(config))
    settings = rlvr_reward_stage(AlgorithmSettings.from_config(config), config)
    TargetBuilder(settings, config)(batch, scores, [0, 0, 0, 0])
    spread = (0.5 / 3**0.5 * 2) + 1e-6  # ROLL: mean .5, unbiased std of [1, 0, 0, 1] (+1e-6)
    expected = (
        torch.tensor([0.0, -0.5 / spread, -0.5 / spread, 0.5 / spread]).unsqueeze(-1) * batch.batch["response_mask"]
    )
    torch.testing.assert_close(batch.batch["advantages"], expected, rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("in_reward", [False, True])
def test_kl_controller_follows_every_generated_response_and_kl_coef_is_the_applied_one(in_reward):
    """ROLL's ``compute_token_reward`` measures the KL its controller follows over ``response_mask`` as generated
    (not ``final_response_mask``) and logs as ``critic/kl_coef`` the coefficient subtracted (0 without
    add_token_level_kl)."""
    from apps.common.sample_filters import SampleShaping, apply_sample_masks

    keys = {"max_len_mask": True, "response_length": 2, "init_kl_coef": 0.3, "add_token_level_kl": in_reward}
    config = RLVRConfig.from_dict({"rewards": REWARDS, "adv_estimator": "reinforce", **keys})
    mask = torch.ones(2, 2)
    log_probs = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0], [-2.0, -3.0]])  # k1 per sample: 0 and 1.5
    others = {"finish_reasons": ["stop", "length"]}
    batch = RolloutBatch.from_dict({"response_mask": mask, "old_log_probs": log_probs, "ref_log_probs": ref}, others)
    generated = batch.batch["response_mask"]
    scores, _ = apply_sample_masks(batch, torch.tensor([1.0, 0.0]), [0, 1], SampleShaping.from_config(config))
    settings = rlvr_reward_stage(AlgorithmSettings.from_config(config), config)
    metrics = TargetBuilder(settings, config)(batch, scores, [0, 1], kl_mask=generated)
    assert metrics["critic/kl"] == pytest.approx(0.75)  # the masked sample's 1.5 counts; alone the first gives 0
    assert metrics["critic/kl_coef"] == (0.3 if in_reward else 0.0)

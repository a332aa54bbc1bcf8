"""ROLL's train-infer correction in the apps (``train_infer_correction``, both pipelines' shared keys, as ROLL's
agent_val_frozen_lake-pg_var_is_correct.yaml writes them): the section loads typed, bad values and combinations are
refused naming the key, the targets step applies it after the advantages (filtered tokens leave the loss mask, the
IS weights go into the batch) with ROLL's ``actor/train_infer_*`` metrics, and a run's filters reach its loss.
ROLL's switches of the old-log-prob pass are accepted with a note, or refused where ROLL's results would differ."""

from __future__ import annotations

import json

import pytest
import torch
from rlvr_fixtures import NO_KL, make_setup

from apps.agentic.config import AgenticConfig
from apps.common.algorithm import AlgorithmSettings, TargetBuilder
from apps.common.preflight import PreflightError
from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.preflight import preflight
from rl_core.batch import RolloutBatch
from rl_core.train_infer_correction import (
    TrainInferCorrectionConfig,
    TrainInferFilterConfig,
    TrainInferISWeightConfig,
    compute_train_infer_correction,
)
from rl_engines.config import WorkerConfigError
from tests.shared_dir import ROLL_EXAMPLES, require_shared

REWARDS = {"math": {"worker_cls": "x.ExactMatchRewardWorker"}}
ROLLS = {"filters": [{"enabled": True, "agg_type": "segment", "ratio_enabled": True, "diff_enabled": True,
                      "ratio_low": 0.8, "ratio_high": 1.05, "diff_low": -0.1, "diff_high": 0.1}]}  # fmt: skip
"""The section of ROLL's agent_val_frozen_lake-pg_var_is_correct.yaml."""


def test_the_section_loads_typed_in_both_pipelines():
    rlvr = RLVRConfig.from_dict({"rewards": REWARDS, "train_infer_correction": ROLLS})
    assert rlvr.train_infer_correction == TrainInferCorrectionConfig(
        filters=[TrainInferFilterConfig(**ROLLS["filters"][0])]
    )
    raw = load_config(require_shared(ROLL_EXAMPLES / "qwen2.5-0.5B-agentic" / "agentic_sokoban_rollout_mock_dump.yaml"))
    raw.update(train_infer_correction={"is_weight": {"enabled": True, "weight_type": "geometric"}},
               enable_old_logprobs_recompute=True)  # fmt: skip
    agentic = AgenticConfig.from_dict(raw).base
    assert agentic.train_infer_correction == TrainInferCorrectionConfig(TrainInferISWeightConfig(True, "geometric"))
    assert agentic.enable_old_logprobs_recompute is True
    assert RLVRConfig.from_dict({"rewards": REWARDS}).train_infer_correction is None


@pytest.mark.parametrize(
    ("section", "extra", "message"),
    [
        ({"is_weights": {}}, {}, r"unknown key\(s\) \['train_infer_correction\.is_weights'\]"),
        ({"filters": {"enabled": True}}, {}, r"train_infer_correction\.filters must be a list"),
        ({"filters": [{"agg": "token"}]}, {}, r"unknown key\(s\) \['train_infer_correction\.filters\[0\]\.agg'\]"),
        ({"filters": [{"enabled": True, "agg_type": "turn"}]}, {}, r"filters\[0\]\.agg_type='turn'; use one of"),
        ({"is_weight": {"upper_bound": -1}}, {}, r"train_infer_correction\.is_weight\.upper_bound=-1"),
        ({}, {"rollout_correction": {"rollout_is": "token"}}, r"train_infer_correction and rollout_correction"),
        (
            {},
            {"rollout_is_threshold": 2.0, "rollout_is": True},
            r"train_infer_correction and rollout_is_threshold with rollout_is: true are both set",
        ),
    ],
    ids=["unknown", "filters-mapping", "filter-key", "agg-type", "bound", "with-verl", "with-rollout-is"],
)
def test_bad_sections_are_refused_naming_the_key(section, extra, message):
    with pytest.raises(WorkerConfigError, match=message):
        RLVRConfig.from_dict({"rewards": REWARDS, "train_infer_correction": section, **extra})


def test_the_targets_step_filters_the_mask_and_weights_the_loss_after_the_advantages():
    """Row 0's tokens have pi_train / pi_infer = e (outside ROLL's band): they leave the loss mask and get no
    advantage; row 1's (e^0.02) stay. The token IS weights (clamped at 1.2) go into the batch; the metrics are
    rl-core's, under ROLL's names."""
    section = {"is_weight": {"enabled": True, "upper_bound": 1.2}, **ROLLS}
    config = RLVRConfig.from_dict({"adv_estimator": "reinforce", "rewards": REWARDS,
                                   "train_infer_correction": section})  # fmt: skip
    old, infer = torch.full((2, 3), -2.0), torch.tensor([[-3.0] * 3, [-2.02] * 3])
    mask = torch.ones(2, 3)
    batch = RolloutBatch.from_dict({"response_mask": mask.clone(), "old_log_probs": old, "rollout_log_probs": infer},
                                   {})  # fmt: skip
    metrics = TargetBuilder(AlgorithmSettings.from_config(config), config)(batch, torch.tensor([1.0, 2.0]), [0, 1])
    weights, keep, expected = compute_train_infer_correction(config.train_infer_correction, mask, old, infer)
    assert keep.tolist() == [[0.0] * 3, [1.0] * 3]
    assert torch.equal(batch.batch["response_mask"], keep) and torch.equal(batch.batch["rollout_is_weights"], weights)
    assert batch.batch["rollout_is_weights"][0].tolist() == pytest.approx([1.2] * 3)  # e, clamped
    assert bool((batch.batch["advantages"][0] == 0).all()) and bool((batch.batch["advantages"][1] != 0).all())
    assert {name: metrics[name] for name in expected} == expected
    assert metrics["actor/train_infer_final_mask_mean"] == pytest.approx(0.5)
    assert metrics["actor/is_weight_clipfrac@sum"] == pytest.approx(0.5)


def test_the_old_log_prob_switches_pass_with_a_note_unless_rolls_results_would_differ():
    """One optimizer step per rollout (test_apps_rlvr_config's small config; ROLL reuses the first epoch's log-probs
    for later ppo_epochs): ROLL's skipped pass would give the same old log-probs, so the switches pass with a note
    naming what was given; with two optimizer steps per rollout the forced skip would not, and is refused."""
    from test_apps_rlvr_config import base as small

    base = small()

    def notes(**given):
        return [n for n in preflight(RLVRConfig.from_dict({**base, **given})).notes if "old" in n and "log" in n]

    assert notes() == []
    (note,) = notes(enable_old_logprobs_recompute=True)
    assert note.startswith("[preflight] enable_old_logprobs_recompute=true: the old log-probs come from a pass")
    (note,) = notes(force_disable_old_logprobs_recompute=False)
    assert note.startswith("[preflight] force_disable_old_logprobs_recompute=false: the old log-probs come from")
    (note,) = notes(force_disable_old_logprobs_recompute=True, ppo_epochs=2)
    assert "force_disable_old_logprobs_recompute=true: ROLL then skips the old-log-prob pass" in note
    (note,) = notes(enable_old_logprobs_recompute=False)
    assert "enable_old_logprobs_recompute=false: ROLL then skips" in note
    two_steps = {**base, "force_disable_old_logprobs_recompute": True}
    two_steps["actor_train"] = {
        **base["actor_train"],
        "training_args": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1},
    }
    with pytest.raises(PreflightError, match=r"force_disable_old_logprobs_recompute: true with 2 optimizer steps"):
        preflight(RLVRConfig.from_dict(two_steps))


@pytest.mark.usefixtures("ray_session")
def test_a_run_whose_filter_rejects_every_token_skips_training_and_reports_it(tmp_path):
    """The engines score the sampled tokens alike (fp32, the same weights: every ratio ~1), so a band of [2, 3]
    rejects them all: the step reports ROLL's metrics and trains on nothing, as ROLL skips an empty mask."""
    from apps.rlvr.__main__ import main

    setup = make_setup(tmp_path / "setup")
    rule = "{enabled: true, agg_type: token, ratio_low: 2.0, ratio_high: 3.0}"
    band = ["+train_infer_correction.is_weight.enabled=true", f"+train_infer_correction.filters=[{rule}]"]
    overrides = ["max_steps=1", "eval_steps=0", "rollout_is_threshold=null", *NO_KL, "actor_train.device_mapping=[0]",
                 f"output_dir={tmp_path / 'out'}", *band]  # fmt: skip
    assert main(["--config_path", str(setup), "--config_name", "rlvr", *overrides]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert row["actor/train_infer_ratio_token_mean@sum"] == pytest.approx(1.0, abs=1e-4)
    assert row["actor/train_infer_token_ratio_mask_mean@sum"] == 0.0 and row["actor/train_infer_final_mask_mean"] == 0
    assert row["mask/final_mask_sum_eq_0"] == 1.0 and "actor/pg_loss" not in row

"""ROLL sample masks (max_len_mask, error_max_len_clip, difficulty_mask) and loss weights (difficulty_loss_weight,
length_loss_weight): hand-computed batches, the all-off no-op, and weights-via-advantages == weighted loss."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np
import pytest
import torch

from apps.common.sample_filters import (
    ADVANTAGE_LINEAR_LOSSES,
    SampleShaping,
    apply_sample_masks,
    apply_sample_weights,
    sample_loss_weights,
)
from apps.rlvr.config import RLVRConfig
from rl_core.advantages import AdvantageConfig, compute_advantages
from rl_core.batch import RolloutBatch
from rl_core.losses import POLICY_LOSSES, PolicyLossConfig, get_policy_loss
from rl_core.rewards import scores_to_token_level

R = 4  # response width = response_length in every batch here


def make_batch(
    lengths: list[int],
    uids: list[str] | None = None,
    reasons: list[str] | None = None,
    difficulty: list[object] | None = None,
) -> RolloutBatch:
    """Responses of the given lengths (bool mask ``[B, R]``), one group per sample unless ``uids`` say otherwise."""
    mask = torch.zeros(len(lengths), R, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, :length] = True
    responses = torch.arange(len(lengths) * R).reshape(len(lengths), R)
    others: dict[str, object] = {"prompt_uid": uids or [f"p{i}" for i in range(len(lengths))]}
    if reasons is not None:
        others["finish_reasons"] = np.array(reasons, dtype=object)
    if difficulty is not None:
        others["difficulty"] = np.array(difficulty, dtype=object)
    return RolloutBatch.from_dict({"responses": responses, "response_mask": mask}, others)


def rows(keep: list[bool], lengths: list[int]) -> torch.Tensor:
    """The expected response mask: each kept row's first ``length`` tokens."""
    return make_batch([n if k else 0 for n, k in zip(lengths, keep)]).batch["response_mask"]


def shaping(**switches: Any) -> SampleShaping:
    return SampleShaping(response_length=R, error_max_len_threshold=R, **switches)


def masks(batch: RolloutBatch, scores: list[float], **switches: Any) -> dict[str, float]:
    """Apply the masks; the scores come back as the very tensor passed in (ROLL's rules only mask)."""
    score_tensor = torch.tensor(scores)
    out, metrics = apply_sample_masks(batch, score_tensor, list(batch.non_tensor_batch["prompt_uid"]),
                                      shaping(**switches))  # fmt: skip
    assert out is score_tensor
    assert out.tolist() == pytest.approx(scores)
    return metrics


# ---------------------------------------------------------------------------------- all off
def test_everything_off_changes_nothing_and_reports_nothing() -> None:
    batch = make_batch([4, 2, 4, 1], uids=["a", "a", "b", "b"], reasons=["length", "stop", "length", "stop"],
                       difficulty=[0.1, 0.9, 0.5, 0.5])  # fmt: skip
    batch.batch["advantages"] = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 4)
    before = {key: value.clone() for key, value in batch.batch.items()}
    tensors = dict(batch.batch)
    off = SampleShaping.from_config(RLVRConfig())
    assert not off.masks_samples and not off.weights_samples
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0])
    out, metrics = apply_sample_masks(batch, scores, ["a", "a", "b", "b"], off)
    assert out is scores and metrics == {}
    assert apply_sample_weights(batch, off) == {}
    for key, value in batch.batch.items():
        assert value is tensors[key] and torch.equal(value, before[key])
    assert scores.tolist() == [0.0, 1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------- max_len_mask
def test_max_len_mask_drops_responses_that_hit_the_limit() -> None:
    lengths = [2, 4, 4, 1]
    batch = make_batch(lengths, reasons=["stop", "length", "stop", "length"])
    original = batch.batch["response_mask"]
    metrics = masks(batch, [1.0, 0.0, 1.0, 0.0], max_len_mask=True)
    # row 2 is as long as the limit but ended with EOS ("stop"): the finish reason decides, not the length
    assert torch.equal(batch.batch["response_mask"], rows([True, False, True, False], lengths))
    assert original.sum() == 11  # the old tensor is left as it was; the dict entry is replaced
    assert metrics == {
        "actor/max_len_mask_ratio": 0.5,  # ROLL's meaning: the fraction the rule keeps
        "actor/final_mask_ratio": 0.5,
        "actor/samples_used": 2.0,
        "actor/samples_total": 4.0,
        "mask/final_mask_sum_eq_0": 0.0,
    }


def test_max_len_mask_without_finish_reasons_uses_response_length() -> None:
    lengths = [4, 3, 0]
    batch = make_batch(lengths)
    metrics = masks(batch, [1.0, 1.0, 0.0], max_len_mask=True)
    assert torch.equal(batch.batch["response_mask"], rows([False, True, True], lengths))
    assert metrics["actor/max_len_mask_ratio"] == pytest.approx(2 / 3)


def test_every_sample_truncated_leaves_no_token() -> None:
    lengths = [4, 4]
    batch = make_batch(lengths, uids=["a", "a"], reasons=["length", "length"])
    metrics = masks(batch, [1.0, 0.0], max_len_mask=True)
    assert not batch.batch["response_mask"].any()
    assert metrics["actor/samples_used"] == 0.0 and metrics["mask/final_mask_sum_eq_0"] == 1.0
    batch.batch["advantages"] = torch.full((2, R), 5.0)
    weights_metrics = apply_sample_weights(batch, shaping(length_loss_weight=True))
    assert weights_metrics == {"actor/sample_weights_mean": 1.0, "actor/sample_weights_min": 1.0,
                               "actor/sample_weights_max": 1.0}  # fmt: skip
    assert torch.equal(batch.batch["advantages"], torch.full((2, R), 5.0))


# ---------------------------------------------------------------------------------- error_max_len_clip
def test_error_max_len_clip_is_rolls_mask_rule() -> None:
    # keep score == 1, or score == 0 with length < 4; anything else (0.5, -1) is dropped as in ROLL
    lengths = [4, 4, 2, 4, 1, 1]
    batch = make_batch(lengths)
    metrics = masks(batch, [1.0, 0.0, 0.0, 1.0, 0.5, -1.0], error_max_len_clip=True)
    assert torch.equal(batch.batch["response_mask"], rows([True, False, True, True, False, False], lengths))
    assert metrics["actor/error_len_mask_ratio"] == 0.5
    assert metrics["actor/final_mask_ratio"] == 0.5
    assert "actor/max_len_mask_ratio" not in metrics and "actor/difficulty_mask_ratio" not in metrics


def test_error_max_len_threshold_defaults_to_rolls_which_sets_no_length_limit() -> None:
    """ROLL's default (9999999999): a wrong response at the length limit stays; only partial scores leave. It had
    defaulted to response_length here, which dropped that response too."""
    config = RLVRConfig(error_max_len_clip=True, response_length=R)
    shaping = SampleShaping.from_config(config)
    assert shaping.error_max_len_threshold == 9_999_999_999
    batch = make_batch([R, R, 2])
    apply_sample_masks(batch, torch.tensor([0.0, 0.5, 0.0]), [0, 0, 1], shaping)
    assert torch.equal(batch.batch["response_mask"], rows([True, False, True], [R, R, 2]))
    with_key = types.SimpleNamespace(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    with_key.error_max_len_threshold = 300
    assert SampleShaping.from_config(with_key).error_max_len_threshold == 300


# ---------------------------------------------------------------------------------- difficulty_mask
def test_difficulty_mask_thresholds_are_exclusive() -> None:
    # group means: a .25 (= low: dropped), b .5 (kept), c .75 (= high: dropped), d 1.0 (dropped); groups interleave
    uids = ["a", "b", "a", "b", "a", "b", "a", "b", "c", "c", "c", "c", "d", "d", "d", "d"]
    scores = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    lengths = [1, 2, 3, 4] * 4
    batch = make_batch(lengths, uids=uids)
    metrics = masks(batch, scores, difficulty_mask=True, difficulty_low_threshold=0.25, difficulty_high_threshold=0.75)
    keep = [uid == "b" for uid in uids]
    assert torch.equal(batch.batch["response_mask"], rows(keep, lengths))
    assert metrics["actor/difficulty_mask_ratio"] == 0.25 and metrics["actor/samples_used"] == 4.0


def test_difficulty_mask_default_thresholds_drop_solved_and_unsolved_groups() -> None:
    uids = ["x", "x", "y", "y", "z", "z", "solo"]
    lengths = [1, 1, 2, 2, 3, 3, 4]
    batch = make_batch(lengths, uids=uids)
    # x all wrong (0), y mixed (.5), z all right (1); a group of one sample is never judged (ROLL: n_sample > 1)
    metrics = masks(batch, [0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0], difficulty_mask=True)
    assert torch.equal(batch.batch["response_mask"], rows([False, False, True, True, False, False, True], lengths))
    assert metrics["actor/difficulty_mask_ratio"] == pytest.approx(3 / 7)


def test_difficulty_mean_compares_like_the_decimal() -> None:
    # a mean on a threshold is dropped: 1/5 with low 0.2
    lengths = [1] * 5
    on_boundary = make_batch(lengths, uids=["g"] * 5)
    masks(on_boundary, [1.0, 0.0, 0.0, 0.0, 0.0], difficulty_mask=True, difficulty_low_threshold=0.2)
    assert not on_boundary.batch["response_mask"].any()
    # 2/3 < 0.6666667 as decimals, so the group stays; in float32 both round to the same number and it would go
    below = make_batch([1, 1, 1], uids=["g"] * 3)
    masks(below, [1.0, 1.0, 0.0], difficulty_mask=True, difficulty_high_threshold=0.6666667)
    assert below.batch["response_mask"].any(dim=-1).tolist() == [True] * 3


def test_error_clip_and_difficulty_decide_on_the_same_raw_scores() -> None:
    # threshold 4, difficulty (0.3, 1.0). g1 mean .25: dropped whole. g2 mean .5: error clip drops its wrong
    # length-4 sample. g3 mean .75 on all four raw scores: kept, though its kept samples alone score 1.0
    # (>= high) -- the rules are independent, ROLL computes both from the original scores.
    uids = ["g1"] * 4 + ["g2"] * 4 + ["g3"] * 4
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    lengths = [2, 4, 2, 3, 4, 1, 4, 2, 4, 4, 4, 4]
    batch = make_batch(lengths, uids=uids)
    metrics = masks(batch, scores, error_max_len_clip=True, difficulty_mask=True, difficulty_low_threshold=0.3)
    keep = [False] * 4 + [True, True, False, True] + [True, True, True, False]
    assert torch.equal(batch.batch["response_mask"], rows(keep, lengths))
    assert metrics == {
        "actor/difficulty_mask_ratio": pytest.approx(8 / 12),
        "actor/error_len_mask_ratio": 0.75,  # g1 [T, F, T, T], g2 [T, T, F, T], g3 [T, T, T, F]
        "actor/final_mask_ratio": 0.5,
        "actor/samples_used": 6.0,
        "actor/samples_total": 12.0,
        "mask/final_mask_sum_eq_0": 0.0,
    }


def test_masked_samples_get_zero_finite_grpo_advantages() -> None:
    # group a: its two truncated samples leave the loss; group b untouched. Advantages of masked rows are 0.
    lengths = [4, 4, 2, 3]
    batch = make_batch(lengths, uids=["a", "a", "b", "b"], reasons=["length", "length", "stop", "stop"])
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    masks(batch, scores.tolist(), max_len_mask=True)
    mask = batch.batch["response_mask"]
    advantages, _ = compute_advantages("grpo", scores_to_token_level(scores, mask), mask, config=AdvantageConfig(),
                                       group_index=["a", "a", "b", "b"])  # fmt: skip
    assert torch.isfinite(advantages).all()
    assert torch.equal(advantages[:2], torch.zeros(2, R))
    assert advantages[2, :2].tolist() == pytest.approx([2**-0.5] * 2, abs=1e-5)


# ---------------------------------------------------------------------------------- loss weights
def test_length_loss_weight_over_live_samples_scales_advantages() -> None:
    lengths = [1, 3, 0, 2]  # row 2 has no token in the loss: weight 1, and it has no say in min / max / mean
    batch = make_batch(lengths)
    batch.batch["advantages"] = torch.tensor([[2.0] * R, [-1.0] * R, [7.0] * R, [0.5] * R])
    metrics = apply_sample_weights(batch, shaping(length_loss_weight=True))
    raw = [1.5 - (n - 1) / (2 + 1e-8) for n in (1, 3, 2)]  # ROLL: 1.5 - (len - min) / (max - min + 1e-8)
    live = [x * 3 / sum(raw) for x in raw]  # mean 1 over the live samples
    expected = torch.tensor([live[0], live[1], 1.0, live[2]])
    torch.testing.assert_close(sample_loss_weights(batch.batch["response_mask"], length_loss_weight=True), expected)
    adv = torch.tensor([[2.0] * R, [-1.0] * R, [7.0] * R, [0.5] * R]) * expected.unsqueeze(-1)
    torch.testing.assert_close(batch.batch["advantages"], adv, rtol=0.0, atol=1e-6)
    assert metrics["actor/sample_weights_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/sample_weights_min"] == pytest.approx(live[1], abs=1e-6)
    assert metrics["actor/sample_weights_max"] == pytest.approx(live[0], abs=1e-6)


def test_difficulty_loss_weight_and_both_weights() -> None:
    batch = make_batch([1, 2, 3, 4], difficulty=[0.0, 0.5, 1.0, 2.0])
    batch.batch["advantages"] = torch.ones(4, R)
    apply_sample_weights(batch, shaping(difficulty_loss_weight=True))
    raw = [0.5, 1.25, 2.0, 2.0]  # 0.5 + 1.5 * clamp(d, 0, 1)
    expected = [x * 4 / sum(raw) for x in raw]
    torch.testing.assert_close(batch.batch["advantages"][:, 0], torch.tensor(expected), rtol=0.0, atol=1e-6)
    both = make_batch([1, 2, 3, 4], difficulty=[0.0, 0.5, 1.0, 2.0])
    both.batch["advantages"] = torch.ones(4, R)
    apply_sample_weights(both, shaping(difficulty_loss_weight=True, length_loss_weight=True))
    product = [d * (1.5 - (n - 1) / (3 + 1e-8)) for d, n in zip(raw, (1, 2, 3, 4))]
    expected = [x * 4 / sum(product) for x in product]
    torch.testing.assert_close(both.batch["advantages"][:, 0], torch.tensor(expected), rtol=0.0, atol=1e-6)


def test_difficulty_loss_weight_needs_numeric_difficulty() -> None:
    no_column = make_batch([1, 2])
    no_column.batch["advantages"] = torch.ones(2, R)
    with pytest.raises(ValueError, match="non_tensor_batch\\['difficulty'\\]"):
        apply_sample_weights(no_column, shaping(difficulty_loss_weight=True))
    words = make_batch([1, 2], difficulty=["hard", "easy"])
    words.batch["advantages"] = torch.ones(2, R)
    with pytest.raises(ValueError, match="numbers in \\[0, 1\\]"):
        apply_sample_weights(words, shaping(difficulty_loss_weight=True))
    with pytest.raises(KeyError, match="after the advantages"):
        apply_sample_weights(make_batch([1]), shaping(length_loss_weight=True))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_LINEAR_LOSSES))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_scaling_advantages_equals_weighting_the_loss(name: str, agg: str) -> None:
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=generator, dtype=torch.float64) * 0.3 - 1.0
    new = (old + torch.randn(3, 5, generator=generator, dtype=torch.float64) * 0.5).requires_grad_()
    adv = torch.randn(3, 5, generator=generator, dtype=torch.float64) * 2.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    weights = torch.tensor([0.4, 1.7, 0.9], dtype=torch.float64)
    config = PolicyLossConfig(clip_ratio_c=3.0, cispo_use_unified_mask=True)
    loss_fn = get_policy_loss(name)
    scaled, _ = loss_fn(old, new, adv * weights.unsqueeze(-1), mask, loss_agg_mode=agg, config=config)
    (grad_scaled,) = torch.autograd.grad(scaled, new)
    per_token = weights.unsqueeze(-1).expand_as(adv)  # ROLL's agg_loss(weights=...) as a per-token factor
    weighted, _ = loss_fn(old, new, adv, mask, loss_agg_mode=agg, config=config, rollout_is_weights=per_token)
    (grad_weighted,) = torch.autograd.grad(weighted, new)
    torch.testing.assert_close(scaled, weighted, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_scaled, grad_weighted, rtol=1e-12, atol=1e-12)


def test_weights_refuse_losses_not_linear_in_the_advantage() -> None:
    assert SampleShaping(length_loss_weight=True, pg_variant="ppo").weights_samples  # alias of vanilla
    for name in sorted(set(POLICY_LOSSES.names()) - ADVANTAGE_LINEAR_LOSSES):
        with pytest.raises(ValueError, match="pg_variant"):
            SampleShaping(difficulty_loss_weight=True, pg_variant=name)
        SampleShaping(max_len_mask=True, pg_variant=name)  # masks do not touch the advantages: any loss


def test_kimi15_shows_why_it_is_refused() -> None:
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    kimi = get_policy_loss("kimi15")
    scaled, _ = kimi(old, new, adv * 2.0, torch.ones(1, 2, dtype=torch.bool))
    weighted, _ = kimi(old, new, adv, torch.ones(1, 2, dtype=torch.bool), rollout_is_weights=torch.full((1, 2), 2.0))
    assert not torch.isclose(scaled, weighted)


def test_from_config_reads_every_key_and_validates_thresholds() -> None:
    config = RLVRConfig(max_len_mask=True, error_max_len_clip=True, difficulty_mask=True, difficulty_low_threshold=0.1,
                        difficulty_high_threshold=0.9, difficulty_loss_weight=True, length_loss_weight=True,
                        response_length=64, pg_variant="gspo")  # fmt: skip
    assert SampleShaping.from_config(config) == SampleShaping(
        max_len_mask=True, error_max_len_clip=True, error_max_len_threshold=9_999_999_999, difficulty_mask=True,
        difficulty_low_threshold=0.1, difficulty_high_threshold=0.9, difficulty_loss_weight=True,
        length_loss_weight=True, response_length=64, pg_variant="gspo",
    )  # fmt: skip
    with pytest.raises(ValueError, match="difficulty_low_threshold"):
        SampleShaping(difficulty_low_threshold=0.8, difficulty_high_threshold=0.2)

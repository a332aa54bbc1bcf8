"""The actor objective hands the policy loss what the batch carries for it."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.batch import RolloutBatch
from rl_core.losses.aggregation import GlobalBatchInfo
from rl_engines.objectives import ActorObjective


def test_topr_splits_positive_and_negative_samples_by_their_scores_as_roll():
    """ROLL's ActorPGWorker splits TOPR's samples by ``scores > 0``; a sample scored 0.2 whose group-normalised
    advantage is negative is a positive one there. Without ``sample_scores`` the sign of the mean advantage
    decided, which made it negative."""
    mask = torch.ones(2, 3)
    columns = {"response_mask": mask, "old_log_probs": torch.full((2, 3), -1.0),
               "advantages": torch.tensor([[0.5] * 3, [-0.5] * 3])}  # fmt: skip
    outputs = {"log_probs": torch.full((2, 3), -0.9, requires_grad=True)}
    objective = ActorObjective(policy_loss="topr")
    info = GlobalBatchInfo.from_mask(mask)
    with_scores = RolloutBatch.from_dict({**columns, "sample_scores": torch.tensor([1.0, 0.2])}, {})
    _, metrics = objective(outputs, with_scores, info)
    assert float(metrics["topr_positive_fraction"]) == 1.0
    _, metrics = objective(outputs, RolloutBatch.from_dict(columns, {}), info)
    assert float(metrics["topr_positive_fraction"]) == 0.5


def _batch_and_outputs():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.randn(2, 3, generator=g) - 1.0
    columns = {"response_mask": mask, "old_log_probs": old, "advantages": torch.randn(2, 3, generator=g)}
    outputs = {"log_probs": (old + 0.4 * torch.randn(2, 3, generator=g)).requires_grad_(True)}
    return RolloutBatch.from_dict(columns, {}), outputs, GlobalBatchInfo.from_mask(mask)


def test_actor_metrics_carry_rolls_names_with_the_clip_of_the_ppo_loss():
    """ROLL's ActorWorker logs actor/ppo_ratio_*_clipfrac, ratio_mean / max / min, clipfrac, approxkl, policykl;
    its ActorPGWorker (tis, topr, ...) the ratio ones without PPO's clip fractions."""
    from rl_core.losses import PolicyLossConfig

    batch, outputs, info = _batch_and_outputs()
    config = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3)
    _, metrics = ActorObjective(policy_loss_config=config)(outputs, batch, info)
    ratio = (outputs["log_probs"] - batch.batch["old_log_probs"]).detach().exp()[batch.batch["response_mask"].bool()]
    assert float(metrics["ppo_ratio_high_clipfrac"]) == pytest.approx(float((ratio > 1.3).double().mean()))  # 1 / 5
    assert float(metrics["ppo_ratio_low_clipfrac"]) == pytest.approx(float((ratio < 0.9).double().mean()))  # 3 / 5
    assert float(metrics["ratio_max"]) == float(ratio.max()) and float(metrics["ratio_min"]) == float(ratio.min())
    assert float(metrics["clipfrac"]) == pytest.approx(float(metrics["pg_clipfrac"]))  # the same under token-mean
    _, topr = ActorObjective(policy_loss="topr")(outputs, batch, info)
    assert {"ratio_mean", "approxkl", "policykl"} <= set(topr) and "ppo_ratio_clipfrac" not in topr


def test_metric_accumulator_takes_max_and_min_of_the_ratio_extremes():
    from rl_engines.strategies.train_utils import MetricAccumulator

    accumulator = MetricAccumulator()
    for ratio_max, ratio_min, share in ((1.5, 0.9, 0.25), (-math.inf, math.inf, 0.5), (1.2, 0.7, 0.25)):
        accumulator.add({"ratio_max": torch.tensor(ratio_max), "ratio_min": torch.tensor(ratio_min),
                         "ratio_mean": torch.tensor(share), "pg_clipfrac": torch.tensor(0.4)}, share)  # fmt: skip
    accumulator.end_minibatch()
    accumulator.add({"ratio_max": torch.tensor(1.1), "ratio_min": torch.tensor(0.95),
                     "ratio_mean": torch.tensor(1.0), "pg_clipfrac": torch.tensor(0.2)}, 1.0)  # fmt: skip
    accumulator.add({name: accumulator.neutral(name) for name in ("ratio_max", "ratio_min", "ratio_mean")}, 0.0)
    accumulator.end_minibatch()
    result = accumulator.result()
    assert result["ratio_max"] == 1.5 and result["ratio_min"] == pytest.approx(0.7)  # over every micro- and mini-batch
    assert result["ratio_mean"] == pytest.approx((1.0 + 1.0) / 2)  # shares add up, mini-batches average
    assert result["pg_clipfrac"] == pytest.approx((0.4 + 0.2) / 2)
    empty = MetricAccumulator()
    empty.add({"ratio_max": torch.tensor(-math.inf), "ratio_min": torch.tensor(math.inf)}, 1.0)
    assert empty.result() == {}  # no token anywhere: left out
    diverged = MetricAccumulator()
    for value in (math.nan, 2.0):  # a NaN ratio shows, whichever micro-batch held it (as torch.max shows it)
        diverged.add({"ratio_max": torch.tensor(value)}, 0.5)
    assert math.isnan(diverged.result()["ratio_max"])
    assert MetricAccumulator.reported({"ratio_min": torch.tensor(0.5), "pg_loss": torch.tensor(2.0)}, False) == {
        "ratio_min": torch.tensor(math.inf),
        "pg_loss": torch.tensor(0.0),
    }


def test_rolls_sum_norm_divides_the_mini_batch_token_sums_by_the_constant_alone_however_it_is_split():
    """ROLL's ``agg_loss`` for seq-mean-token-sum-norm: every token's loss of the mini-batch summed and divided by
    ``sequence_length - 1`` (rl-core's ``token-sum-norm`` with ``norm_length``), not by the micro-batch's width and
    not by the number of sequences; two micro-batches' shares add up to the whole mini-batch's."""
    from rl_core.losses import get_policy_loss

    batch, outputs, info = _batch_and_outputs()
    objective = ActorObjective(loss_agg_mode="token-sum-norm", norm_length=99.0)
    whole, _ = objective(outputs, batch, info)
    cols = batch.batch
    token_sum, _ = get_policy_loss("vanilla")(cols["old_log_probs"], outputs["log_probs"], cols["advantages"],
                                              cols["response_mask"], loss_agg_mode="token-sum")  # fmt: skip
    assert float(whole) == pytest.approx(float(token_sum) / 99.0, rel=1e-6)
    shares = []
    for rows in (slice(0, 1), slice(1, 2)):
        part = RolloutBatch.from_dict({k: v[rows] for k, v in cols.items()}, {})
        shares.append(objective({"log_probs": outputs["log_probs"][rows]}, part, info)[0])
    assert float(sum(shares)) == pytest.approx(float(whole), rel=1e-6)

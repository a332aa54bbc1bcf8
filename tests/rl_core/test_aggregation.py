import math

import pytest
import torch

from rl_core.losses import LOSS_AGGREGATIONS, GlobalBatchInfo, agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # third sequence has no valid token

EXPECTED = {
    "token-mean": (1 + 2 + 4) / 3,
    "token-sum": 7.0,
    "seq-mean-token-sum": (3 + 4) / 2,
    "seq-mean-token-mean": (1.5 + 4) / 2,
    "seq-mean-token-sum-norm": (3 + 4) / (2 * 3),
    "token-sum-norm": (3 + 4) / 3,  # ROLL's seq-mean-token-sum-norm: the width alone, no mean over sequences
}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_hand_computed_values(mode):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(EXPECTED[mode], abs=1e-6)


def test_every_registered_mode_has_a_hand_value():
    assert set(LOSS_AGGREGATIONS.names()) == set(EXPECTED)


def test_norm_length_overrides_response_length():
    info = GlobalBatchInfo.from_mask(MASK, norm_length=10)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_batch=info).item() == pytest.approx(7 / 20)
    assert agg_loss(LOSS, MASK, "token-sum-norm", global_batch=info).item() == pytest.approx(7 / 10)


def test_masked_out_nan_does_not_leak():
    loss = LOSS.clone().requires_grad_(True)
    for mode in EXPECTED:
        poisoned = torch.where(MASK.bool(), loss, torch.full_like(loss, float("nan")))
        out = agg_loss(poisoned, MASK, mode)
        out.backward()
        assert math.isfinite(out.item())
        assert torch.isfinite(loss.grad).all()
        loss.grad = None


def test_all_zero_mask_gives_zero_not_nan():
    for mode in EXPECTED:
        out = agg_loss(LOSS, torch.zeros_like(MASK), mode)
        assert out.item() == 0.0


def test_unknown_mode_names_the_key():
    with pytest.raises(ValueError, match=r"loss_agg_mode.*token-mean"):
        agg_loss(LOSS, MASK, "token_mean")


def test_shape_mismatch_is_explained():
    with pytest.raises(ValueError, match="shape"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")


def _random_case(seed, batch=8, length=7):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=g) > 0.4
    mask[2] = False  # an empty sequence somewhere in the middle
    return loss, mask


@pytest.mark.parametrize("mode", sorted(EXPECTED))
@pytest.mark.parametrize("splits", [[8], [1] * 8, [4, 4], [3, 5], [2, 1, 5]])
def test_micro_batches_sum_to_the_full_batch(mode, splits):
    loss, mask = _random_case(seed=len(splits))
    full = agg_loss(loss, mask, mode)
    info = GlobalBatchInfo.from_mask(mask)
    parts = [
        agg_loss(lp, mp, mode, global_batch=info)
        for lp, mp in zip(torch.split(loss, splits), torch.split(mask, splits), strict=True)
    ]
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-12)


def test_data_parallel_ranks_then_micro_batches():
    """2 DP ranks x 2 micro-batches each: the per-rank sums, averaged the way DDP does (sum / world), times the
    world size, equal the global loss."""
    loss, mask = _random_case(seed=11)
    info = GlobalBatchInfo.from_mask(mask)
    full = agg_loss(loss, mask, "seq-mean-token-mean")
    ranks = [(loss[:4], mask[:4]), (loss[4:], mask[4:])]
    per_rank = [
        sum(agg_loss(lp, mp, "seq-mean-token-mean", global_batch=info) for lp, mp in zip(lr.split(2), mr.split(2)))
        for lr, mr in ranks
    ]
    ddp_mean = sum(per_rank) / 2
    assert (ddp_mean * 2).item() == pytest.approx(full.item(), abs=1e-12)

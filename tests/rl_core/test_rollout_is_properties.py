"""Property tests for rollout importance sampling: hostile log-probs (NaN, +-Inf, +-1e4 gaps) and masks (all zero,
ragged) never crash it, never produce non-finite weights or metrics, the returned mask only removes tokens, and the veto
acts on the mask alone (verl's convention: weights of vetoed / rejected tokens keep their bounded values)."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rl_core.rollout_is import IS_LEVELS, IS_MODES, compute_rollout_is_weights

SPECIALS = (math.nan, math.inf, -math.inf, 1e4, -1e4, 0.0)
LOG_PROB = st.one_of(st.floats(-60.0, 0.0, width=32), st.sampled_from(SPECIALS))


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 7))
    old = draw(arrays(np.float32, (b, t), elements=LOG_PROB))
    rollout = draw(arrays(np.float32, (b, t), elements=LOG_PROB))
    mask = draw(
        st.one_of(
            arrays(np.bool_, (b, t)),
            st.just(np.zeros((b, t), dtype=np.bool_)),
            st.just(np.ones((b, t), dtype=np.bool_)),
        )
    )
    return torch.from_numpy(old), torch.from_numpy(rollout), torch.from_numpy(mask)


SETTINGS = settings(max_examples=100, deadline=None)
OPTIONS = {
    "level": st.sampled_from(IS_LEVELS.names()),
    "mode": st.sampled_from(IS_MODES.names()),
    "threshold": st.floats(1.0, 20.0),
    "lower": st.one_of(st.none(), st.floats(1e-3, 1.0)),
    "veto": st.one_of(st.none(), st.floats(1e-8, 0.5)),
}


@SETTINGS
@given(batch=batches(), **OPTIONS)
def test_hostile_inputs_give_finite_weights_and_only_remove_tokens(
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    level: str,
    mode: str,
    threshold: float,
    lower: float | None,
    veto: float | None,
) -> None:
    old, rollout, mask = batch
    weights, new_mask, metrics = compute_rollout_is_weights(
        old, rollout, mask, level=level, mode=mode, threshold=threshold, threshold_lower=lower, veto_threshold=veto
    )
    assert weights is not None
    assert weights.shape == old.shape and new_mask.shape == mask.shape and new_mask.dtype == mask.dtype
    assert torch.isfinite(weights).all()
    assert (weights >= 0).all()
    assert not (new_mask & ~mask).any()  # only ever removes tokens
    assert not weights[~mask].any()  # zero at padding (rejected / vetoed tokens keep their bounded weights)
    if mode == "truncate":
        assert (weights <= threshold * (1 + 1e-6)).all()
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), metrics
    assert 0.0 <= metrics["mismatch/rollout_is_eff_sample_size"] <= 1.0 + 1e-6
    for key, value in metrics.items():
        if key.endswith("_fraction"):
            assert 0.0 <= value <= 1.0 + 1e-6, key
    # a valid token whose gap is not finite always takes its whole sequence out
    bad_rows = (mask & ~torch.isfinite(old - rollout)).any(-1)
    assert not new_mask[bad_rows].any()
    # the veto only removes tokens from the mask: the weights are those computed without it
    unvetoed, _, _ = compute_rollout_is_weights(
        old, rollout, mask, level=level, mode=mode, threshold=threshold, threshold_lower=lower, veto_threshold=None
    )
    assert unvetoed is not None and torch.equal(weights, unvetoed)


@SETTINGS
@given(batch=batches(), fill=st.sampled_from(SPECIALS), **OPTIONS)
def test_padding_never_matters(
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    fill: float,
    level: str,
    mode: str,
    threshold: float,
    lower: float | None,
    veto: float | None,
) -> None:
    old, rollout, mask = batch
    options = {"level": level, "mode": mode, "threshold": threshold, "threshold_lower": lower, "veto_threshold": veto}
    weights, new_mask, metrics = compute_rollout_is_weights(old, rollout, mask, **options)  # type: ignore[arg-type]
    old2, rollout2 = old.clone(), rollout.clone()
    old2[~mask], rollout2[~mask] = fill, -fill
    weights2, new_mask2, metrics2 = compute_rollout_is_weights(old2, rollout2, mask, **options)  # type: ignore[arg-type]
    assert weights is not None and weights2 is not None
    assert torch.equal(weights, weights2)
    assert torch.equal(new_mask, new_mask2)
    assert metrics == metrics2


@SETTINGS
@given(batch=batches(), level=OPTIONS["level"], mode=OPTIONS["mode"])
def test_all_zero_mask_is_a_no_op(
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], level: str, mode: str
) -> None:
    old, rollout, mask = batch
    empty = torch.zeros_like(mask)
    weights, new_mask, metrics = compute_rollout_is_weights(old, rollout, empty, level=level, mode=mode)
    assert weights is not None and not weights.any()
    assert not new_mask.any()
    assert all(v == 0.0 for v in metrics.values())

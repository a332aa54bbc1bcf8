"""KL controllers: the Ziegler et al. update by hand, state round trips, factory validation."""

from __future__ import annotations

import pytest

from rl_core.kl_control import AdaptiveKLController, FixedKLController, build_kl_controller


def test_fixed_controller_never_moves() -> None:
    ctrl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctrl.update(kl, n_steps=64)
    assert ctrl.value == 0.05


def test_adaptive_update_matches_formula_by_hand() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, kl_horizon=100)
    ctrl.update(0.15, n_steps=10)  # error .5 -> clipped to .2: 0.2 * (1 + .2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.2 * 1.02, abs=1e-15)
    ctrl.update(0.09, n_steps=10)  # error -.1 (inside the clip): * (1 - .1 * 10 / 100)
    assert ctrl.value == pytest.approx(0.2 * 1.02 * 0.99, abs=1e-15)
    ctrl.update(0.0, n_steps=50)  # error -1 -> clipped to -.2: * (1 - .2 * 50 / 100)
    assert ctrl.value == pytest.approx(0.2 * 1.02 * 0.99 * 0.9, abs=1e-15)
    ctrl.update(0.1, n_steps=1000)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.2 * 1.02 * 0.99 * 0.9, abs=1e-15)


def test_state_dict_round_trip_resumes_exactly() -> None:
    kls = [0.3, 0.01, 0.12, 0.5, 0.08]
    uninterrupted = build_kl_controller(0.2, target_kl=0.1, kl_horizon=500)
    for kl in kls:
        uninterrupted.update(kl, n_steps=32)
    first = build_kl_controller(0.2, target_kl=0.1, kl_horizon=500)
    for kl in kls[:2]:
        first.update(kl, n_steps=32)
    resumed = build_kl_controller(0.2, target_kl=0.1, kl_horizon=500)
    resumed.load_state_dict(first.state_dict())
    for kl in kls[2:]:
        resumed.update(kl, n_steps=32)
    assert resumed.value == uninterrupted.value
    fixed = FixedKLController(0.3)
    restored = FixedKLController(0.0)
    restored.load_state_dict(fixed.state_dict())
    assert restored.value == 0.3


def test_loading_the_other_kind_raises() -> None:
    with pytest.raises(ValueError, match="target_kl setting changed"):
        FixedKLController(0.1).load_state_dict(AdaptiveKLController(0.1, 0.1, 10).state_dict())


def test_factory_picks_the_controller() -> None:
    assert isinstance(build_kl_controller(0.2), FixedKLController)
    assert isinstance(build_kl_controller(0.2, target_kl=0.05), AdaptiveKLController)
    assert build_kl_controller(0.2, target_kl=None, kl_horizon=0).value == 0.2  # horizon unused when fixed


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"init_kl_coef": 0.2, "target_kl": 0.1, "kl_horizon": 0}, "kl_horizon"),
        ({"init_kl_coef": 0.2, "target_kl": 0.1, "kl_horizon": -5}, "kl_horizon"),
        ({"init_kl_coef": 0.2, "target_kl": 0.0}, "target_kl"),
        ({"init_kl_coef": -0.1}, "init_kl_coef"),
        ({"init_kl_coef": float("nan"), "target_kl": 0.1}, "init_kl_coef"),
    ],
)
def test_factory_validation_names_the_key(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        build_kl_controller(**kwargs)


def test_non_finite_kl_is_rejected() -> None:
    ctrl = AdaptiveKLController(0.1, 0.1, 10)
    with pytest.raises(ValueError, match="non-finite batch KL"):
        ctrl.update(float("nan"), n_steps=1)
    assert ctrl.value == 0.1

"""KL-coefficient controllers for the KL-in-reward penalty (``add_token_level_kl``).

Config keys (ROLL): ``init_kl_coef``, ``target_kl`` (None = fixed coefficient), ``kl_horizon``.
The controller's ``value`` is the coefficient ``beta`` in ``r_t = score_t - beta * KL_t``; call
``update(current_kl, n_steps)`` once per rollout batch with the measured batch KL and the batch size.
"""

from __future__ import annotations

import math
from typing import Protocol


class KLController(Protocol):
    """What every controller offers: the current coefficient, an update, and exact state for resume."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float | str]: ...

    def load_state_dict(self, state: dict[str, float | str]) -> None: ...


def _check_coef(init_kl_coef: float) -> None:
    if not (math.isfinite(init_kl_coef) and init_kl_coef >= 0):
        raise ValueError(f"init_kl_coef must be a finite number >= 0, got {init_kl_coef}")


def _load_value(state: dict[str, float | str], kind: str) -> float:
    if state.get("kind") != kind:
        raise ValueError(
            f"cannot load a {state.get('kind')!r} KL controller state into a {kind!r} controller; "
            "the run's target_kl setting changed since the checkpoint"
        )
    return float(state["value"])


class FixedKLController:
    """Constant coefficient ``init_kl_coef``; ``update`` does nothing."""

    def __init__(self, init_kl_coef: float) -> None:
        _check_coef(init_kl_coef)
        self._value = float(init_kl_coef)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": "fixed", "value": self._value}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        self._value = _load_value(state, "fixed")


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 (arXiv:1909.08593, sec. 2.2).

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / kl_horizon)``.
    The coefficient rises while the KL is above target and falls while below, at most 20% per horizon.
    """

    PROPORTIONAL_CLIP = 0.2

    def __init__(self, init_kl_coef: float, target_kl: float, kl_horizon: float) -> None:
        _check_coef(init_kl_coef)
        if not (math.isfinite(target_kl) and target_kl > 0):
            raise ValueError(
                f"target_kl must be > 0 for adaptive KL control (or None for a fixed one), got {target_kl}"
            )
        if not kl_horizon > 0:
            raise ValueError(f"kl_horizon must be > 0 for adaptive KL control, got {kl_horizon}")
        self._value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.kl_horizon = float(kl_horizon)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping ``current_kl`` at ``target_kl``; ``n_steps`` = samples seen."""
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL control got a non-finite batch KL {current_kl}; check the log-probs")
        clip = self.PROPORTIONAL_CLIP
        error = min(max(current_kl / self.target_kl - 1.0, -clip), clip)
        self._value *= 1.0 + error * n_steps / self.kl_horizon

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": "adaptive", "value": self._value}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        self._value = _load_value(state, "adaptive")


def build_kl_controller(
    init_kl_coef: float, target_kl: float | None = None, kl_horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """Fixed controller when ``target_kl`` is None, adaptive otherwise (ROLL defaults: 0.2 / None / 10000)."""
    if target_kl is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target_kl, kl_horizon)

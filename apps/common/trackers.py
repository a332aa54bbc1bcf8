"""Experiment trackers by ROLL's ``track_with`` (one registry): stdout, tensorboard, wandb.

Every tracker takes ``(step, metrics)``; ``tracker_kwargs`` go to its constructor (``log_dir`` for tensorboard;
``project``, ``name``, ``tags``, ``notes``, ``mode`` ... for wandb, which runs offline unless ``mode: online``).
The pipeline also always writes ``metrics.jsonl`` (rl-replay's format), whatever the tracker.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from rl_core.registry import Registry


class Tracker(Protocol):
    """What a pipeline logs to."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record one step's metrics."""

    def close(self) -> None:
        """Flush and release."""


TrackerFactory = Callable[..., Tracker]
TRACKERS: Registry[TrackerFactory] = Registry("tracker", "track_with")


@TRACKERS.register("stdout")
class StdoutTracker:
    """One line per step with the ``shown`` metrics (all of them when ``shown`` is empty)."""

    def __init__(
        self, *, output_dir: Path, exp_name: str, shown: tuple[str, ...] = (), log: Callable[[str], None] = print
    ) -> None:
        self.shown, self.write, self.prefix = shown, log, exp_name

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Print ``[exp_name] step N: key=value ...``."""
        keys = [k for k in self.shown if k in metrics] if self.shown else sorted(metrics)
        self.write(f"[{self.prefix}] step {step}: " + " ".join(f"{k}={metrics[k]:.4g}" for k in keys))

    def close(self) -> None:
        """Nothing to release."""


@TRACKERS.register("tensorboard")
class TensorboardTracker:
    """Scalars in TensorBoard event files under ``log_dir`` (default ``<output_dir>/tensorboard``)."""

    def __init__(self, *, output_dir: Path, exp_name: str, log_dir: str | None = None, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir) if log_dir else output_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir / exp_name))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One scalar per metric."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush the event file."""
        self.writer.close()


WANDB_DIRS = ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")


@TRACKERS.register("wandb")
class WandbTracker:
    """Weights & Biases; offline (no account needed) unless ``tracker_kwargs.mode: online``. Runs, cache, config
    and data go under ``tracker_kwargs.dir`` (default ``output_dir``) unless the WANDB_*_DIR variables say else."""

    def __init__(self, *, output_dir: Path, exp_name: str, **kwargs: Any) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError(
                "track_with: wandb needs the wandb package (`pip install wandb`); or use tensorboard / stdout."
            ) from None
        kwargs.pop("shown", None)
        kwargs.pop("log", None)
        kwargs.pop("api_key", None)  # never logged; set WANDB_API_KEY in system_envs / the environment instead
        kwargs.setdefault("mode", "offline")
        kwargs.setdefault("name", exp_name)
        kwargs.setdefault("dir", str(output_dir))
        # Nothing under ~ unless asked: wandb's service process takes these directories when init starts it.
        root = Path(kwargs["dir"]) / "wandb"
        dirs = {v: str(root / v.split("_")[1].lower()) for v in WANDB_DIRS if v not in os.environ}
        os.environ.update(dirs)
        try:
            self.run = wandb.init(**kwargs)
        finally:
            for variable in dirs:
                os.environ.pop(variable, None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """``wandb.log`` at ``step``."""
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the run."""
        self.run.finish()


def build_trackers(
    name: str, *, output_dir: Path, exp_name: str, kwargs: Mapping[str, Any], stdout: StdoutTracker
) -> list[Tracker]:
    """The stdout line always, plus the tracker ``track_with`` names, built with ``tracker_kwargs``."""
    factory = TRACKERS.get(name)
    if factory is StdoutTracker:
        return [stdout]
    return [stdout, factory(output_dir=output_dir, exp_name=exp_name, **dict(kwargs))]

"""Experiment trackers by ROLL's ``track_with`` (one registry): stdout, tensorboard, wandb.

Every tracker takes ``(step, metrics)``; ``tracker_kwargs`` go to its constructor (``log_dir`` for tensorboard;
``project``, ``name``, ``tags``, ``notes``, ``mode`` ... for wandb, which runs offline unless ``mode: online``).
The pipeline also always writes ``metrics.jsonl`` (rl-replay's format), whatever the tracker.

A resumed run starts at ``first_step`` (the checkpoint's step + 1); the run it resumes may have logged steps past its
last checkpoint before it was killed. Whatever can forget them does, so the logs read as one run:
``keep_metrics_before`` for metrics.jsonl, TensorBoard's ``purge_step``; wandb cannot (see ``WandbTracker``).
"""

from __future__ import annotations

import json
import math
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
ROLL_TRACKERS = ("tensorboard", "wandb", "stdout", "swanlab", "trackio")
"""The ``track_with`` values ROLL's own tracker registry has (its roll/utils/tracking.py)."""


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
    """Scalars in TensorBoard event files under ``log_dir`` (default ``<output_dir>/tensorboard``).

    Earlier event files of the same ``exp_name`` stay, but TensorBoard hides their steps from ``first_step`` on
    (``purge_step``): a resumed run replaces what the killed run logged after its checkpoint, a new run (step 0)
    replaces an earlier run's curves, as metrics.jsonl does.
    """

    def __init__(
        self, *, output_dir: Path, exp_name: str, log_dir: str | None = None, first_step: int = 0, **_: Any
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir) if log_dir else output_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir / exp_name), purge_step=first_step)

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
    and data go under ``tracker_kwargs.dir`` (default ``output_dir``) unless the WANDB_*_DIR variables say else.

    ``first_step`` is ignored: an offline run is a new ``offline-run-*`` folder each time and its records cannot be
    rewritten, so after a resume the killed run's folder keeps the steps it logged past its checkpoint (sync only
    the resumed run's folder, or take the curves from metrics.jsonl, which holds each step once).
    """

    def __init__(self, *, output_dir: Path, exp_name: str, first_step: int = 0, **kwargs: Any) -> None:
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
    name: str,
    *,
    output_dir: Path,
    exp_name: str,
    kwargs: Mapping[str, Any],
    stdout: StdoutTracker,
    first_step: int = 0,
) -> list[Tracker]:
    """The stdout line always, plus the tracker ``track_with`` names, built with ``tracker_kwargs``, for a run that
    logs from ``first_step`` on (after a resume: the checkpoint's step + 1)."""
    factory = TRACKERS.get(name)
    if factory is StdoutTracker:
        return [stdout]
    return [stdout, factory(output_dir=output_dir, exp_name=exp_name, first_step=first_step, **dict(kwargs))]


def keep_metrics_before(path: Path, first_step: int) -> None:
    """Drop the lines of steps ``>= first_step`` from the JSONL metrics log at ``path``, and a last line a kill cut
    short (no newline), so that a run resumed at ``first_step`` appends each step once. Atomic: a kill leaves
    either file. Lines it cannot read stay, for ``rl-replay compare-metrics`` to report."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    kept = [line for line in lines if _logged_step(line) < first_step]
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept), encoding="utf-8")
    os.replace(partial, path)


def _logged_step(line: str) -> int | float:
    """The ``step`` of a metrics line; -inf (kept) when the line holds none."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return -math.inf
    return step if isinstance(step, int) else -math.inf

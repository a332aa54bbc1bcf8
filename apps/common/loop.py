"""The outer loop both pipelines run: resume, steps with validation, metrics.jsonl and trackers, checkpoints, the
progress bar, then the timeline and the curves. A pipeline supplies the pieces (``LoopPipeline``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from apps.common.plots import DEFAULT_CURVES, plot_metrics
from apps.common.progress import StepProgress
from apps.common.timeline import Timeline
from apps.common.trackers import StdoutTracker, build_trackers, keep_metrics_before
from apps.common.training import prune_checkpoints, resume_folder
from rl_replay.metrics import append_metrics


class LoopPipeline(Protocol):
    """What :func:`run_loop` drives."""

    log: Callable[[str], None]
    progress_bar: bool | None
    timeline: Timeline

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def step(self, step: int) -> dict[str, float]: ...
    def validates_at(self, step: int) -> bool: ...
    def validate(self, step: int) -> dict[str, float]: ...


@runtime_checkable
class CheckpointedPipeline(LoopPipeline, Protocol):
    """A pipeline that trains: :func:`run_loop` also saves it every ``save_steps`` and resumes it. One without these
    (the rollout pipelines) neither saves nor resumes."""

    def resume(self, folder: Path) -> int: ...  # returns the checkpoint's step
    def save(self, step: int) -> Path: ...


def run_loop(pipeline: LoopPipeline, config: Any, name: str, shown: tuple[str, ...],
             curves: Sequence[tuple[str, str]] = DEFAULT_CURVES, steps: int | None = None,
             subdir: str | None = None) -> list[dict[str, float]]:  # fmt: skip
    """All of ``config.max_steps`` steps (``steps`` when given; after a resume, the rest); returns each step's
    metrics.

    ``config`` has the shared top-level keys (output_dir, max_steps, logging / save steps, trackers, resume);
    ``name`` prefixes log lines; ``shown`` are the metrics of the stdout line; ``curves`` those of curves.png.
    ``subdir``: the run writes its files under ``<output_dir>/<subdir>`` and names its tracker run
    ``<exp_name>_<subdir>`` (a run that trains nothing, given a training file: the training run's metrics.jsonl,
    curves and tracker runs in output_dir stay as they are).
    """
    max_steps = config.max_steps if steps is None else steps
    output = Path(config.output_dir) / (subdir or "")
    exp_name = f"{config.exp_name}_{subdir}" if subdir else config.exp_name
    output.mkdir(parents=True, exist_ok=True)
    saving = pipeline if isinstance(pipeline, CheckpointedPipeline) else None
    resume_from = None if saving is None else resume_folder(config)
    first = 0 if resume_from is None else saved_step(resume_from) + 1
    if resume_from is None:
        (output / "metrics.jsonl").unlink(missing_ok=True)  # a new run; a resumed one appends
    history = []
    progress = StepProgress(max_steps, 0, desc=exp_name, enabled=pipeline.progress_bar)
    if pipeline.log is print:  # log lines above the bar
        pipeline.log = progress.write
    stdout = StdoutTracker(output_dir=output, exp_name=name, shown=shown, log=pipeline.log)
    trackers = build_trackers(config.track_with, output_dir=output, exp_name=exp_name,
                              kwargs=config.tracker_kwargs, stdout=stdout, first_step=first)  # fmt: skip
    try:
        pipeline.start()  # in the try: stop() frees what a start that failed half-way took
        if saving is not None and resume_from is not None:
            saving.resume(resume_from)
            # The run resumed may have logged steps after its checkpoint before it was killed: this run redoes them.
            keep_metrics_before(output / "metrics.jsonl", first)
            pipeline.timeline.resume(output / "timeline.json", first)
        progress.bar.update(first)
        for step in range(first, max_steps):
            # as ROLL: validation first, on the weights of `step` updates (step 0: the model before any)
            validation = pipeline.validate(step) if pipeline.validates_at(step) else {}
            metrics = pipeline.step(step)
            metrics.update(validation)
            history.append(metrics)
            append_metrics(output / "metrics.jsonl", step, metrics)
            if step % config.logging_steps == 0:
                for tracker in trackers:
                    tracker.log(step, metrics)
            if saving is not None and ((step + 1) % config.save_steps == 0 or step + 1 == max_steps):
                saving.save(step)
                if deleted := prune_checkpoints(config):
                    pipeline.log(f"[{name}] Cleaning up old checkpoints. Keeping {config.max_ckpt_to_keep}, deleting "
                                 f"steps: {deleted}")  # fmt: skip
                pipeline.timeline.write(output / "timeline.json")  # what a resume from this checkpoint continues
            progress.update(metrics)
    finally:
        progress.close()
        for tracker in trackers:
            tracker.close()
        pipeline.stop()
    pipeline.timeline.write(output / "timeline.json")
    plot = plot_metrics(output / "metrics.jsonl", output / "curves.png", curves)
    if plot is not None:
        pipeline.log(f"[{name}] curves: {plot}")
    return history


def saved_step(folder: Path) -> int:
    """The step of the checkpoint in ``folder`` (its ``pipeline_state.json``, which both pipelines write)."""
    return int(json.loads((folder / "pipeline_state.json").read_text())["step"])


def cli_main(argv: Sequence[str] | None, prog: str, description: str, build: Callable[[dict[str, Any]], Any]) -> int:
    """``prog --config_path DIR --config_name NAME [key=value ...]``: load the YAML, ``build`` the pipeline from the
    mapping, run it. A config error exits 2 with its message (no traceback)."""
    from apps.common.yaml_config import load_config
    from rl_replay.errors import ReplayError

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config_path", required=True, help="folder holding the YAML config")
    parser.add_argument("--config_name", required=True, help="file name without .yaml")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. max_steps=5")
    args = parser.parse_args(argv)
    path = Path(args.config_path) / f"{args.config_name.removesuffix('.yaml')}.yaml"
    try:
        pipeline = build(load_config(path, args.overrides))
    except (ValueError, FileNotFoundError, ReplayError) as err:  # bad config, missing file, missing dump
        print(f"config error: {err}", file=sys.stderr)
        return 2
    pipeline.run()
    return 0

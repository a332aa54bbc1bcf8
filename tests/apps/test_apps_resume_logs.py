"""A resumed run's logs read as one run: what the killed run logged after its checkpoint is dropped from
metrics.jsonl, timeline.json and TensorBoard (wandb offline cannot; see WandbTracker). The pipelines' end-to-end
resume tests (tests/apps/test_apps_rlvr_pipeline.py, tests/apps/agentic/test_agentic_pipeline.py) check the same
through a real kill-and-resume; these check each piece alone, without Ray."""

from __future__ import annotations

import json
import time

import pytest

from apps.common.timeline import Timeline
from apps.common.trackers import StdoutTracker, build_trackers, keep_metrics_before
from rl_replay.metrics import append_metrics, read_jsonl


def test_metrics_after_the_checkpoint_and_a_cut_line_are_dropped(tmp_path):
    log = tmp_path / "metrics.jsonl"
    for step in range(5):  # the killed run logged steps 0-4; its last checkpoint was step 2
        append_metrics(log, step, {"actor/pg_loss": float(step)})
    with open(log, "a", encoding="utf-8") as f:
        f.write('{"step": 5, "actor/pg_')  # the kill cut this line short
    keep_metrics_before(log, 3)
    append_metrics(log, 3, {"actor/pg_loss": 30.0})  # the resumed run redoes step 3
    assert read_jsonl(str(log)) == {0: {"actor/pg_loss": 0.0}, 1: {"actor/pg_loss": 1.0},
                                    2: {"actor/pg_loss": 2.0}, 3: {"actor/pg_loss": 30.0}}  # fmt: skip
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2, 3]
    keep_metrics_before(tmp_path / "missing.jsonl", 3)  # nothing logged yet: nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def test_tensorboard_shows_the_resumed_steps_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def run(first_step, steps, loss):
        # TensorBoard reads a folder's event files in name order, which starts with the second they were created
        time.sleep(1.01 - time.time() % 1)
        stdout = StdoutTracker(output_dir=tmp_path, exp_name="rlvr", log=lambda line: None)
        trackers = build_trackers("tensorboard", output_dir=tmp_path, exp_name="exp", kwargs={}, stdout=stdout,
                                  first_step=first_step)  # fmt: skip
        for step in steps:
            trackers[1].log(step, {"actor/pg_loss": loss(step)})
        trackers[1].close()

    run(0, range(5), float)  # killed after step 4, last checkpoint at step 2
    run(3, range(3, 6), lambda step: 10.0 * step)  # resumed at step 3
    events = EventAccumulator(str(tmp_path / "tensorboard" / "exp"))  # both event files
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]  # fmt: skip
    run(0, range(2), lambda step: -1.0)  # a new run in the same folder replaces the earlier curves
    events = EventAccumulator(str(tmp_path / "tensorboard" / "exp"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(0, -1.0), (1, -1.0)]


def test_the_timeline_continues_the_saved_one_after_its_last_kept_step(tmp_path):
    path = tmp_path / "timeline.json"
    killed = Timeline()
    for step in range(3):
        timer = killed.timer({}, step)
        for phase in ("rollout", "train"):
            with timer(phase):
                pass
    killed.write(path)  # saved with checkpoint-2 ... then the run logged step 2 and was killed

    resumed = Timeline()
    resumed.resume(path, first_step=2)
    timings: dict[str, float] = {}
    with resumed.timer(timings, 2)("rollout"):
        pass
    resumed.write(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert [(e["args"]["step"], e["name"]) for e in events] == [(0, "rollout"), (0, "train"), (1, "rollout"),
                                                                 (1, "train"), (2, "rollout")]  # fmt: skip
    kept_end = max(e["ts"] + e["dur"] for e in events[:4])
    assert events[4]["ts"] >= kept_end and timings["time/rollout"] == pytest.approx(events[4]["dur"] / 1e6)
    assert not list(tmp_path.glob("*.partial"))


def test_a_missing_or_foreign_timeline_starts_empty(tmp_path):
    timeline = Timeline()
    timeline.resume(tmp_path / "timeline.json", first_step=3)
    (tmp_path / "other.json").write_text('["not a trace"]')
    timeline.resume(tmp_path / "other.json", first_step=3)
    assert timeline.events == []

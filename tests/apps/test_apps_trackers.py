"""Trackers by track_with: the stdout line, TensorBoard event files (read back), wandb offline (no account),
wandb's missing-package error."""

from __future__ import annotations

import sys
import time

import pytest

from apps.common.trackers import StdoutTracker, build_trackers
from apps.rlvr.config import RLVRConfig
from rl_engines.config import WorkerConfigError
from rl_replay.metrics import read_metrics


def test_tensorboard_events_hold_what_was_logged(tmp_path):
    lines: list[str] = []
    stdout = StdoutTracker(output_dir=tmp_path, exp_name="rlvr", shown=("actor/pg_loss",), log=lines.append)
    trackers = build_trackers("tensorboard", output_dir=tmp_path, exp_name="exp", kwargs={}, stdout=stdout)
    for step, loss in enumerate((0.5, 0.25)):
        for tracker in trackers:
            tracker.log(step, {"actor/pg_loss": loss, "critic/score/mean": 1.0 - loss})
    for tracker in trackers:
        tracker.close()
    assert lines == ["[rlvr] step 0: actor/pg_loss=0.5", "[rlvr] step 1: actor/pg_loss=0.25"]
    logged = read_metrics(str(tmp_path / "tensorboard" / "exp"))
    assert logged[0]["actor/pg_loss"] == pytest.approx(0.5) and logged[1]["critic/score/mean"] == pytest.approx(0.75)


def test_wandb_runs_offline_without_an_account_and_writes_only_under_its_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for variable in ("WANDB_API_KEY", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # anything written under ~ would show up here
    monkeypatch.setenv("WANDB_SILENT", "true")
    stdout = StdoutTracker(output_dir=tmp_path, exp_name="rlvr", log=lambda line: None)
    trackers = build_trackers("wandb", output_dir=tmp_path / "out", exp_name="exp", kwargs={"project": "p"},
                              stdout=stdout)  # fmt: skip
    for step, loss in enumerate((0.5, 0.125)):
        trackers[1].log(step, {"actor/pg_loss": loss})
    trackers[1].close()
    (run_file,) = (tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30
    while b"0.125" not in run_file.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)  # wandb's service process may still be flushing when finish() returns
    data = run_file.read_bytes()  # wandb's record log: the metric names and values are in it
    assert b"actor/pg_loss" in data and b"0.125" in data
    assert not (tmp_path / "home").exists()


def test_wandb_without_the_package_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    stdout = StdoutTracker(output_dir=tmp_path, exp_name="rlvr")
    with pytest.raises(ValueError, match=r"track_with: wandb needs the wandb package \(`pip install wandb`\)"):
        build_trackers("wandb", output_dir=tmp_path, exp_name="exp", kwargs={"project": "p"}, stdout=stdout)


def test_an_unknown_tracker_is_rejected_naming_the_key():
    """ROLL's Qwen3.5 / video files name an ml_tracker that ROLL's own registry lacks: said as such."""
    with pytest.raises(
        WorkerConfigError,
        match=r"track_with='ml_tracker' is not a tracker ROLL registers either "
        r"\(tensorboard, wandb, stdout, swanlab, trackio\); valid values",
    ):
        RLVRConfig.from_dict({"track_with": "ml_tracker"})
    with pytest.raises(WorkerConfigError, match=r"track_with='swanlab' is a ROLL tracker not built here; valid"):
        RLVRConfig.from_dict({"track_with": "swanlab"})

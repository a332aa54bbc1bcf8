"""A disk that fills up while the RLVR loop saves checkpoints, end to end on Ray: the first checkpoint fits, then
the workers may write files of at most 128 KiB (RLIMIT_FSIZE set inside them during saves, so writes fail with EFBIG
as on a full disk with ENOSPC).

The driver raises one error that names the failing rank, the checkpoint path and the sizes; no temporary or partial
folder is left; and once the limit is lifted, resuming from the last complete checkpoint equals the run that was not
interrupted, with metrics.jsonl, timeline.json and TensorBoard holding each step once (the failed run had logged
step 2 before its save failed, as a run killed while saving has).
"""

from __future__ import annotations

import json

import pytest
from rlvr_fixtures import file_size_limit_overrides, make_setup
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from apps.rlvr.__main__ import main
from rl_engines.worker_group import WorkerCallError

LIMIT = 128 << 10  # a rank's share of the tiny model's checkpoint is ~0.6 MiB; logs and small files stay below


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory.mktemp("rlvr_disk_full"))


def test_a_full_disk_fails_the_save_with_one_clear_error_and_resume_equals_the_uninterrupted_run(setup):
    out = setup / "out_disk_full"
    # entropy_loss_coef: the tiny random model earns no reward, so without it the policy would never move
    # one inference rank: saving is the training ranks' business, and each rank is a process to start
    base = ["--config_path", str(setup), "--config_name", "rlvr", "eval_steps=0", "max_steps=3", "save_steps=2",
            "entropy_loss_coef=0.01", "actor_infer.device_mapping=[0]", f"output_dir={out}"]  # fmt: skip
    with pytest.raises(WorkerCallError) as caught:  # saves checkpoint-1, trains step 2, cannot save checkpoint-2
        main([*base, *file_size_limit_overrides(setup, LIMIT, after=1)])
    error, target = caught.value, out / "checkpoints" / "checkpoint-2" / "actor_train"
    assert (error.role, error.method, error.follows_another_rank) == ("actor_train", "save_checkpoint", False)
    first_line = str(error).splitlines()[0]
    assert first_line.startswith(
        f"actor_train: rank {error.ranks[0]} raised in `save_checkpoint`: OutOfSpaceError: actor_train: rank "
        f"{error.ranks[0]} could not save checkpoint {target}: out of disk space ("
    ), first_line
    assert "It needs about " in first_line and "are free on that file system" in first_line, first_line
    assert "may write files of at most 128.00 KiB (ulimit -f)" in first_line, first_line
    assert "Fix: free space there, point output_dir (or checkpoint_config.output_dir)" in first_line, first_line
    assert "Traceback" not in str(error)  # the worker's traceback is the __cause__, printed once above it
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-1"]  # nothing half-written
    logged = _metrics(out)  # step 2 was trained (and logged) before its save failed
    uninterrupted = logged[2]

    assert main([*base, "resume_from_checkpoint=true"]) == 0  # the limit lifted: resumes from checkpoint-1
    assert (out / "checkpoints" / "checkpoint-2" / "pipeline_state.json").exists()
    assert [row["step"] for row in _rows(out)] == [0, 1, 2]  # the failed run's step 2 replaced, not repeated
    assert [_metrics(out)[step] for step in (0, 1)] == [logged[0], logged[1]]
    resumed = _metrics(out)[2]
    # the policy moved; and the reference ran (use_kl_loss needs it): with ROLL's stand-in for a reference that is off
    # (ref_log_probs = old_log_probs, test_apps_alignment.py) one epoch's KL loss would be 0
    assert uninterrupted["actor/grad_norm"] > 0 and uninterrupted["actor/kl_loss"] > 0
    for key in ("response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl",
                "actor/entropy", "actor/total_loss"):  # fmt: skip
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-9), key

    trace = json.loads((out / "timeline.json").read_text())["traceEvents"]
    phases = sorted((event["args"]["step"], event["name"]) for event in trace)
    assert phases == sorted({*phases}) and {step for step, _ in phases} == {0, 1, 2}  # each phase of a step once
    kept_end = max(event["ts"] + event["dur"] for event in trace if event["args"]["step"] < 2)
    assert min(event["ts"] for event in trace if event["args"]["step"] == 2) >= kept_end  # one time line
    events = EventAccumulator(str(out / "tensorboard" / "tiny_rlvr"))  # both runs' event files
    events.Reload()
    assert [event.step for event in events.Scalars("actor/pg_loss")] == [0, 1, 2]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _metrics(out):
    """metrics.jsonl by step."""
    return {row["step"]: row for row in _rows(out)}

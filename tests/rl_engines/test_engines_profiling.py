"""rl_engines.profiling: ROLL's per-call profiles (profiler_timeline / profiler_memory) on rank 0 of a role."""

from __future__ import annotations

import logging

import pytest
import torch

from rl_engines.profiling import MEMORY, OUTPUT_DIR, TIMELINE, profiled, profiler_env


def _work():
    torch.ones(64, 64) @ torch.ones(64, 64)


def test_a_timeline_is_written_per_call_on_rank_0_only(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMELINE, "1")
    monkeypatch.setenv(OUTPUT_DIR, str(tmp_path))
    with profiled("actor_train", 0, "train_step"):
        _work()
    with profiled("actor_train", 1, "train_step"):  # another rank: nothing
        _work()
    (trace,) = (tmp_path / "actor_train" / "train_step").glob("*.pt.trace.json")
    assert "aten::mm" in trace.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["actor_train"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device records snapshots")
def test_memory_snapshots_need_cuda_and_say_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(MEMORY, "1")
    monkeypatch.setenv(OUTPUT_DIR, str(tmp_path))
    with caplog.at_level(logging.WARNING), profiled("critic", 0, "compute_values"):
        _work()
    assert "profiler_memory records CUDA allocator snapshots; there is no CUDA device here" in caplog.text
    assert not list((tmp_path / "critic" / "compute_values").iterdir())


def test_the_workers_environment_for_the_settings(tmp_path):
    assert profiler_env(False, False, str(tmp_path)) == {}
    assert profiler_env(True, False, str(tmp_path)) == {TIMELINE: "1", OUTPUT_DIR: str(tmp_path.resolve())}
    with pytest.raises(ValueError, match="profiler_timeline and profiler_memory are both set"):
        profiler_env(True, True, str(tmp_path))

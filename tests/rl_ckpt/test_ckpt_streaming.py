"""mcore -> HF streams: when a PP stage's rank files are read, no tensor loaded for an earlier stage is alive.

The hook wraps ``torch.load`` and tracks every loaded model tensor with ``weakref.finalize``. A tensor stays alive
while anything refers to it, including views of it (a view keeps its base) and the plans built from them
(``iter_hf_sources``), so the count is what the converter really holds. The negative control shows the hook fails
a converter that keeps tensors across stages.
"""

import re
import weakref

import pytest
import torch

from rl_ckpt import convert_hf_to_mcore, convert_mcore_to_hf, iter_hf_tensors, open_mcore_checkpoint
from rl_ckpt.mcore_to_hf import iter_hf_sources


class LoadTracker:
    """Counts live tensors per PP stage, sampled at every rank-file load."""

    def __init__(self, real_load):
        self.real_load = real_load
        self.live: dict[int, int] = {}
        self.violations: list[str] = []
        self.per_stage: dict[int, int] = {}
        self.max_live = 0

    def _gone(self, stage):
        self.live[stage] -= 1

    def __call__(self, path, *args, **kwargs):
        stage = int(m.group(1)) if (m := re.search(r"mp_rank_\d\d_(\d{3})", str(path))) else 0
        earlier = {s: n for s, n in self.live.items() if s < stage and n}
        if earlier:
            self.violations.append(f"loading {path}: live tensors of earlier stages {earlier}")
        state = self.real_load(path, *args, **kwargs)
        tensors = [t for t in state["model"].values() if isinstance(t, torch.Tensor)]
        self.per_stage[stage] = max(self.per_stage.get(stage, 0), len(tensors))
        for t in tensors:
            self.live[stage] = self.live.get(stage, 0) + 1
            weakref.finalize(t, self._gone, stage)
        self.max_live = max(self.max_live, sum(self.live.values()))
        return state


@pytest.fixture
def pp4_checkpoint(tiny_hf, tmp_path):
    convert_hf_to_mcore(tiny_hf("qwen2", False), tmp_path / "mc", tp=2, pp=4)
    return tmp_path / "mc"


def test_ckpt_converter_holds_one_stage_at_a_time(pp4_checkpoint, tmp_path, monkeypatch):
    tracker = LoadTracker(torch.load)
    monkeypatch.setattr(torch, "load", tracker)
    ckpt = open_mcore_checkpoint(pp4_checkpoint)
    convert_mcore_to_hf(ckpt, tmp_path / "hf", max_shard_size=1)  # every tensor written out at once
    assert sorted(tracker.per_stage) == [0, 1, 2, 3]
    assert tracker.violations == []
    tp = 2
    assert tracker.max_live <= tp * max(tracker.per_stage.values())


def test_ckpt_tracker_catches_a_converter_that_keeps_tensors(pp4_checkpoint, monkeypatch):
    tracker = LoadTracker(torch.load)
    monkeypatch.setattr(torch, "load", tracker)
    kept = list(iter_hf_sources(open_mcore_checkpoint(pp4_checkpoint)))  # views of every stage's tensors
    assert kept
    assert len(tracker.violations) == 6  # on reading each of the 2 rank files of stages 1, 2 and 3


def test_ckpt_iter_hf_tensors_holds_one_stage_at_a_time(pp4_checkpoint, monkeypatch):
    tracker = LoadTracker(torch.load)
    monkeypatch.setattr(torch, "load", tracker)
    kept = list(iter_hf_tensors(open_mcore_checkpoint(pp4_checkpoint)))  # read into memory: no views kept
    assert kept and all(t.device.type == "cpu" for _, t in kept)
    assert tracker.violations == []

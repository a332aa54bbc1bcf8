"""Checkpoints and a full disk on the driver's side: the pre-flight warning when one checkpoint (or all the run's)
will not fit, and a failed save that leaves no half-written checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlvr_fixtures import file_size_limit, make_setup

from apps.common import checkpoint_space
from apps.common.checkpoint_space import checkpoint_bytes, checkpoint_space_warning
from apps.common.training import save_checkpoint
from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.pipeline import RLVRPipeline
from apps.rlvr.preflight import preflight
from rl_engines.disk_space import OutOfSpaceError, format_bytes, weights_numel


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory.mktemp("checkpoint_space"))


def _config(setup: Path, *overrides: str) -> RLVRConfig:
    config = RLVRConfig.from_dict(load_config(setup / "rlvr.yaml", ["max_steps=4", "save_steps=2", *overrides]))
    preflight(config)  # fills the roles' model paths from `pretrain`
    return config


def test_one_checkpoint_is_counted_from_the_model_files(setup):
    from transformers import AutoModelForCausalLM

    numel = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(setup / "model")).parameters())
    assert weights_numel(setup / "model") == numel  # read from the safetensors headers, nothing loaded
    assert checkpoint_bytes(_config(setup)) == numel * (4 + 8 + 4)  # fp32 weights, AdamW's moments, the HF export
    assert weights_numel("Qwen/Qwen2.5-0.5B") is None and weights_numel(setup) is None  # a hub id, no safetensors


def test_preflight_warns_with_both_numbers_when_checkpoints_will_not_fit(setup, monkeypatch):
    config = _config(setup)
    one, root = checkpoint_bytes(config), Path(config.output_dir) / "checkpoints"
    assert one
    free = {"bytes": one - 1}
    monkeypatch.setattr(checkpoint_space, "free_bytes", lambda path: free["bytes"] if Path(path) == root else 0)
    assert checkpoint_space_warning(config) == (
        f"[preflight] warning: {root} has {format_bytes(one - 1)} free, but one checkpoint needs about "
        f"{format_bytes(one)} (model + optimizer states of the training roles over all ranks, plus the HuggingFace "
        "export of the policy): the first save will fail. Free space there, point output_dir (or "
        "checkpoint_config.output_dir) at a larger disk, or save less often (raise save_steps) or keep fewer "
        "(max_ckpt_to_keep)."
    )
    free["bytes"] = one + one // 2  # max_steps=4, save_steps=2: two checkpoints, both kept
    assert ": room for 1 of the 2 checkpoints this run holds. " in str(checkpoint_space_warning(config))
    free["bytes"] = 2 * one
    assert checkpoint_space_warning(config) is None
    free["bytes"] = 3 * one  # every step saved: four; keeping two, three at once (the new one before the cleanup)
    assert ": room for 3 of the 4 checkpoints" in str(checkpoint_space_warning(_config(setup, "save_steps=1")))
    assert checkpoint_space_warning(_config(setup, "save_steps=1", "+max_ckpt_to_keep=2")) is None
    free["bytes"] = 0
    logged: list[str] = []
    RLVRPipeline(_config(setup), log=logged.append)  # the pipeline logs it before any worker starts
    assert [line for line in logged if line.startswith("[preflight] warning:")] == [checkpoint_space_warning(config)]


class _Group:
    def call(self, method: str, path: str) -> None:  # a role writes its folder
        Path(path).mkdir(parents=True)
        (Path(path) / "weights.bin").write_bytes(b"w" * 10)


class _Roles:
    def __init__(self) -> None:
        self.groups = {"actor_train": _Group()}

    def __getitem__(self, role: str) -> _Group:
        return self.groups[role]


def test_a_save_that_runs_out_of_space_leaves_no_checkpoint_folder(tmp_path):
    folder = tmp_path / "checkpoints" / "checkpoint-1"
    state = {"step": 1, "sampler": "x" * 100}
    with file_size_limit(64), pytest.raises(OutOfSpaceError) as caught:  # the driver's state is the last write
        save_checkpoint(_Roles(), folder, state)
    message = str(caught.value)
    assert message.startswith(f"the driver could not write {folder / 'pipeline_state.json'}: out of disk space ("), (
        message
    )
    assert "File too large" in message and f"It needs about {len(json.dumps(state, indent=2))} B; " in message
    assert not folder.exists() and list(tmp_path.rglob("*.tmp")) == []
    save_checkpoint(_Roles(), folder, {"step": 1})  # space is back
    assert sorted(p.name for p in folder.iterdir()) == ["actor_hf", "actor_train", "pipeline_state.json"]

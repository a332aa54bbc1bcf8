"""Dump / mock behaviour, the guide's log lines and its errors."""

import asyncio
import logging
import os
import pathlib

import numpy as np
import pytest
from replay_fakes import numpy_batch

from rl_replay import (
    ConfigError,
    DumpExistsError,
    DumpNotFoundError,
    MockFileNotFoundError,
    ReplayError,
    RolloutReplay,
    SplitNotDumpedError,
    StepsExceededError,
)


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger="rl_replay")
    return caplog


def messages(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == "rl_replay" and r.levelno == level]


def dump_steps(dump_dir, n, split="train", **kwargs):
    replay = RolloutReplay(dump_dir, "dump", **kwargs)
    for step in range(n):
        replay.dump(step, numpy_batch(seed=step), split)
    return replay


def test_log_lines_match_the_guide(tmp_path, log):
    d = str(tmp_path / "rollout_dumps" / "baseline_v1")
    replay = RolloutReplay(d, "dump")
    path = replay.dump(0, numpy_batch(samples=128))
    size = os.path.getsize(path) / (1024 * 1024)
    RolloutReplay(d, "mock").load(0)
    assert messages(log) == [
        f"[Rollout Mock] Rollout Mock enabled: mode=dump, dir={d}",
        f"[Rollout Mock] Dumped step 0: {d}/train/step_000000.safetensors (samples=128, size={size:.2f}MB)",
        f"[Rollout Mock] Rollout Mock enabled: mode=mock, dir={d}",
        f"[Rollout Mock] Loaded step 0: {d}/train/step_000000.safetensors (samples=128)",
    ]


def test_file_layout_is_split_and_six_digit_step(tmp_path):
    replay = RolloutReplay(tmp_path, "dump")
    replay.dump(3, numpy_batch(), "train")
    replay.dump(1234567, numpy_batch(), "val")
    names = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("step_*"))
    assert names == ["train/step_000003.safetensors", "val/step_1234567.safetensors"]
    assert (tmp_path / "manifest.json").is_file()
    assert replay.steps("train") == [3] and replay.steps("val") == [1234567]


def test_wrap_dumps_in_dump_mode_and_never_calls_in_mock_mode(tmp_path):
    calls = []

    def get_batch(step: int, batch_size: int = 4):
        calls.append(step)
        return numpy_batch(samples=batch_size, seed=step)

    dumping = RolloutReplay(tmp_path, "dump").wrap(get_batch)
    generated = [dumping(step) for step in range(3)]
    assert calls == [0, 1, 2] and dumping.__name__ == "get_batch"

    def must_not_run(step: int):
        raise AssertionError("the generator was called in mock mode")

    replaying = RolloutReplay(tmp_path, "mock").wrap(must_not_run)
    for step in range(3):
        got = replaying(step=step)
        assert got.keys() == generated[step].keys()
        for key in got:
            np.testing.assert_array_equal(got[key], generated[step][key], strict=True)


def test_wrap_as_decorator_with_step_callable_and_split(tmp_path):
    replay = RolloutReplay(tmp_path, "dump")

    class Data:
        def __init__(self, step):
            self.meta_info = {"global_step": step}

    @replay.wrap(split="val", step=lambda data: data.meta_info["global_step"])
    def get_batch(data):
        return {"x": np.full(2, data.meta_info["global_step"])}

    get_batch(Data(5))
    assert replay.steps("val") == [5] and replay.steps("train") == []


def test_wrap_finds_global_step_and_async_functions(tmp_path):
    replay = RolloutReplay(tmp_path, "dump")

    async def get_batch(data, global_step=0):
        return {"x": np.arange(3) + global_step}

    wrapped = replay.wrap(get_batch, split=lambda data, global_step=0: data)
    assert asyncio.run(wrapped("val", global_step=2))["x"].tolist() == [2, 3, 4]

    async def never(data, global_step=0):
        raise AssertionError("called")

    mocked = RolloutReplay(tmp_path, "mock").wrap(never, split="val")
    assert asyncio.run(mocked(None, global_step=2))["x"].tolist() == [2, 3, 4]


def test_wrap_without_a_step_argument_says_how_to_fix(tmp_path):
    def get_batch(data, batch_size):
        return data

    with pytest.raises(ConfigError, match=r"cannot find the step argument of .*get_batch\(data, batch_size\).*step="):
        RolloutReplay(tmp_path, "dump").wrap(get_batch)


def test_mock_instance_cannot_dump_and_bad_split_is_refused(tmp_path):
    dump_steps(tmp_path, 1)
    with pytest.raises(ReplayError, match="dump\\(\\) needs mode='dump'"):
        RolloutReplay(tmp_path, "mock").dump(1, {})
    with pytest.raises(ConfigError, match=r"one of \['train', 'val'\], got 'test'"):
        RolloutReplay(tmp_path, "mock").load(0, "test")
    with pytest.raises(ConfigError, match="non-negative int"):
        RolloutReplay(tmp_path, "mock").load(-1)


GUIDE_LINES = [
    "[Rollout Mock] Mock文件不存在: {path}",
    "可能的原因:",
    "1. 未在dump模式下运行过step {step}",
    "2. dump_dir配置不正确: {dir}",
    "3. mode不匹配(当前: {split})",
    "请先以dump模式运行,确保生成了所有步骤的数据。",
    "[Rollout Mock] Mock file not found: {path}",
    "Likely causes:",
    "1. step {step} was never run in dump mode",
    "2. dump_dir is not configured correctly: {dir}",
    "3. mode mismatch (current: {split})",
]


def guide_lines(d, split, step):
    path = os.path.join(d, split, f"step_{step:06d}.safetensors")
    return [line.format(path=path, step=step, dir=d, split=split) for line in GUIDE_LINES]


def test_missing_step_gives_the_guide_error(tmp_path):
    d = str(tmp_path)
    dump_steps(d, 6)
    replay = RolloutReplay(d, "mock")
    os.unlink(replay.step_path(5))  # the file vanished: the manifest still has it
    with pytest.raises(MockFileNotFoundError) as err:
        replay.load(5)
    assert isinstance(err.value, FileNotFoundError)
    assert str(err.value).splitlines()[: len(GUIDE_LINES)] == guide_lines(d, "train", 5)


def test_step_missing_from_the_manifest(tmp_path):
    replay = RolloutReplay(tmp_path, "dump")
    replay.dump(0, numpy_batch())
    replay.dump(2, numpy_batch())
    with pytest.raises(MockFileNotFoundError, match="Step 1 is missing from the dump") as err:
        RolloutReplay(tmp_path, "mock").load(1)
    assert str(err.value).splitlines()[:11] == guide_lines(str(tmp_path), "train", 1)


def test_split_never_dumped(tmp_path):
    dump_steps(tmp_path, 2, "train")
    with pytest.raises(SplitNotDumpedError, match=r"Split 'val' was never dumped .*dumped splits: \['train'\]") as err:
        RolloutReplay(tmp_path, "mock").load(0, "val")
    assert "3. mode不匹配(当前: val)" in str(err.value)


def test_more_steps_than_dumped(tmp_path):
    dump_steps(tmp_path, 3)
    replay = RolloutReplay(tmp_path, "mock")
    replay.check_max_steps(3)
    with pytest.raises(
        StepsExceededError, match=r"holds 3 steps \(last: step 2\); step 3 is beyond it.*max_steps"
    ) as err:
        replay.check_max_steps(4)
    assert "1. 未在dump模式下运行过step 3" in str(err.value)
    with pytest.raises(StepsExceededError):
        replay.load(50)


def test_mock_without_a_dump(tmp_path):
    with pytest.raises(DumpNotFoundError, match=r"no rl_replay dump \(manifest.json\) in .*same path as in dump mode"):
        RolloutReplay(tmp_path / "nowhere", "mock")


def test_mock_on_a_roll_pickle_dump_refuses_pickle(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "step_000000.pkl").write_bytes(b"\x80\x05N.")
    with pytest.raises(DumpNotFoundError, match="never loads pickle"):
        RolloutReplay(tmp_path, "mock")


def test_dump_refuses_another_runs_steps_unless_overwrite(tmp_path):
    dump_steps(tmp_path, 3)
    second = RolloutReplay(tmp_path, "dump")
    with pytest.raises(DumpExistsError) as err:
        second.dump(0, numpy_batch())
    text = str(err.value)
    assert str(tmp_path) in text and "3 step(s) of split 'train'" in text and "overwrite: true" in text
    assert RolloutReplay(tmp_path, "mock").steps() == [0, 1, 2]  # untouched

    third = RolloutReplay(tmp_path, "dump", overwrite=True)
    third.dump(0, {"new": np.ones(1)})
    assert third.steps() == [0]
    assert not os.path.exists(third.step_path(2))  # the old run's other steps are gone
    assert list(RolloutReplay(tmp_path, "mock").load(0)) == ["new"]


def test_files_without_manifest_also_count_as_another_run(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "step_000000.pkl").write_bytes(b"old")
    with pytest.raises(DumpExistsError):
        RolloutReplay(tmp_path, "dump").dump(0, {})


def test_one_run_redumps_a_step_and_two_splits_share_a_dir(tmp_path):
    train = RolloutReplay(tmp_path, "dump")
    val = RolloutReplay(tmp_path, "dump")  # e.g. the val scheduler of the same run
    train.dump(0, {"v": np.zeros(1)})
    val.dump(0, {"v": np.ones(1)}, "val")
    train.dump(0, {"v": np.full(1, 2.0)})  # a retried step replaces the file
    mock = RolloutReplay(tmp_path, "mock")
    assert mock.load(0)["v"].tolist() == [2.0] and mock.load(0, "val")["v"].tolist() == [1.0]


def test_mock_warns_when_deterministic_settings_differ(tmp_path, log, monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dump_steps(tmp_path, 2)
    RolloutReplay(tmp_path, "mock").load(0)
    assert messages(log, logging.WARNING) == []

    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    replay = RolloutReplay(tmp_path, "mock")
    replay.load(0)
    replay.load(1)
    warnings = messages(log, logging.WARNING)
    assert len(warnings) == 1  # once per split
    assert "[Rollout Mock] Deterministic settings differ from the dump" in warnings[0]
    assert "NCCL_ALGO: dump='Ring', now='Tree'" in warnings[0]
    assert "CUBLAS_WORKSPACE_CONFIG: dump=':4096:8', now=None" in warnings[0]


def test_manifest_records_versions_settings_sizes_and_checksums(tmp_path):
    import json
    import zlib

    dump_steps(tmp_path, 2)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["checksum"] == "crc32"
    info = manifest["splits"]["train"]
    assert {"rl_replay", "numpy", "safetensors", "python"} <= set(info["versions"])
    assert set(info["deterministic"]) >= {"NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG"}
    for step, record in info["steps"].items():
        data = (tmp_path / "train" / f"step_{int(step):06d}.safetensors").read_bytes()
        assert record["size"] == len(data) and record["crc32"] == f"{zlib.crc32(data):08x}"
        assert record["samples"] == 4 and record["file"] == f"train/step_{int(step):06d}.safetensors"


def test_load_works_in_dump_mode_too(tmp_path):
    replay = dump_steps(pathlib.Path(tmp_path), 1)
    assert replay.load(0)["prompt"][0] == "prompt 0 问题"

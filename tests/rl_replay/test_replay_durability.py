"""Atomic writes, checksums and failure handling: killed dumps, full disks, corrupted files."""

import errno
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from replay_fakes import FakeDataProto

from rl_replay import (
    ChecksumMismatchError,
    DumpFormatError,
    MockFileNotFoundError,
    RolloutReplay,
    stfile,
)
from rl_replay.cli import main as cli_main

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="uses /proc and Linux rlimits")


def dump_three(d):
    replay = RolloutReplay(d, "dump")
    for step in range(3):
        replay.dump(step, {"x": np.full((64, 1024), step, dtype=np.float32), "s": np.array(["a", "b"], dtype=object)})
    return replay


def temp_files(d):
    return sorted(p.name for p in d.rglob("*.tmp"))


def test_flipped_byte_is_detected(tmp_path):
    replay = dump_three(tmp_path)
    path = replay.step_path(1)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[len(data) // 2] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError) as err:
        RolloutReplay(tmp_path, "mock").load(1)
    text = str(err.value)
    assert path in text and "checksum mismatch" in text and "crc32 is" in text and "recorded" in text
    RolloutReplay(tmp_path, "mock").load(0)  # the others still load


def test_truncated_file_is_detected(tmp_path):
    replay = dump_three(tmp_path)
    path = replay.step_path(2)
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    with pytest.raises(ChecksumMismatchError, match=f"is {size - 100} bytes but the manifest recorded {size}"):
        RolloutReplay(tmp_path, "mock").load(2)


def test_a_file_moved_to_another_step_is_detected(tmp_path):
    replay = dump_three(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    steps = manifest["splits"]["train"]["steps"]
    os.replace(replay.step_path(1), replay.step_path(0))
    steps["0"] = steps["1"]  # even with a manifest that agrees with the bytes
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpFormatError, match="holds step 1 of train, not step 0 of train"):
        RolloutReplay(tmp_path, "mock").load(0)


def test_unreadable_or_newer_manifest(tmp_path):
    dump_three(tmp_path)
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["schema_version"] = 99
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DumpFormatError, match=r"schema_version 99.*Upgrade rl-replay"):
        RolloutReplay(tmp_path, "mock")
    manifest_path.write_text('{"schema_version": 1, "format": "rl_replay rollout dump", "splits": ')
    with pytest.raises(DumpFormatError, match=f"manifest {manifest_path} is not valid JSON"):
        RolloutReplay(tmp_path, "mock")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}', "do not hold 8 bytes"),
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', "do not hold 8 bytes in the file"),
        (b'{"a": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 1]}}', "dtype must be one of"),
        (b'{"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}', "shape"),
        (b'{"a": {"dtype": "U8", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}}', "do not hold"),
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe", "unreadable safetensors header"),
    ],
)
def test_malformed_safetensors_headers_are_refused(header, message):
    body = b"" if b'"F32", "shape": [2], "data_offsets": [0, 8]' in header else b"\x00" * 4
    raw = len(header).to_bytes(8, "little") + header + body
    with pytest.raises(DumpFormatError, match=message):
        stfile.parse_safetensors(np.frombuffer(raw, dtype=np.uint8), "f.safetensors")
    huge = (10**12).to_bytes(8, "little") + b"{}"
    with pytest.raises(DumpFormatError, match="exceeds the file"):
        stfile.parse_safetensors(np.frombuffer(huge, dtype=np.uint8), "f.safetensors")


def test_loading_never_unpickles(tmp_path, monkeypatch):
    RolloutReplay(tmp_path, "dump").dump(0, FakeDataProto(non_tensor_batch={"p": np.array([{"a": 1}], dtype=object)}))

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used while loading")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    got = RolloutReplay(tmp_path, "mock").load(0)
    assert got.non_tensor_batch["p"][0] == {"a": 1}


def test_disk_full_names_the_file_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    replay = dump_three(tmp_path)
    real_write_all = stfile._write_all

    def write_half_then_fail(fd, data):
        real_write_all(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stfile, "_write_all", write_half_then_fail)
    manifest_before = (tmp_path / "manifest.json").read_bytes()
    with pytest.raises(OSError) as err:
        replay.dump(3, {"x": np.ones((64, 1024), dtype=np.float32)})
    assert err.value.errno == errno.ENOSPC and not isinstance(err.value, MockFileNotFoundError)
    text = str(err.value)
    assert replay.step_path(3) in text and "No space left on device" in text
    assert "No partial file was left" in text and "reduce max_steps" in text
    assert re.search(r"takes about 0\.25MB \(total = that x max_steps\) and \d+\.\d\dMB are free there", text), text
    assert not os.path.exists(replay.step_path(3)) and temp_files(tmp_path) == []
    assert (tmp_path / "manifest.json").read_bytes() == manifest_before
    assert RolloutReplay(tmp_path, "mock").load(2)["x"][0, 0] == 2


CHILD_EFBIG = """
import resource, signal, sys
import numpy as np
from rl_replay import RolloutReplay
replay = RolloutReplay(sys.argv[1], "dump")
replay.dump(0, {"x": np.zeros(1000, dtype=np.float32)})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    replay.dump(1, {"x": np.zeros(1 << 20, dtype=np.float32)})
except OSError as exc:
    print(exc.errno, exc)
"""


@linux_only
def test_a_real_write_error_from_the_kernel(tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse the write half way (EFBIG), as a full disk would
    script = tmp_path / "child.py"
    script.write_text(CHILD_EFBIG)
    d = tmp_path / "dump"
    out = subprocess.run([sys.executable, str(script), str(d)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{errno.EFBIG} ") and str(d / "train" / "step_000001.safetensors") in out.stdout
    assert sorted(p.name for p in (d / "train").iterdir()) == ["step_000000.safetensors"]
    assert RolloutReplay(d, "mock").steps() == [0]


CHILD_KILLED = """
import os, sys, time
import numpy as np
from rl_replay import RolloutReplay
dump_dir, target, ready = sys.argv[1:4]
replay = RolloutReplay(dump_dir, "dump")
for step in range(3):
    replay.dump(step, {"x": np.full((256, 1024), step, dtype=np.float32)})
real_write = os.write
def write(fd, data):
    name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    if name.startswith("." + target) and name.endswith(".tmp"):
        real_write(fd, bytes(memoryview(data)[: len(data) // 2]))  # half of it is on disk
        with open(ready, "w") as f:
            f.write("inside the write")
        time.sleep(120)  # the parent kills us here
    return real_write(fd, data)
os.write = write
replay.dump(3, {"x": np.full((256, 1024), 3, dtype=np.float32)})
"""


def kill_inside_write(tmp_path, target):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD_KILLED))
    d, ready = tmp_path / "dump", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(script), str(d), target, str(ready)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"child never reached the write: {proc.communicate()[1].decode()}")
        time.sleep(0.01)
    proc.kill()  # SIGKILL: no cleanup handler runs
    proc.wait(timeout=30)
    proc.stderr.close()
    assert proc.returncode == -9
    return d


@linux_only
def test_sigkill_while_writing_a_step_leaves_no_partial_step(tmp_path, capsys):
    d = kill_inside_write(tmp_path, "step_000003.safetensors")
    assert not (d / "train" / "step_000003.safetensors").exists()
    assert len(temp_files(d)) == 1  # the half-written temp file, under a hidden name
    mock = RolloutReplay(d, "mock")
    for step in range(3):
        assert (mock.load(step)["x"] == step).all()
    with pytest.raises(MockFileNotFoundError):
        mock.load(3)
    assert cli_main(["verify", str(d)]) == 0
    assert "temp file of a killed dump" in capsys.readouterr().out
    RolloutReplay(d, "dump", overwrite=True).dump(0, {"x": np.zeros(1)})
    assert temp_files(d) == []  # the next dump cleans up


@linux_only
def test_sigkill_while_writing_the_manifest_keeps_the_old_manifest(tmp_path, capsys):
    d = kill_inside_write(tmp_path, "manifest.json")
    assert (d / "train" / "step_000003.safetensors").exists()  # complete, but never recorded
    mock = RolloutReplay(d, "mock")
    assert mock.steps() == [0, 1, 2]
    with pytest.raises(MockFileNotFoundError):
        mock.load(3)
    assert cli_main(["verify", str(d)]) == 1
    assert "train/step_000003.safetensors: not recorded in the manifest" in capsys.readouterr().out


CHILD_CONCURRENT = """
import sys
import numpy as np
from rl_replay import RolloutReplay
replay = RolloutReplay(sys.argv[1], "dump")
for step in range(15):
    replay.dump(step, {"x": np.full(1000, step)}, sys.argv[2])
"""


def test_train_and_val_schedulers_dump_concurrently_into_one_dir(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD_CONCURRENT)
    d = tmp_path / "dump"
    d.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), str(d), split]) for split in ("train", "val")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    mock = RolloutReplay(d, "mock")
    assert mock.steps("train") == list(range(15)) and mock.steps("val") == list(range(15))
    assert (mock.load(14, "val")["x"] == 14).all()

import os
import pathlib
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import torch
from replay_fakes import FakeDataProto, FakeTensorDict

from rl_replay import RolloutReplay, append_metrics
from rl_replay.cli import main


def make_dump(d, steps=2, shift=0.0, extra_val=True):
    replay = RolloutReplay(d, "dump", durable=False)
    for step in range(steps):
        td = FakeTensorDict(
            {"logp": torch.full((3, 4), float(step)) + shift, "ids": torch.arange(12).reshape(3, 4)}, batch_size=[3]
        )
        proto = FakeDataProto(td, {"prompt": np.array(["p0", "p1", "p2"], dtype=object)}, {"global_step": step})
        replay.dump(step, proto)
    if extra_val:
        replay.dump(0, {"reward": np.array([1.0, 0.0])}, "val")
    return str(d)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_explains_and_gives_examples(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for text in ("exit status", "examples:", "rl-replay verify", "compare-metrics", '{"step": 0'):
        assert text in out
    code, out, _ = run(capsys, "compare-metrics", "--help")
    assert code == 0 and "--atol" in out and "actor/pg_loss" in out


def test_bad_usage_exits_2(capsys):
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "show", "dir", "not-a-number")[0] == 2
    assert run(capsys)[0] == 2


def test_ls(tmp_path, capsys):
    d = make_dump(tmp_path / "d")
    code, out, _ = run(capsys, "ls", d)
    assert code == 0
    assert "split train: 2 step(s) (steps 0..1)" in out and "split val: 1 step(s)" in out
    assert "train/step_000001.safetensors" in out and "rl_replay 0.1.0" in out


def test_show(tmp_path, capsys):
    d = make_dump(tmp_path / "d")
    code, out, _ = run(capsys, "show", d, "1")
    assert code == 0
    assert "step 1 of train, samples=3" in out
    assert "DataProto-like replay_fakes:FakeDataProto" in out
    assert "batch/logp: torch.float32 [3, 4] min=1 max=1 mean=1" in out
    assert "non_tensor_batch/prompt: numpy str [3], first: 'p0'" in out
    assert "meta_info/global_step: 1" in out
    code, _, err = run(capsys, "show", d, "7")
    assert code == 2 and "no step 7" in err


def test_verify_ok_then_corrupted(tmp_path, capsys):
    d = make_dump(tmp_path / "d")
    code, out, _ = run(capsys, "verify", d)
    assert code == 0 and out.strip().endswith(f"OK: 3 step file(s) verified, {_mb(d)}MB, in {d}")
    path = os.path.join(d, "train", "step_000001.safetensors")
    data = bytearray(pathlib.Path(path).read_bytes())
    data[-1] ^= 0xFF
    pathlib.Path(path).write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", d)
    assert code == 1 and f"FAIL train step 1: [Rollout Mock] checksum mismatch in {path}" in out
    code, out, _ = run(capsys, "verify", str(tmp_path))
    assert code == 1 and "not an rl_replay dump directory" in out


def _mb(d):
    total = sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs if f.endswith(".safetensors")
    )
    return f"{total / 2**20:.2f}"


def test_diff(tmp_path, capsys):
    a = make_dump(tmp_path / "a")
    b = make_dump(tmp_path / "b")
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 0 and "IDENTICAL: 3 step(s) compared" in out

    c = str(tmp_path / "c")
    replay = RolloutReplay(c, "dump")
    td = FakeTensorDict({"logp": torch.zeros(3, 4), "ids": torch.arange(12).reshape(3, 4)}, batch_size=[3])
    td["logp"][2, 1] = 0.5
    replay.dump(0, FakeDataProto(td, {"prompt": np.array(["p0", "p1", "X"], dtype=object)}, {"global_step": 0}))
    code, out, _ = run(capsys, "diff", a, c)
    assert code == 1
    assert "train step 0 batch/logp: max abs diff 0.5, first at [2, 1] (0.0 vs 0.5)" in out
    assert "train step 0 non_tensor_batch/prompt: first difference at [2]: 'p2' vs 'X'" in out
    assert f"train step 1: only in {a}" in out and f"val step 0: only in {a}" in out
    code, out, _ = run(capsys, "diff", a, c, "--atol", "0.5")
    assert "batch/logp" not in out


def test_diff_within_atol(tmp_path, capsys):
    a = make_dump(tmp_path / "a")
    b = make_dump(tmp_path / "b", shift=1e-6)
    assert run(capsys, "diff", a, b)[0] == 1
    code, out, _ = run(capsys, "diff", a, b, "--atol", "1e-5")
    assert code == 0 and "IDENTICAL" in out


def test_compare_metrics(tmp_path, capsys):
    for name, loss in (("a", 0.5), ("b", 0.5), ("c", 0.5000001)):
        os.makedirs(tmp_path / name)
        for step in range(3):
            append_metrics(
                tmp_path / name / "metrics.jsonl", step, {"actor/pg_loss": loss * step, "actor/grad_norm": 2.0}
            )
    code, out, _ = run(capsys, "compare-metrics", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0 and "IDENTICAL: 6 value(s) match over 3 step(s)" in out
    assert "not logged in either run (skipped): total_loss, value_loss, approx_kl" in out
    code, out, _ = run(capsys, "compare-metrics", str(tmp_path / "a"), str(tmp_path / "c"))
    assert code == 1 and "DIVERGED: 2 of 6 value(s) differ" in out
    row = next(line for line in out.splitlines() if line.startswith("2 ") and "pg_loss" in line)
    assert row.split()[-1] == "DIFF" and "2.000e-07" in row
    args = ("compare-metrics", str(tmp_path / "a"), str(tmp_path / "c"), "--metrics", "grad_norm")
    assert run(capsys, *args)[0] == 0
    assert run(capsys, "compare-metrics", str(tmp_path / "a"), str(tmp_path / "c"), "--rtol", "1e-6")[0] == 0
    code, _, err = run(capsys, "compare-metrics", str(tmp_path / "a"), str(tmp_path / "c"), "--metrics", "nope")
    assert code == 2 and "none of the metrics ['nope']" in err
    code, _, err = run(capsys, "compare-metrics", str(tmp_path / "a"), str(tmp_path / "missing.jsonl"))
    assert code == 2 and "does not exist" in err


def test_console_script_and_python_m(tmp_path):
    d = make_dump(tmp_path / "d", steps=1, extra_val=False)
    out = subprocess.run([sys.executable, "-m", "rl_replay", "verify", d], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "OK: 1 step file(s) verified" in out.stdout, out.stderr
    script = os.path.join(sysconfig.get_path("scripts"), "rl-replay")
    if not os.path.exists(script):
        pytest.skip("rl-replay console script not installed in this environment")
    os.truncate(os.path.join(d, "train", "step_000000.safetensors"), 10)
    out = subprocess.run([script, "verify", d], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "FAIL train step 0" in out.stdout

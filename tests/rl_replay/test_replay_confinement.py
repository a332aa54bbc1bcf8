"""A dump's manifest cannot make rl_replay read files outside the dump directory.

Every attack keeps the bytes the manifest vouches for (same size and CRC-32), so only the path check can
refuse it: a manifest `file` entry with '..' or an absolute path, a step file that is a symlink leading out,
a split directory or manifest.json that is such a symlink. Each is refused by load, verify, diff, ls and show.
"""

import json
import os
import re
import shutil

import numpy as np
import pytest

from rl_replay import DumpPathError, RolloutReplay
from rl_replay.cli import main
from rl_replay.manifest import confined_path

STEP_FILE = os.path.join("train", "step_000000.safetensors")


def make_dump(d):
    replay = RolloutReplay(d, "dump", durable=False)
    replay.dump(0, {"reward": np.array([1.0, 0.0, 0.5]), "ids": np.arange(6).reshape(3, 2)})
    return str(d)


def set_file_entry(d, value):
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["splits"]["train"]["steps"]["0"]["file"] = value
    with open(path, "w") as f:
        json.dump(manifest, f)


def dotdot_entry(d, outside):
    """The manifest names ../outside/step_000000.safetensors (the step file is still in place too)."""
    set_file_entry(d, os.path.relpath(os.path.join(outside, "step_000000.safetensors"), d))
    return r"splits\.train\.steps\.0\.file = '\.\./outside/step_000000\.safetensors' contains '\.\.'"


def absolute_entry(d, outside):
    set_file_entry(d, os.path.join(outside, "step_000000.safetensors"))
    return r"splits\.train\.steps\.0\.file = '/.*/outside/step_000000\.safetensors' is an absolute path"


def step_symlink_out(d, outside):
    os.unlink(os.path.join(d, STEP_FILE))
    os.symlink(os.path.join(outside, "step_000000.safetensors"), os.path.join(d, STEP_FILE))
    return r"splits\.train\.steps\.0\.file = 'train/step_000000\.safetensors' resolves to .*outside.* symlink leads out"


def split_dir_symlink_out(d, outside):
    shutil.rmtree(os.path.join(d, "train"))
    os.symlink(outside, os.path.join(d, "train"))
    return r"splits\.train\.steps\.0\.file = 'train/step_000000\.safetensors' resolves to .*outside.* symlink leads out"


ATTACKS = [dotdot_entry, absolute_entry, step_symlink_out, split_dir_symlink_out]


@pytest.fixture
def dumps(tmp_path):
    """(dump dir, a clean copy of it, the outside dir holding an identical copy of its step file)."""
    d = make_dump(tmp_path / "d")
    clean = str(tmp_path / "clean")
    shutil.copytree(d, clean)
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    shutil.copy(os.path.join(d, STEP_FILE), outside)
    return d, clean, outside


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("attack", ATTACKS)
def test_load_refuses_paths_leaving_the_dump(dumps, attack):
    d, _, outside = dumps
    message = attack(d, outside)
    with pytest.raises(DumpPathError, match=message) as info:
        RolloutReplay(d, "mock").load(0)
    text = str(info.value)
    assert os.path.join(d, "manifest.json") in text  # names the manifest
    assert f"rl_replay reads only files inside the dump directory {d}" in text


@pytest.mark.parametrize("attack", ATTACKS)
def test_verify_fails_on_paths_leaving_the_dump(dumps, capsys, attack):
    d, _, outside = dumps
    message = attack(d, outside)
    code, out, _ = run(capsys, "verify", d)
    assert code == 1
    fail = next(line for line in out.splitlines() if line.startswith("FAIL train step 0:"))
    assert re.search(message, fail), fail
    assert out.strip().endswith(f"FAILED: 0 step file(s) verified, 0.00MB, in {d}")


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("command", ["ls", "show", "diff"])
def test_ls_show_diff_refuse_paths_leaving_the_dump(dumps, capsys, attack, command):
    d, clean, outside = dumps
    message = attack(d, outside)
    argv = {"ls": ["ls", d], "show": ["show", d, "0"], "diff": ["diff", clean, d]}[command]
    code, out, err = run(capsys, *argv)
    assert code == 2, out
    assert err.startswith("rl-replay: error: [Rollout Mock]")
    assert re.search(message, err), err


def test_manifest_symlink_leading_out_is_refused(dumps, capsys):
    d, clean, _ = dumps
    os.unlink(os.path.join(d, "manifest.json"))
    os.symlink(os.path.join(clean, "manifest.json"), os.path.join(d, "manifest.json"))
    with pytest.raises(DumpPathError, match=r"the manifest itself = 'manifest\.json' resolves to .*clean"):
        RolloutReplay(d, "mock")
    code, _, err = run(capsys, "ls", d)
    assert code == 2 and "symlink leads out" in err


def test_verify_fails_on_a_split_name_leaving_the_dump(dumps, capsys):
    d, _, _ = dumps
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["splits"]["../outside"] = manifest["splits"].pop("train")
    with open(path, "w") as f:
        json.dump(manifest, f)
    code, out, _ = run(capsys, "verify", d)
    assert code == 1
    assert "FAIL split ../outside: [Rollout Mock]" in out and "splits.../outside = '../outside' contains '..'" in out


def test_symlinks_staying_inside_the_dump_are_followed(dumps, capsys):
    d, clean, _ = dumps
    os.makedirs(os.path.join(d, "stash"))
    os.replace(os.path.join(d, STEP_FILE), os.path.join(d, "stash", "moved.safetensors"))
    os.symlink(os.path.join("..", "stash", "moved.safetensors"), os.path.join(d, STEP_FILE))
    batch = RolloutReplay(d, "mock").load(0)
    np.testing.assert_array_equal(batch["reward"], np.array([1.0, 0.0, 0.5]))
    assert run(capsys, "verify", d)[0] == 0
    assert run(capsys, "ls", d)[0] == 0
    assert run(capsys, "show", d, "0")[0] == 0
    code, out, _ = run(capsys, "diff", clean, d)
    assert code == 0 and "IDENTICAL: 1 step(s) compared" in out


@pytest.mark.parametrize(
    ("relative", "reason"),
    [
        ("train/../train/step_000000.safetensors", "contains '..'"),  # '..' is refused even when it stays inside
        ("..\\secret.safetensors", "contains '..'"),
        ("/etc/passwd", "is an absolute path"),
        ("", "is not a relative path"),
        (7, "is not a relative path"),
        ("train/\0x", "is not a relative path"),
    ],
)
def test_confined_path_refuses_malformed_entries(tmp_path, relative, reason):
    with pytest.raises(DumpPathError, match=re.escape(f"entry = {relative!r} {reason}")):
        confined_path(str(tmp_path), relative, "entry")
    assert confined_path(str(tmp_path), "train/x.safetensors", "entry") == os.path.join(tmp_path, "train/x.safetensors")

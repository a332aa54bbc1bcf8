"""Packaging contract: stands alone (numpy + safetensors), no torch needed, docs examples stay true."""

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest

import rl_replay

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "packages" / "rl-replay"


def test_dependencies_are_numpy_and_safetensors_only():
    meta = importlib.metadata.metadata("rl-replay")
    requires = importlib.metadata.requires("rl-replay") or []
    required = sorted(re.split(r"[<>=!~ ;\[]", r)[0] for r in requires if "extra ==" not in r)
    assert required == ["numpy", "safetensors"]
    assert any(
        r.startswith("tensorboard") and "extra ==" in r and "tensorboard" in r.split("extra ==")[1] for r in requires
    )
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["rl-replay"] == "rl_replay.cli:main"
    assert meta["License-Expression"] == "Apache-2.0" and meta["Requires-Python"] == ">=3.10"


def test_version_comes_from_about():
    assert rl_replay.__version__ == "0.1.0" == importlib.metadata.version("rl-replay")


def test_importing_every_module_pulls_no_sibling_torch_or_tensorboard():
    code = (
        "import pkgutil, sys, importlib, rl_replay\n"
        "for m in pkgutil.walk_packages(rl_replay.__path__, 'rl_replay.'):\n"
        "    if m.name != 'rl_replay.__main__':\n"
        "        importlib.import_module(m.name)\n"
        "bad = [n for n in ('torch', 'tensorboard', 'rl_core', 'rl_ckpt', 'rl_engines') if n in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_source_never_calls_pickle():
    for path in (PACKAGE / "src" / "rl_replay").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import pickle|from pickle)|allow_pickle=True", text, re.M), path


def python_blocks(markdown: pathlib.Path) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", markdown.read_text(), re.S))


@pytest.mark.parametrize("doc", ["packages/rl-replay/README.md", "docs/rollout-dump-mock.md"])
def test_documentation_examples_run(tmp_path, doc):
    code = python_blocks(REPO / doc)
    assert code.strip()
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert any(tmp_path.rglob("manifest.json")) or any(tmp_path.glob("*.jsonl"))


VENV_SCRIPT = """
import subprocess, sys
import numpy as np
from rl_replay import RolloutReplay
try:
    import torch
except ImportError:
    pass
else:
    sys.exit("torch is importable in the torch-free venv")
batch = {"ids": np.arange(12, dtype=np.int64).reshape(3, 4), "mask": np.ones((3, 4), bool),
         "logp": np.linspace(-1, 0, 12, dtype=np.float32).reshape(3, 4),
         "prompt": np.array(["a", "b", "c"], dtype=object), "meta": {"step": 0}}
RolloutReplay("dump", "dump").dump(0, batch)
got = RolloutReplay("dump", "mock").load(0)
for key in ("ids", "mask", "logp"):
    assert got[key].dtype == batch[key].dtype and got[key].tobytes() == batch[key].tobytes(), key
assert got["prompt"].tolist() == ["a", "b", "c"] and got["meta"] == {"step": 0}
print("roundtrip ok")
"""


@pytest.mark.slow
def test_a_venv_without_torch_dumps_and_loads_numpy_batches(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    (tmp_path / "tmp").mkdir()
    # pip's cache and build directories go under tmp_path too
    env = {
        **os.environ,
        "PIP_NO_INPUT": "1",
        "PIP_CACHE_DIR": str(tmp_path / "pip-cache"),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    env.pop("PYTHONPATH", None)
    subprocess.run([*pip, "numpy", "safetensors"], check=True, timeout=600, env=env)
    subprocess.run([*pip, "--no-deps", str(PACKAGE)], check=True, timeout=600, env=env)
    (tmp_path / "check.py").write_text(VENV_SCRIPT)
    out = subprocess.run([python, "check.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "roundtrip ok" in out.stdout, out.stdout + out.stderr
    cli = subprocess.run(
        [str(venv / "bin" / "rl-replay"), "verify", "dump"], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert cli.returncode == 0 and "OK: 1 step file(s) verified" in cli.stdout, cli.stderr
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, env=env)
    assert no_torch.returncode != 0

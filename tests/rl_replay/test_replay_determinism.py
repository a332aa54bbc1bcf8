import subprocess
import sys

import pytest
import torch

from rl_replay import DETERMINISTIC_ENV, apply_deterministic_mode, deterministic_settings, enable_deterministic
from rl_replay.determinism import settings_differences


@pytest.fixture
def restore_torch_flags():
    saved = (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
    )
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[:2]
    torch.use_deterministic_algorithms(saved[2])


def test_the_guide_settings():
    assert DETERMINISTIC_ENV == {
        "NCCL_ALGO": "Ring",
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "DETERMINISTIC_MODE": "1",
    }


def test_enable_deterministic_sets_env_and_torch(restore_torch_flags, monkeypatch):
    for name in DETERMINISTIC_ENV:
        monkeypatch.delenv(name, raising=False)
    torch.backends.cudnn.benchmark = True
    torch.use_deterministic_algorithms(False)
    settings = enable_deterministic()
    import os

    assert {k: os.environ[k] for k in DETERMINISTIC_ENV} == DETERMINISTIC_ENV
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False
    assert torch.are_deterministic_algorithms_enabled()
    assert settings == {
        **DETERMINISTIC_ENV,
        "torch.backends.cudnn.deterministic": True,
        "torch.backends.cudnn.benchmark": False,
        "torch.use_deterministic_algorithms": True,
    }


def test_apply_deterministic_mode_only_when_asked(restore_torch_flags):
    torch.use_deterministic_algorithms(False)
    assert apply_deterministic_mode({"DETERMINISTIC_MODE": "0"}) is False
    assert not torch.are_deterministic_algorithms_enabled()
    assert apply_deterministic_mode({"DETERMINISTIC_MODE": "1"}) is True
    assert torch.are_deterministic_algorithms_enabled()


def test_enable_deterministic_on_a_custom_env_mapping(restore_torch_flags):
    env: dict[str, str] = {"OTHER": "x"}
    enable_deterministic(env)
    assert env == {"OTHER": "x", **DETERMINISTIC_ENV}


def test_settings_differences():
    recorded = deterministic_settings({"NCCL_ALGO": "Ring", "DETERMINISTIC_MODE": "1"})
    assert settings_differences(recorded, recorded) == []
    now = {
        **recorded,
        "NCCL_ALGO": None,
        "torch.backends.cudnn.benchmark": not recorded["torch.backends.cudnn.benchmark"],
    }
    diffs = settings_differences(recorded, now)
    assert diffs[0] == "NCCL_ALGO: dump='Ring', now=None" and "torch.backends.cudnn.benchmark" in diffs[1]
    no_torch = {k: v for k, v in now.items() if not k.startswith("torch")}
    assert settings_differences(recorded, no_torch) == ["NCCL_ALGO: dump='Ring', now=None"]


def test_without_torch_only_the_environment_is_set(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"  # makes `import torch` fail, as if not installed
        "import os, rl_replay\n"
        "s = rl_replay.enable_deterministic()\n"
        "assert s == rl_replay.DETERMINISTIC_ENV, s\n"
        "assert os.environ['CUBLAS_WORKSPACE_CONFIG'] == ':4096:8'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

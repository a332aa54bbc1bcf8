"""tools/check_imports.py: engines are importable from rl_engines only inside their adapter modules; the apps are
siblings on apps.common."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_tool():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "tools/check_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engines_only_from_their_adapter_modules():
    tool = load_tool()
    strategies = ROOT / "packages/rl-engines/src/rl_engines/strategies"
    assert tool.adapter_allows("rl_engines", strategies / "deepspeed_train.py", "deepspeed")
    assert tool.adapter_allows("rl_engines", strategies / "megatron_model.py", "rl_ckpt")
    assert tool.adapter_allows("rl_engines", strategies / "vllm" / "engine.py", "vllm")
    assert not tool.adapter_allows("rl_engines", strategies / "fsdp2.py", "deepspeed")
    assert not tool.adapter_allows("rl_engines", strategies / "vllm_infer.py", "megatron")
    assert not tool.adapter_allows("rl_engines", strategies.parent / "roles.py", "vllm")
    assert not tool.adapter_allows("rl_core", ROOT / "packages/rl-core/src/rl_core/strategies/vllm.py", "vllm")


def test_the_apps_are_siblings_on_apps_common():
    tool = load_tool()
    assert tool.app_violations("apps.agentic", "from apps.rlvr.rollout import padded_indices\n", "x.py") == [
        "x.py:1: apps.agentic must not import apps.rlvr; code the apps share belongs in apps.common"
    ]
    assert tool.app_violations("apps.rlvr", "x = 1\nimport apps.agentic.config\n", "y.py") == [
        "y.py:2: apps.rlvr must not import apps.agentic; code the apps share belongs in apps.common"
    ]
    lazy = "def reference():\n    from apps import rlvr\n    from ..agentic.config import AgenticConfig\n"
    assert [p.split(": ", 1)[1] for p in tool.app_violations("apps.common", lazy, "z.py")] == [
        "apps.common must not import apps.rlvr; code the apps share belongs in apps.common",
        "apps.common must not import apps.agentic; code the apps share belongs in apps.common",
    ]
    assert tool.app_violations("apps.agentic.envs", "from ...rlvr import data\n", "e.py")  # subpackages too
    shared = "from apps.common.padding import padded_indices\nfrom . import chat\nfrom apps.rlvr_tools import x\n"
    assert tool.app_violations("apps.agentic", shared, "ok.py") == []


def test_the_repository_has_no_violations():
    assert load_tool().main() == 0

"""tools/check_imports.py: engines are importable from rl_engines only inside their adapter modules."""

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


def test_the_repository_has_no_violations():
    assert load_tool().main() == 0

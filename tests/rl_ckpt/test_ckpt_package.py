"""Package hygiene: version, no sibling imports, one model-family registry."""

import importlib.util
import re
from pathlib import Path

import pytest

import rl_ckpt
from rl_ckpt import FAMILIES, CheckpointError, ModelFamily

ROOT = Path(__file__).resolve().parents[2]


def test_ckpt_version_matches_about_file():
    about = (ROOT / "packages/rl-ckpt/src/rl_ckpt/__about__.py").read_text()
    assert re.search(r'__version__ = "(.+)"', about).group(1) == rl_ckpt.__version__ == "0.1.0"


def test_ckpt_imports_no_sibling_package():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "tools/check_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.violations_of("rl_ckpt") == []


def test_ckpt_family_registry():
    assert FAMILIES.names() == ["llama", "mistral", "qwen2", "qwen3"]
    assert FAMILIES.get("qwen3").qk_norm and not FAMILIES.get("qwen2").qk_norm
    with pytest.raises(CheckpointError, match=r"unknown model type 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        FAMILIES.get("gpt2")
    with pytest.raises(ValueError, match="registered twice"):
        FAMILIES.register("qwen2")(ModelFamily("qwen2", "Qwen2ForCausalLM", fixed_qkv_bias=True))

"""Package hygiene: version, no sibling imports, one model-family registry."""

import importlib.util
import json
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
    assert FAMILIES.names() == ["llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"]
    assert FAMILIES.get("qwen3").qk_norm and not FAMILIES.get("qwen2").qk_norm
    assert FAMILIES.get("qwen3_moe").moe and FAMILIES.get("qwen2_moe").moe and not FAMILIES.get("qwen3").moe
    with pytest.raises(CheckpointError, match=r"unknown model type 'gpt2'; supported: llama, mistral, qwen2, "):
        FAMILIES.get("gpt2")
    with pytest.raises(ValueError, match="registered twice"):
        FAMILIES.register("qwen2")(ModelFamily("qwen2", "Qwen2ForCausalLM", fixed_qkv_bias=True))


def test_a_moe_config_reads_its_experts(tmp_path):
    """rl-ckpt reads Qwen3-MoE's and Qwen2-MoE's expert numbers (megatron_train builds the model from them;
    conversion: test_ckpt_moe.py)."""
    from rl_ckpt.spec import spec_from_hf_config
    from rl_engines.tiny_model import build_tiny_moe_lm

    build_tiny_moe_lm(tmp_path / "moe", vocab_size=64)
    spec = spec_from_hf_config(json.loads((tmp_path / "moe" / "config.json").read_text()))
    assert (spec.num_experts, spec.moe_ffn_hidden_size, spec.moe_topk, spec.moe_norm_topk_prob) == (4, 32, 2, True)
    assert (spec.moe_shared_expert_ffn_hidden_size, spec.qkv_bias) == (0, False)

    build_tiny_moe_lm(tmp_path / "qwen2_moe", model_type="qwen2_moe", vocab_size=64)  # a gated shared expert
    spec = spec_from_hf_config(json.loads((tmp_path / "qwen2_moe" / "config.json").read_text()))
    assert (spec.moe_shared_expert_ffn_hidden_size, spec.moe_norm_topk_prob, spec.qkv_bias) == (32, False, True)

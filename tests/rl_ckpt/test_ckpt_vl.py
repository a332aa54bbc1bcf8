"""Vision-language models (issue 23) through rl-ckpt: HF -> Megatron (TP x PP) -> HF, language model and vision
tower. The tower goes whole to the first stage as ``vision_model.*`` on every TP rank (ROLL's mcore_adapter layout);
the names come back as each model's files spell them (Qwen2.5-VL: ``model.*`` / ``visual.*``; Qwen3-VL:
``model.language_model.*`` / ``model.visual.*``)."""

import json

import pytest
import torch
from ckpt_models import load_state

from rl_ckpt import convert_hf_to_mcore, convert_mcore_to_hf, open_mcore_checkpoint
from rl_ckpt.verify import verify_mcore_to_hf

pytest.importorskip("rl_engines")
CORPUS = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_vl_round_trip_is_bitwise_with_the_tower_on_the_first_stage_of_every_tp_rank(tmp_path, model_type):
    from rl_engines.tiny_model import build_tiny_vl_model

    src = tmp_path / "src"
    build_tiny_vl_model(src, CORPUS, model_type=model_type, num_key_value_heads=2)
    layout = convert_hf_to_mcore(src, tmp_path / "mcore", 2, 2)
    before = load_state(src)
    tower = {name for name in before if ".visual." in f".{name}"}
    assert tower and {"model.visual." in name for name in tower} == {model_type == "qwen3_vl"}
    for tp_rank in range(2):
        first, second = (torch.load(layout.path(tp_rank, stage), weights_only=False)["model"] for stage in (0, 1))
        held = {key for key in first if key.startswith("vision_model.")}
        assert len(held) == len(tower) and not any(key.startswith("vision_model.") for key in second)
        for key in held:  # the same tensor on every TP rank, as loaded
            name = next(n for n in tower if n.endswith("visual." + key.removeprefix("vision_model.")))
            assert torch.equal(first[key], before[name]), key

    ckpt = open_mcore_checkpoint(tmp_path / "mcore")
    assert ckpt.spec.vision and ckpt.spec.model_type == ("qwen3" if model_type == "qwen3_vl" else "qwen2")
    convert_mcore_to_hf(ckpt, tmp_path / "hf", tokenizer_path=src)
    after = load_state(tmp_path / "hf")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    config, original = (json.loads((path / "config.json").read_text()) for path in (tmp_path / "hf", src))
    assert config["model_type"] == model_type and config["vision_config"] == original["vision_config"]
    assert config["text_config"]["vocab_size"] == original["text_config"]["vocab_size"]
    # --verify: the model rebuilt from the rank files (every tensor must fit transformers' VL model) gives the
    # logits of the written folder as transformers loads it
    assert verify_mcore_to_hf(ckpt, tmp_path / "hf") == 0.0


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 1)], ids=["pp2_ep2", "tp2_ep2"])
def test_qwen3_vl_moe_round_trip_over_expert_parallel_ranks_stacks_the_experts_as_its_files_do(tmp_path, tp, pp):
    """Qwen3-VL-MoE's files stack each layer's experts (``experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``):
    they go to Megatron as each EP rank's local experts (at TP = 2 each TP rank its half of each) and come back
    stacked, bitwise; the logits verify."""
    from rl_engines.tiny_model import build_tiny_vl_model

    src = tmp_path / "src"
    build_tiny_vl_model(src, CORPUS, model_type="qwen3_vl_moe", num_key_value_heads=2)
    layout = convert_hf_to_mcore(src, tmp_path / "mcore", tp, pp, ep=2)
    before = load_state(src)
    gate_up = before["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    down = before["model.language_model.layers.0.mlp.experts.down_proj"]
    experts, size = gate_up.shape[0], gate_up.shape[1] // 2
    part = size // tp  # TP rank 0's rows of the gate and of the up projection, columns of down
    for ep_rank in range(2):
        local = torch.load(layout.path(0, 0, ep_rank), weights_only=False)["model"]
        for j in range(experts // 2):  # rank r's local expert j is expert r * E / 2 + j
            expert = ep_rank * experts // 2 + j
            fc1 = local[f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight"]
            assert torch.equal(fc1[:part], gate_up[expert, :part])
            assert torch.equal(fc1[part:], gate_up[expert, size : size + part])
            fc2 = local[f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc2.weight"]
            assert torch.equal(fc2, down[expert][:, :part])

    ckpt = open_mcore_checkpoint(tmp_path / "mcore")
    assert ckpt.spec.model_type == "qwen3_moe" and ckpt.spec.fused_experts and ckpt.spec.moe_norm_topk_prob
    convert_mcore_to_hf(ckpt, tmp_path / "hf", tokenizer_path=src)
    after = load_state(tmp_path / "hf")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert verify_mcore_to_hf(ckpt, tmp_path / "hf") == 0.0


def test_qwen3_vl_moe_files_in_transformers_4_layout_convert_to_the_same_megatron_tensors(tmp_path):
    """Qwen's released Qwen3-VL-MoE files store the stacked experts transposed (``[E, H, 2I]``, ``[E, I, H]``), which
    transformers transposes on load: the conversion reads them as the same experts."""
    from safetensors.torch import load_file, save_file

    from rl_engines.tiny_model import build_tiny_vl_model

    src, old = tmp_path / "src", tmp_path / "old"
    build_tiny_vl_model(src, CORPUS, model_type="qwen3_vl_moe", num_key_value_heads=2)
    config = json.loads((src / "config.json").read_text())
    text = config["text_config"]
    assert text["hidden_size"] not in (text["moe_intermediate_size"], 2 * text["moe_intermediate_size"])  # unambiguous
    old.mkdir()
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            (old / path.name).write_bytes(path.read_bytes())
    for path in src.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({name: t.transpose(1, 2).contiguous() if ".experts." in name else t for name, t in tensors.items()},
                  old / path.name, metadata={"format": "pt"})  # fmt: skip
    ours, theirs = (convert_hf_to_mcore(folder, tmp_path / f"mcore_{folder.name}", 1, 1) for folder in (src, old))
    new_state, old_state = (torch.load(layout.path(0, 0), weights_only=False)["model"] for layout in (ours, theirs))
    experts = [key for key in new_state if ".experts." in key]
    assert experts and all(torch.equal(new_state[key], old_state[key]) for key in new_state)


def test_a_stacked_expert_tensor_of_another_shape_is_refused_naming_it():
    from rl_ckpt.errors import CheckpointError
    from rl_ckpt.experts import split_fused

    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(CheckpointError, match=r"gate_up_proj has shape \(4, 96, 60\); .* is \[experts, 96, 64\]"):
        split_fused(name, torch.zeros(4, 96, 60), hidden=64, inter=48)
    assert split_fused("model.layers.0.mlp.gate.weight", torch.zeros(4, 64), hidden=64, inter=48) is None


def test_qwen3_vl_moe_routers_always_renormalise_whatever_the_config_says():
    """transformers' Qwen3-VL-MoE router divides its top-k weights by their sum unconditionally (no norm_topk_prob
    in its config): the language model's spec renormalises even where a config writes false."""
    from rl_ckpt.spec import language_config

    text = {"model_type": "qwen3_vl_moe_text", "norm_topk_prob": False, "rope_parameters": {"rope_theta": 1e6}}
    assert language_config({"model_type": "qwen3_vl_moe", "text_config": text})["norm_topk_prob"] is True
    assert language_config({"model_type": "qwen3_vl", "text_config": text})["norm_topk_prob"] is False

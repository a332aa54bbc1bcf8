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

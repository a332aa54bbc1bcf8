"""The Megatron-core per-rank layout, checked against expectations written out by hand from the HF tensors."""

import argparse
import json

import pytest
import torch
from ckpt_models import VOCAB, load_state

from rl_ckpt import CheckpointError, convert_hf_to_mcore, convert_mcore_to_hf, open_mcore_checkpoint
from rl_ckpt.layout import padded_vocab_size

D, HEADS, GROUPS, HIDDEN, FFN = 16, 4, 2, 64, 96  # head_dim = 64 / 4


def rank_state(root, tp_rank, pp_rank=None):
    name = f"mp_rank_{tp_rank:02d}" if pp_rank is None else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return torch.load(root / "iter_0000001" / name / "model_optim_rng.pt", weights_only=True)


@pytest.mark.parametrize(
    ("vocab", "divisible_by", "tp", "padded"),
    [(250, 128, 1, 256), (250, 128, 2, 256), (300, 128, 2, 512), (151665, 128, 4, 152064)],
)
def test_ckpt_padded_vocab_size_matches_megatron(vocab, divisible_by, tp, padded):
    assert padded_vocab_size(vocab, divisible_by, tp) == padded


def test_ckpt_tp2_layout_by_hand(tiny_hf, tmp_path):
    src = tiny_hf("qwen2", False)
    hf = load_state(src)
    convert_hf_to_mcore(src, tmp_path, tp=2, pp=1)
    p = "model.layers.1."
    q, k, v = (hf[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
    qb, kb, vb = (hf[f"{p}self_attn.{n}_proj.bias"] for n in "qkv")
    gate, up, down, o = (
        hf[f"{p}mlp.gate_proj.weight"],
        hf[f"{p}mlp.up_proj.weight"],
        hf[f"{p}mlp.down_proj.weight"],
        hf[f"{p}self_attn.o_proj.weight"],
    )
    emb = hf["model.embed_tokens.weight"]
    for r in range(2):  # rank r holds query group r: query heads 2r and 2r+1, key head r, value head r
        state = rank_state(tmp_path, r)
        m = state["model"]
        rows = [
            q[(2 * r) * D : (2 * r + 1) * D],
            q[(2 * r + 1) * D : (2 * r + 2) * D],
            k[r * D : (r + 1) * D],
            v[r * D : (r + 1) * D],
        ]
        assert torch.equal(m["decoder.layers.1.self_attention.linear_qkv.weight"], torch.cat(rows))
        bias = [qb[2 * r * D : (2 * r + 2) * D], kb[r * D : (r + 1) * D], vb[r * D : (r + 1) * D]]
        assert torch.equal(m["decoder.layers.1.self_attention.linear_qkv.bias"], torch.cat(bias))
        assert torch.equal(m["decoder.layers.1.self_attention.linear_proj.weight"], o[:, r * 32 : (r + 1) * 32])
        half = FFN // 2
        fc1 = torch.cat([gate[r * half : (r + 1) * half], up[r * half : (r + 1) * half]])
        assert torch.equal(m["decoder.layers.1.mlp.linear_fc1.weight"], fc1)
        assert torch.equal(m["decoder.layers.1.mlp.linear_fc2.weight"], down[:, r * half : (r + 1) * half])
        assert torch.equal(m["decoder.layers.1.pre_mlp_layernorm.weight"], hf[f"{p}post_attention_layernorm.weight"])
        # vocab 250 padded to 256 = 2 x 128 rows; rank 1 holds ids 128..249 then 6 zero rows
        word = m["embedding.word_embeddings.weight"]
        assert word.shape == (128, HIDDEN)
        assert torch.equal(word[: min(128, VOCAB - 128 * r)], emb[128 * r : 128 * (r + 1)])
        assert state["checkpoint_version"] == 3.0
        assert state["args"]["padded_vocab_size"] == 256
        assert state["args"]["model_type_hf"] == "qwen2"
    assert torch.count_nonzero(rank_state(tmp_path, 1)["model"]["output_layer.weight"][VOCAB - 128 :]) == 0
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.parametrize("tied", [False, True])
def test_ckpt_pp2_placement(tiny_hf, tmp_path, tied):
    src = tiny_hf("qwen2", tied)
    hf = load_state(src)
    convert_hf_to_mcore(src, tmp_path, tp=1, pp=2)
    first, last = rank_state(tmp_path, 0, 0)["model"], rank_state(tmp_path, 0, 1)["model"]
    assert "embedding.word_embeddings.weight" in first
    assert not any(k.startswith(("output_layer", "decoder.final_layernorm")) for k in first)
    assert "embedding.word_embeddings.weight" not in last
    assert {k.split(".")[2] for k in last if k.startswith("decoder.layers.")} == {"0", "1"}  # local numbering
    assert torch.equal(last["decoder.layers.1.input_layernorm.weight"], hf["model.layers.3.input_layernorm.weight"])
    assert torch.equal(last["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    head = hf["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(last["output_layer.weight"][:VOCAB], head)  # tied + PP>1: the last stage's copy


def test_ckpt_tied_tp1_pp1_has_no_output_layer(tiny_hf, tmp_path):
    convert_hf_to_mcore(tiny_hf("qwen2", True), tmp_path)
    assert "output_layer.weight" not in rank_state(tmp_path, 0)["model"]


def test_ckpt_reads_namespace_args_and_te_names(tiny_hf, tmp_path):
    """megatron-core stores an argparse.Namespace (no HF config) and, with TE, fused layernorm names."""
    src = tiny_hf("qwen2", False)
    convert_hf_to_mcore(src, tmp_path / "mc", tp=2)
    for r in range(2):
        path = tmp_path / "mc" / "iter_0000001" / f"mp_rank_{r:02d}" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=True)
        args = {k: v for k, v in state["args"].items() if k not in ("hf_config", "model_type_hf", "vocab_size")}
        args.pop("hf_generation_config")
        state["args"] = argparse.Namespace(**args)
        model = {}
        for key, value in state["model"].items():
            key = key.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
            model[key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")] = value
            model[key.rsplit(".", 1)[0] + "._extra_state"] = None
        state["model"] = model
        torch.save(state, path)
    ckpt = open_mcore_checkpoint(tmp_path / "mc", vocab_size=VOCAB)
    assert ckpt.spec.model_type == "qwen2"  # guessed from add_qkv_bias
    convert_mcore_to_hf(ckpt, tmp_path / "hf")
    before, after = load_state(src), load_state(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == GROUPS and config["vocab_size"] == VOCAB


def test_ckpt_rank_files_hold_only_their_shards(tiny_hf, tmp_path):
    """torch.save writes a view's whole storage: every saved tensor must own exactly its bytes, so that a TP rank's
    file is 1/TP of the model, not the whole of every split tensor."""
    convert_hf_to_mcore(tiny_hf("qwen2", False), tmp_path, tp=2, pp=2)
    for tp_rank in range(2):
        for pp_rank in range(2):
            for key, t in rank_state(tmp_path, tp_rank, pp_rank)["model"].items():
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key


@pytest.mark.parametrize(
    ("key", "value"),
    [("normalization", "LayerNorm"), ("add_bias_linear", True), ("num_experts", 8), ("rotary_percent", 0.5),
     ("use_rope_scaling", True)],
)  # fmt: skip
def test_ckpt_unsupported_megatron_args_are_named(tiny_hf, tmp_path, key, value):
    convert_hf_to_mcore(tiny_hf("qwen2", False), tmp_path / "mc")
    path = tmp_path / "mc" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    state["args"].update({key: value, "hf_config": None, "model_type_hf": None})
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=key):
        open_mcore_checkpoint(tmp_path / "mc")

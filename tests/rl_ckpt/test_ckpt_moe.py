"""Mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its gated shared expert): HF -> Megatron per-rank files
with the experts split over expert-parallel ranks (``mp_rank_XX[_YYY]_ZZZ``, as Megatron names them) -> HF gives
bitwise identical tensors; Megatron's grouped-GEMM expert names read alike; what is not mapped is refused by name."""

from __future__ import annotations

import pytest
import torch
from ckpt_models import load_state

from rl_ckpt import convert_hf_to_mcore, convert_mcore_to_hf, open_mcore_checkpoint
from rl_ckpt.cli import main
from rl_ckpt.errors import CheckpointError
from rl_engines.tiny_model import build_tiny_moe_lm

VOCAB = 96


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe_hf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_moe_lm(
        path, model_type=request.param, vocab_size=VOCAB, num_experts=4, num_hidden_layers=2, num_key_value_heads=2
    )  # two KV heads: TP = 2 splits them
    return path


def _rank_file(root, name):
    return torch.load(root / "iter_0000001" / name / "model_optim_rng.pt", weights_only=True)


def _assert_same_tensors(before, after):
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


@pytest.mark.parametrize(("pp", "ep"), [(2, 2), (1, 2)], ids=["pp2_ep2", "pp1_ep2"])
def test_a_moe_round_trip_through_expert_parallel_rank_files_is_bitwise(moe_hf, tmp_path, pp, ep):
    layout = convert_hf_to_mcore(moe_hf, tmp_path / "mcore", 1, pp, ep=ep)
    names = sorted(p.name for p in layout.iteration_dir.iterdir())
    expected = ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]
    assert names == (expected if pp == 2 else ["mp_rank_00_000", "mp_rank_00_001"])  # TP, [PP,] EP

    # each expert-parallel rank holds its own experts (global 2 and 3 are rank 1's local 0 and 1), the rest replicated
    first, second = (_rank_file(tmp_path / "mcore", name)["model"] for name in names[:2])
    hf = load_state(moe_hf)
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    gate_up = [hf[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] for e in (0, 2) for p in ("gate", "up")]
    assert torch.equal(first[fc1], torch.cat(gate_up[:2])) and torch.equal(second[fc1], torch.cat(gate_up[2:]))
    assert torch.equal(first["decoder.layers.0.mlp.router.weight"], second["decoder.layers.0.mlp.router.weight"])

    ckpt = open_mcore_checkpoint(tmp_path / "mcore")  # PP = 1: mp_rank_00_001 is EP rank 1, by the args
    assert (ckpt.layout.pp, ckpt.layout.ep, ckpt.spec.num_experts) == (pp, ep, 4)
    convert_mcore_to_hf(ckpt, tmp_path / "hf", max_shard_size="40KB")
    _assert_same_tensors(hf, load_state(tmp_path / "hf"))


def test_experts_split_over_tensor_parallel_ranks_round_trip_bitwise(moe_hf, tmp_path):
    """TP = 2 x EP = 2: each TP rank holds its half of every expert of its EP rank (Megatron's expert tensor
    parallelism at its default size, TP), gate rows on up rows as in a dense MLP; the shared expert split alike."""
    layout = convert_hf_to_mcore(moe_hf, tmp_path / "mcore", 2, 1, ep=2)
    names = sorted(p.name for p in layout.iteration_dir.iterdir())
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    hf, state = load_state(moe_hf), _rank_file(tmp_path / "mcore", "mp_rank_01_001")["model"]
    gate, up = (hf[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
    half = gate.shape[0] // 2
    assert torch.equal(state["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"],
                       torch.cat([gate[half:], up[half:]]))  # fmt: skip
    down = hf["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert torch.equal(state["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"], down[:, half:])
    ckpt = open_mcore_checkpoint(tmp_path / "mcore")
    assert (ckpt.layout.tp, ckpt.layout.ep) == (2, 2)
    convert_mcore_to_hf(ckpt, tmp_path / "hf", max_shard_size="40KB")
    _assert_same_tensors(hf, load_state(tmp_path / "hf"))


def test_megatron_grouped_gemm_expert_names_read_like_sequential_ones(moe_hf, tmp_path):
    """Megatron-core with moe_grouped_gemm (Transformer Engine) saves local expert j as ``linear_fc1.weight<j>``."""
    convert_hf_to_mcore(moe_hf, tmp_path / "mcore", ep=2)
    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        path = tmp_path / "mcore" / "iter_0000001" / name / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        model = state["model"]
        for key in [k for k in model if ".local_experts." in k]:
            head, rest = key.split("local_experts.")
            local, fc, _ = rest.split(".")
            model[f"{head}{fc}.weight{local}"] = model.pop(key)
        state["args"]["moe_grouped_gemm"] = True
        torch.save(state, path)
    convert_mcore_to_hf(open_mcore_checkpoint(tmp_path / "mcore"), tmp_path / "hf")
    _assert_same_tensors(load_state(moe_hf), load_state(tmp_path / "hf"))


def test_the_cli_converts_and_verifies_a_moe_model_both_ways(moe_hf, tmp_path, capsys):
    argv = ["convert", "--checkpoint_path", str(moe_hf), "--output_path", str(tmp_path / "mc"), "--ep", "2", "--verify"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TP=1 x PP=1 x EP=2" in out and "max abs logits difference 0.000e+00" in out
    argv = ["convert", "--checkpoint_path", str(tmp_path / "mc"), "--output_path", str(tmp_path / "hf"), "--verify"]
    assert main(argv) == 0
    assert "max abs logits difference 0.000e+00" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tp", "ep", "message"),
    [
        (3, 1, r"tensor-parallel size 3 does not divide moe_intermediate_size=\d+; each expert is split"),
        (1, 3, r"expert-parallel size 3 does not divide the 4 experts"),
    ],
)
def test_moe_layouts_not_mapped_are_refused_naming_them(moe_hf, tmp_path, tp, ep, message):
    with pytest.raises(CheckpointError, match=message):
        convert_hf_to_mcore(moe_hf, tmp_path / "mcore", tp, ep=ep)
    assert not (tmp_path / "mcore").exists()


def test_expert_parallelism_on_a_dense_model_is_refused(tiny_hf, tmp_path):
    with pytest.raises(CheckpointError, match=r"expert-parallel size 2 on a dense qwen2 model"):
        convert_hf_to_mcore(tiny_hf("qwen2", False), tmp_path / "mcore", ep=2)

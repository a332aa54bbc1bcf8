"""HF -> Megatron (TP x PP) -> HF gives bitwise identical tensors and identical logits."""

import argparse

import pytest
import torch
import transformers
from ckpt_models import VOCAB, load_state, save_tiny_model

from rl_ckpt import convert_hf_to_mcore, convert_mcore_to_hf, open_mcore_checkpoint
from rl_ckpt.errors import CheckpointError

CASES = [
    *[("qwen2", False, tp, pp) for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]],
    *[("qwen2", True, tp, pp) for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]],
    ("llama", False, 2, 2),
    ("llama", True, 1, 1),
    ("mistral", False, 2, 1),
    ("qwen3", False, 2, 2),
]


def logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    ids = torch.tensor([[1, 5, 17, 42, 99, 200, VOCAB - 1, 3]])
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(("family", "tied", "tp", "pp"), CASES)
def test_ckpt_round_trip_is_bitwise(tiny_hf, tmp_path, family, tied, tp, pp):
    src = tiny_hf(family, tied)
    layout = convert_hf_to_mcore(src, tmp_path / "mcore", tp, pp)
    assert (layout.tp, layout.pp) == (tp, pp)
    ckpt = open_mcore_checkpoint(tmp_path / "mcore")
    assert (ckpt.layout.tp, ckpt.layout.pp, ckpt.spec.model_type) == (tp, pp, family)
    convert_mcore_to_hf(ckpt, tmp_path / "hf", max_shard_size="60KB")

    before, after = load_state(src), load_state(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name], tensor), name
    assert torch.equal(logits(src), logits(tmp_path / "hf"))


def test_ckpt_round_trip_bf16_keeps_dtype(tmp_path):
    src = save_tiny_model(tmp_path / "src", "qwen2", tied=False, dtype=torch.bfloat16)
    convert_hf_to_mcore(src, tmp_path / "mcore", 2, 2)
    convert_mcore_to_hf(open_mcore_checkpoint(tmp_path / "mcore"), tmp_path / "hf")
    before, after = load_state(src), load_state(tmp_path / "hf")
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], before[k]) for k in before)
    assert sorted(before) == sorted(after)


def _as_virtual_pipeline(layout, pp: int, vp: int, out) -> None:
    """The PP = pp·vp rank files of ``layout`` regrouped as Megatron-LM saves a virtual pipeline: the file of
    stage s holds ``model0`` ... ``model{vp-1}``, chunk c being virtual stage c·pp + s (its own file at PP = pp·vp:
    the same layers, numbered from 0), and args naming both sizes."""
    for tp_rank in range(layout.tp):
        for stage in range(pp):
            states = [torch.load(layout.path(tp_rank, chunk * pp + stage), weights_only=False) for chunk in range(vp)]
            args = argparse.Namespace(**states[0]["args"])  # Megatron-LM's args, as its files hold them
            args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = pp, vp
            merged = {"args": args, "checkpoint_version": states[0]["checkpoint_version"],
                      "iteration": states[0]["iteration"],
                      **{f"model{chunk}": state["model"] for chunk, state in enumerate(states)}}  # fmt: skip
            name = f"mp_rank_{tp_rank:02d}_{stage:03d}"
            (out / "iter_0000001" / name).mkdir(parents=True)
            torch.save(merged, out / "iter_0000001" / name / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text("1")


def _assert_vpp_reads_back_bitwise(src, folder, out) -> None:
    """The TP=2 x PP=2 x 2-chunk files in ``folder`` convert back to the HF tensors of ``src`` bit for bit."""
    ckpt = open_mcore_checkpoint(folder)
    assert (ckpt.layout.tp, ckpt.layout.pp, ckpt.vp) == (2, 2, 2)
    convert_mcore_to_hf(ckpt, out)
    before, after = load_state(src), load_state(out)
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


@pytest.mark.parametrize("tied", [False, True])
def test_ckpt_virtual_pipeline_rank_files_convert_bitwise(tiny_hf, tmp_path, tied):
    """Megatron-LM files saved with virtual_pipeline_model_parallel_size (model0, model1, ... in each stage's file):
    TP=2 x PP=2 x 2 chunks of the 4-layer model give the HF tensors back bit for bit (the embedding from stage 0's
    first chunk, the final norm and output layer from the last stage's last chunk)."""
    src = tiny_hf("qwen2", tied)
    layout = convert_hf_to_mcore(src, tmp_path / "pp4", 2, 4)
    _as_virtual_pipeline(layout, 2, 2, tmp_path / "vpp")
    _assert_vpp_reads_back_bitwise(src, tmp_path / "vpp", tmp_path / "hf")


@pytest.mark.parametrize("tied", [False, True])
def test_ckpt_writes_virtual_pipeline_files_as_megatron_lm_saves_them(tiny_hf, tmp_path, tied):
    """hf2mcore with a virtual pipeline (TP=2 x PP=2 x 2 chunks of the 4-layer model): each stage's file holds
    model0 and model1, chunk c of stage s being virtual stage c·2 + s with its layers numbered from 0, tensor for
    tensor what the PP=4 files hold regrouped as Megatron-LM saves them; the args name both sizes; the files read
    back to the HF tensors bit for bit."""
    src = tiny_hf("qwen2", tied)
    _as_virtual_pipeline(convert_hf_to_mcore(src, tmp_path / "pp4", 2, 4), 2, 2, tmp_path / "expected")
    layout = convert_hf_to_mcore(src, tmp_path / "vpp", 2, 2, vp=2)
    for tp_rank in range(2):
        for stage in range(2):
            ours = torch.load(layout.path(tp_rank, stage), weights_only=True)
            expected = torch.load(tmp_path / "expected" / "iter_0000001" / layout.path(tp_rank, stage).parent.name
                                  / "model_optim_rng.pt", weights_only=False)  # fmt: skip
            assert "model" not in ours and sorted(k for k in ours if k.startswith("model")) == ["model0", "model1"]
            for chunk in ("model0", "model1"):
                assert list(ours[chunk]) == list(expected[chunk]), (stage, chunk)
                assert all(torch.equal(ours[chunk][k], v) for k, v in expected[chunk].items()), (stage, chunk)
            args = ours["args"]
            assert (args["pipeline_model_parallel_size"], args["virtual_pipeline_model_parallel_size"]) == (2, 2)
            assert args["num_layers_per_virtual_pipeline_stage"] == 1
    first, last = (torch.load(layout.path(0, s), weights_only=True) for s in (0, 1))
    for chunk in (*(first[c] for c in ("model0", "model1")), *(last[c] for c in ("model0", "model1"))):
        assert {key.split(".")[2] for key in chunk if key.startswith("decoder.layers.")} == {"0"}  # one layer each
    assert "embedding.word_embeddings.weight" in first["model0"] and "output_layer.weight" in last["model1"]
    _assert_vpp_reads_back_bitwise(src, tmp_path / "vpp", tmp_path / "hf")


@pytest.mark.parametrize(
    ("pp", "vp", "message"),
    [
        (1, 2, r"--vp 2 needs --pp >= 2"),
        (2, 3, r"--pp 2 x --vp 3 = 6 virtual stages do not divide num_hidden_layers=4"),
    ],
)
def test_ckpt_virtual_pipeline_sizes_megatron_cannot_run_are_refused(tiny_hf, tmp_path, pp, vp, message):
    with pytest.raises(CheckpointError, match=message):
        convert_hf_to_mcore(tiny_hf("qwen2", False), tmp_path / "out", 1, pp, vp=vp)
    assert not (tmp_path / "out").exists()

"""HF -> Megatron (TP x PP) -> HF gives bitwise identical tensors and identical logits."""

import pytest
import torch
import transformers
from ckpt_models import VOCAB, load_state, save_tiny_model

from rl_ckpt import convert_hf_to_mcore, convert_mcore_to_hf, open_mcore_checkpoint

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

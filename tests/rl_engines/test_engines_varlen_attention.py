"""The varlen attention around PyTorch's flash-attention kernel (``torch_varlen``, issue 15): the way it finds
the sequences (padding mask, restarting position ids, whole rows) and gathers / scatters their tokens, checked on
CPU with a per-sequence sdpa kernel in the varlen kernel's place; the kernel itself runs on CUDA only
(tests/rl_engines/test_engines_gpu_varlen.py). A tiny model with the wrapper gives sdpa's logits on a left-padded
batch, on a packed row and while generating from a cache."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_fixtures import tiny_model_dir
from test_engines_micro_batches import varied_batch

from rl_engines.strategies import varlen_attention
from rl_engines.strategies.model_io import attention_kernel, position_ids_from_mask
from rl_engines.strategies.packing import pack
from rl_engines.strategies.varlen_attention import register, sequence_bounds

__all__ = ["tiny_model_dir"]


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, window):
    """Each sequence through sdpa alone, causal aligned to its last key (flash-attention's convention)."""
    assert window is None and max_q == int(torch.diff(cu_q).max()) and max_k == int(torch.diff(cu_k).max())
    outs = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = (t[a:b].transpose(0, 1) for t, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]),
                                                             (v, cu_k[i], cu_k[i + 1])))  # fmt: skip
        allowed = None
        if causal:
            rows = torch.arange(qi.shape[1], device=qi.device).unsqueeze(1)
            cols = torch.arange(ki.shape[1], device=qi.device).unsqueeze(0)
            allowed = cols <= rows + (ki.shape[1] - qi.shape[1])
        out = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale,
                                                               enable_gqa=True)  # fmt: skip
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    name = register(reference_kernel, name="test_varlen")
    load = lambda kernel: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,  # noqa: E731
                                                               attn_implementation=kernel).eval()  # fmt: skip
    return load("sdpa"), load(name)


def test_sequences_are_found_by_mask_by_restarting_positions_or_by_row():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    q_index, k_index, cu_q, cu_k = sequence_bounds(2, 3, 3, mask, None)
    assert q_index.tolist() == k_index.tolist() == [1, 2, 3, 4, 5] and cu_q.tolist() == cu_k.tolist() == [0, 2, 5]
    q_index, k_index, cu_q, cu_k = sequence_bounds(2, 1, 3, mask, None)  # decoding: one query per row
    assert q_index.tolist() == [0, 1] and k_index.tolist() == [1, 2, 3, 4, 5]
    assert cu_q.tolist() == [0, 1, 2] and cu_k.tolist() == [0, 2, 5] and cu_q.dtype == torch.int32
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # three samples in one row
    assert sequence_bounds(1, 9, 9, None, packed)[2].tolist() == [0, 3, 5, 9]
    rows = torch.tensor([[3, 4], [5, 6]])  # no restart: each row is one sequence
    assert sequence_bounds(2, 2, 2, None, rows)[2].tolist() == [0, 2, 4]
    assert sequence_bounds(2, 2, 2, None, None)[3].tolist() == [0, 2, 4]
    meta = torch.device("meta")  # built on the queries' device even with nothing to take it from (a vision tower)
    assert {t.device for t in sequence_bounds(2, 2, 2, None, None, meta)} == {meta}
    with pytest.raises(ValueError, match=r"a padding mask of 3 columns for 5 keys \(a static KV cache\)"):
        sequence_bounds(1, 1, 5, torch.ones(1, 3), None)


def test_causality_follows_the_module_unless_the_call_says(models):
    """A vision tower's attention is bidirectional (its module says so); ``is_causal=None`` keeps the module's."""
    from types import SimpleNamespace

    q = k = v = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    attend = lambda module, **kw: varlen_attention.varlen_attention(module, q, k, v, None, kernel=reference_kernel,  # noqa: E731
                                                                    **kw)[0]  # fmt: skip
    torch.testing.assert_close(attend(SimpleNamespace(is_causal=True), is_causal=None), causal)
    torch.testing.assert_close(attend(SimpleNamespace(is_causal=False)), full)
    torch.testing.assert_close(attend(SimpleNamespace(is_causal=True), is_causal=False), full)


def test_padded_batch_equals_sdpa(models):
    sdpa, varlen = models
    batch = varied_batch()
    mask = batch.batch["attention_mask"]
    inputs = {"input_ids": batch.batch["input_ids"], "attention_mask": mask,
              "position_ids": position_ids_from_mask(mask)}  # fmt: skip
    with torch.no_grad():
        expected, got = sdpa(**inputs).logits, varlen(**inputs).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_packed_row_equals_each_sample_alone(models):
    sdpa, varlen = models
    batch = varied_batch(size=4)
    packed = pack(batch)
    with torch.no_grad():
        got = varlen(input_ids=packed.input_ids, position_ids=packed.position_ids).logits[0]
    mask = batch.batch["attention_mask"].bool()
    for row in range(4):
        ids = batch.batch["input_ids"][row][mask[row]].unsqueeze(0)
        with torch.no_grad():
            alone = sdpa(input_ids=ids).logits[0]
        torch.testing.assert_close(got[packed.segments[0] == row], alone, atol=1e-5, rtol=1e-5)


def test_generation_from_a_cache_equals_sdpa(models, tiny_model_dir):
    from transformers import AutoTokenizer

    sdpa, varlen = models
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.padding_side = "left"
    inputs = tokenizer(["1+2=", "11+12="], return_tensors="pt", padding=True)
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        expected, got = sdpa.generate(**inputs, **options), varlen.generate(**inputs, **options)
    assert got.tolist() == expected.tolist()


def test_fa2_without_its_package_picks_the_torch_kernel_only_on_cuda(tiny_model_dir, caplog, monkeypatch):
    from rl_engines.config import ModelArgs

    args = ModelArgs(model_name_or_path=str(tiny_model_dir), attn_implementation="fa2")
    monkeypatch.setattr(varlen_attention, "available", lambda: True)  # a CUDA build of torch >= 2.10
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "flash_attn" else object())
    with caplog.at_level(logging.WARNING, logger="rl_engines.strategies.model_io"):
        assert attention_kernel(args, "actor_train") == "torch_varlen"
    assert "runs PyTorch's own flash-attention varlen kernel" in caplog.text


def test_the_sequences_are_found_once_per_forward_not_once_per_layer(models, monkeypatch):
    """Every layer gets the same mask / position tensors: the bounds (and the host read of their longest lengths, a
    device synchronisation on GPU) are found once per forward, not once per layer; the logits stay sdpa's. A tensor
    changed in place since, or another tensor, is read again."""
    sdpa, varlen = models
    found = []
    monkeypatch.setattr(varlen_attention, "sequence_bounds",
                        lambda *args: found.append(args) or sequence_bounds(*args))  # fmt: skip
    batch = varied_batch()
    mask = batch.batch["attention_mask"]
    inputs = {
        "input_ids": batch.batch["input_ids"],
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask),
    }
    assert varlen.config.num_hidden_layers > 1
    with torch.no_grad():
        for forwards in (1, 2):
            got, expected = varlen(**inputs).logits, sdpa(**inputs).logits
            assert len(found) == forwards  # the mask function gives each forward a mask of its own
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)

    cache, row = varlen_attention._LastBounds(), mask.bool().clone()
    shape = (row.shape[0], row.shape[1], row.shape[1])
    first = cache.get(shape, row, None, row.device)
    assert cache.get(shape, row, None, row.device) is first and len(found) == 3
    row[0, int(row[0].int().argmax())] = False  # in place: the version counter moves
    again = cache.get(shape, row, None, row.device)
    assert len(found) == 4 and int(again.cu_q[1]) == int(first.cu_q[1]) - 1
    cache.get(shape, row.clone(), None, row.device)  # equal contents, another tensor
    assert len(found) == 5

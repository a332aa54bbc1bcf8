"""GPU only (``gpu`` marker): the packed and dynamic-batching paths on flash-attention's varlen kernel (issue 15).

With ``attn_implementation: fa2`` on a CUDA worker, a packed row runs through a variable-length flash-attention
kernel: flash-attention-2's own when the flash_attn package is installed (transformers finds the samples from the
restarting position ids), else PyTorch's (``torch.nn.attention.varlen``, rl_engines.strategies.varlen_attention).
Its log-probs and update equal the padded sdpa run's within bf16 rounding, and PyTorch's kernel equals each sequence
through sdpa alone, forward and backward. Skipped without CUDA or without either kernel.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_fixtures import tiny_model_dir
from test_engines_micro_batches import DYNAMIC, PACKED, make, varied_batch
from test_engines_varlen_attention import reference_kernel

from rl_engines.objectives import ActorObjective
from rl_engines.strategies import varlen_attention
from rl_engines.strategies.model_io import attention_kernel

__all__ = ["tiny_model_dir"]

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not (HAS_FLASH_ATTN or varlen_attention.available()),
                       reason="neither flash_attn nor torch.nn.attention.varlen is installed"),
]  # fmt: skip
FA2 = {"attn_implementation": "fa2", "dtype": "bf16"}
LAYOUTS = {"sequence_packing": PACKED, "dynamic_batching": DYNAMIC}


def test_the_worker_runs_a_flash_attention_varlen_kernel(tiny_model_dir):
    from rl_engines.config import ModelArgs

    kernel = attention_kernel(ModelArgs(model_name_or_path=str(tiny_model_dir), **FA2), "actor_train")
    assert kernel == ("flash_attention_2" if HAS_FLASH_ATTN else varlen_attention.TORCH_FLASH)


@pytest.mark.skipif(not varlen_attention.available(), reason="needs CUDA and torch.nn.attention.varlen")
@pytest.mark.parametrize(("heads", "kv_heads", "decode"), [(4, 4, False), (8, 2, False), (4, 2, True)])
def test_torch_kernel_equals_each_sequence_through_sdpa(heads, kv_heads, decode):
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_lengths = torch.tensor([5, 1, 37, 128, 64], device="cuda")
    q_lengths = torch.ones_like(k_lengths) if decode else k_lengths
    cu_q, cu_k = (torch.nn.functional.pad(n.cumsum(0), (1, 0)).int() for n in (q_lengths, k_lengths))
    make = lambda n, h: torch.randn(int(n), h, 64, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q = make(q_lengths.sum(), heads).requires_grad_()
    k, v = make(k_lengths.sum(), kv_heads).requires_grad_(), make(k_lengths.sum(), kv_heads).requires_grad_()
    args = (cu_q, cu_k, int(q_lengths.max()), int(k_lengths.max()))
    options = {"scale": 0.125, "causal": True, "window": None}
    got = varlen_attention.torch_varlen_kernel(q, k, v, *args, **options)
    expected = reference_kernel(q.float(), k.float(), v.float(), *args, **options)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=0)
    if not decode:
        grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
        wanted = torch.autograd.grad(expected.square().sum(), (q, k, v))
        for a, b in zip(grads, wanted, strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("layout", ["sequence_packing", "dynamic_batching"])
@pytest.mark.parametrize("name", ["fsdp2_train", "hf_infer"])
def test_packed_flash_varlen_equals_padded_sdpa(name, layout, tiny_model_dir):
    """Packing: one row of real tokens. Dynamic batching: a row per sample, its padding after its tokens, handed to
    the kernel as a mask (flash-attention then skips it: rl_engines.strategies.packing.needs_padding_mask)."""
    role = "actor_train" if name == "fsdp2_train" else "reference"
    batch = varied_batch()
    mask = batch.batch["response_mask"]
    padded = make(name, tiny_model_dir, role, model_args={"dtype": "bf16", "attn_implementation": "sdpa"})
    packed = make(name, tiny_model_dir, role, model_args=FA2, **LAYOUTS[layout])
    expected = padded.compute_log_probs(batch).batch["log_probs"]
    got = packed.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(got[mask], expected[mask], atol=2e-2, rtol=0)  # bf16 kernels
    if name == "fsdp2_train":
        batch.batch["old_log_probs"] = expected
        objective = ActorObjective(loss_agg_mode="seq-mean-token-mean")
        a, b = padded.train_step(batch, objective), packed.train_step(batch, objective)
        assert b["pg_loss"] == pytest.approx(a["pg_loss"], abs=2e-2)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)

"""GPU only (``gpu`` marker): the packed path on flash-attention's varlen kernel (issue 15).

With ``attn_implementation: fa2`` on a CUDA worker that has the flash_attn package, a packed row runs through
flash-attention-2's variable-length kernel (transformers finds the samples from the restarting position ids), and
its log-probs and update equal the padded sdpa run's within bf16 rounding. Skipped without CUDA or flash_attn.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_fixtures import tiny_model_dir
from test_engines_micro_batches import PACKED, make, varied_batch

from rl_engines.objectives import ActorObjective
from rl_engines.strategies.model_io import attention_kernel

__all__ = ["tiny_model_dir"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not installed"),
]
FA2 = {"attn_implementation": "fa2", "dtype": "bf16"}


def test_the_worker_runs_flash_attention_2(tiny_model_dir):
    from rl_engines.config import ModelArgs

    assert attention_kernel(ModelArgs(model_name_or_path=str(tiny_model_dir), **FA2), "actor_train") == (
        "flash_attention_2"
    )


@pytest.mark.parametrize("name", ["fsdp2_train", "hf_infer"])
def test_packed_flash_varlen_equals_padded_sdpa(name, tiny_model_dir):
    role = "actor_train" if name == "fsdp2_train" else "reference"
    batch = varied_batch()
    mask = batch.batch["response_mask"]
    padded = make(name, tiny_model_dir, role, model_args={"dtype": "bf16", "attn_implementation": "sdpa"})
    packed = make(name, tiny_model_dir, role, model_args=FA2, **PACKED)
    expected = padded.compute_log_probs(batch).batch["log_probs"]
    got = packed.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(got[mask], expected[mask], atol=2e-2, rtol=0)  # bf16 kernels
    if name == "fsdp2_train":
        batch.batch["old_log_probs"] = expected
        objective = ActorObjective(loss_agg_mode="seq-mean-token-mean")
        a, b = padded.train_step(batch, objective), packed.train_step(batch, objective)
        assert b["pg_loss"] == pytest.approx(a["pg_loss"], abs=2e-2)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)

"""The fused fast path on a CUDA device (torch.compile -> Triton kernels) against the eager path on the same device:
the rollout correction and the vanilla PPO loss (forward and gradient) on random, adversarial and full-size
(128 x 4096) inputs, one graph for both sizes, and the automatic choice taking the fused path there. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

from rl_core.rollout_corr import rollout_correction
from tests.rl_core.test_fused import (
    CORRECTIONS,
    adversarial_batches,
    close,
    close_metrics,
    compiled_graphs,
    loss_and_grad,
    random_batch,
    record_compiled,
)

pytestmark = pytest.mark.gpu


def on_cuda(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.cuda() for name, tensor in x.items()}


def batches() -> dict[str, dict[str, torch.Tensor]]:
    cases = {"random": random_batch(), "full_size": random_batch(128, 4096, gap=0.05), **adversarial_batches()}
    return {name: on_cuda(x) for name, x in cases.items()}


@pytest.mark.parametrize("options", CORRECTIONS.values(), ids=CORRECTIONS.keys())
def test_fused_correction_on_gpu_equals_eager(options, monkeypatch):
    used = record_compiled(monkeypatch)
    graphs = compiled_graphs()
    for name, x in batches().items():
        eager = rollout_correction(x["old"], x["rollout"], x["mask"], **options, fused=False)
        fused = rollout_correction(x["old"], x["rollout"], x["mask"], **options, fused=True)
        close(eager[0], fused[0])
        assert torch.equal(eager[1], fused[1]), name
        close_metrics(eager[2], fused[2])
    assert set(used) == {"correction_stacked"}
    assert compiled_graphs() - graphs <= 1  # 6 x 40 and 128 x 4096: one graph with symbolic sizes


def test_fused_vanilla_loss_on_gpu_equals_eager(monkeypatch):
    used = record_compiled(monkeypatch)
    graphs = compiled_graphs()
    for name, x in batches().items():
        weights = torch.rand(x["old"].shape, device="cuda") * 2
        results = []
        for choice in ("0", "1"):
            monkeypatch.setenv("RL_CORE_FUSED", choice)
            results.append(loss_and_grad(x, weights, loss_agg_mode="token-mean"))
        (loss, metrics, grad), (fused_loss, fused_metrics, fused_grad) = results
        close(loss, fused_loss)
        close_metrics(metrics, fused_metrics)
        close(grad, fused_grad)
        assert torch.isfinite(fused_grad).all(), name
    assert set(used) == {"_vanilla"}
    assert compiled_graphs() - graphs <= 1  # 6 x 40 and 128 x 4096: one graph with symbolic sizes


def test_a_full_size_batch_takes_the_fused_path_by_itself(monkeypatch):
    monkeypatch.delenv("RL_CORE_FUSED", raising=False)
    used = record_compiled(monkeypatch)
    x = on_cuda(random_batch(128, 4096))
    rollout_correction(x["old"], x["rollout"], x["mask"], **CORRECTIONS["token_tis_with_token_and_seq_mean_rs"])
    assert used == ["correction_stacked"]

"""The pipeline schedule tests' stages (tests/rl_engines/test_engines_megatron_pp.py): a chain of linear layers split
over the stages of a pipeline group (and over model chunks, under a virtual pipeline), 5 micro-batches. A module of
its own: the Ray workers that run it import only torch and the schedule from it."""

from __future__ import annotations

import torch

MICROS = 5


def chain(layers):
    torch.manual_seed(0)
    return [torch.nn.Linear(4, 4) for _ in range(layers)]


def micro_batches():
    return list(torch.randn(MICROS, 2, 4, generator=torch.Generator().manual_seed(1)))


def micro_loss(index, out):
    return (index + 1) * out.pow(2).sum()  # a different weight per micro-batch: an out-of-order bug shows


def run_chain(stage, chunks):
    """Stage ``stage.rank`` of ``stage.size`` (a PipelineStage over a gloo pipeline group) with ``chunks`` model
    chunks: its layer of each chunk (chunk c's is layer ``c * stages + rank`` of the chain) through the schedule.
    Returns (gradients of its layers, chunk by chunk; the losses by micro-batch, on the last stage)."""
    from dataclasses import replace

    from rl_engines.strategies.megatron_pipeline import run_schedule

    stage = replace(stage, chunks=chunks)
    layers = chain(stage.size * chunks)[stage.rank :: stage.size]
    losses = {}

    def forward(micro, hidden, chunk):
        return torch.tanh(layers[chunk](micro if hidden is None else hidden))

    def on_output(index, micro, out):
        losses[index] = micro_loss(index, out)
        return losses[index]

    run_schedule(stage, micro_batches(), forward, hidden_shape=lambda micro: micro.shape, dtype=torch.float32,
                 device=torch.device("cpu"), on_output=on_output, train=True)  # fmt: skip
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
    return grads, {i: float(v) for i, v in losses.items()}

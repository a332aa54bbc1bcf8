"""The pipeline schedule tests' stage processes (tests/rl_engines/test_engines_megatron_pp.py): a chain of linear
layers split over stages (and model chunks, under a virtual pipeline), 5 micro-batches, over gloo. A module of its
own, so that each spawned stage imports only torch and the schedule, not the test module's Ray, megatron and model
helpers."""

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


def schedule_worker(rank, port, results, stages, chunks):
    """Stage ``rank`` of ``stages``: its layer of each chunk (chunk c's is layer ``c * stages + rank`` of the
    chain); ``results[rank]``: (gradients of its layers, chunk by chunk; the losses by micro-batch)."""
    import torch.distributed as dist

    from rl_engines.strategies.megatron_pipeline import PipelineStage, run_schedule

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=stages)
    layers = chain(stages * chunks)[rank::stages]
    stage = PipelineStage(rank, stages, tuple(range(stages)), dist.group.WORLD, chunks)
    losses = {}

    def forward(micro, hidden, chunk):
        return torch.tanh(layers[chunk](micro if hidden is None else hidden))

    def on_output(index, micro, out):
        losses[index] = micro_loss(index, out)
        return losses[index]

    run_schedule(stage, micro_batches(), forward, hidden_shape=lambda micro: micro.shape, dtype=torch.float32,
                 device=torch.device("cpu"), on_output=on_output, train=True)  # fmt: skip
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
    results[rank] = (grads, {i: float(v) for i, v in losses.items()})
    dist.destroy_process_group()

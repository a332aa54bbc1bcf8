"""The 1F1B schedule test's stage processes (tests/rl_engines/test_engines_megatron_pp.py): 3 stages of one linear
layer each, 5 micro-batches, over gloo. A module of its own, so that each spawned stage imports only torch and the
schedule, not the test module's Ray, megatron and model helpers."""

from __future__ import annotations

import torch

STAGES, MICROS = 3, 5


def stage_layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(4, 4) for _ in range(STAGES)]


def micro_batches():
    return list(torch.randn(MICROS, 2, 4, generator=torch.Generator().manual_seed(1)))


def micro_loss(index, out):
    return (index + 1) * out.pow(2).sum()  # a different weight per micro-batch: an out-of-order bug shows


def schedule_worker(rank, port, results):
    import torch.distributed as dist

    from rl_engines.strategies.megatron_pipeline import PipelineStage, run_schedule

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=STAGES)
    layer = stage_layers()[rank]
    stage = PipelineStage(rank, STAGES, tuple(range(STAGES)), dist.group.WORLD)
    losses = {}

    def forward(micro, hidden):
        return torch.tanh(layer(micro if hidden is None else hidden))

    def on_output(index, micro, out):
        losses[index] = micro_loss(index, out)
        return losses[index]

    run_schedule(stage, micro_batches(), forward, hidden_shape=lambda micro: micro.shape, dtype=torch.float32,
                 device=torch.device("cpu"), on_output=on_output, train=True)  # fmt: skip
    results[rank] = ([p.grad.clone() for p in layer.parameters()], {i: float(v) for i, v in losses.items()})
    dist.destroy_process_group()

"""Pipeline parallelism (PP) of the Megatron strategies: the stages of one model replica and their schedule.

Each stage holds a contiguous block of decoder layers (the first also the embedding, the last the final norm and
the output layer or value head). A micro-batch's hidden states ``[S, B, H]`` (``[S/tp, B, H]`` under sequence
parallelism) travel forward from stage to stage with torch.distributed point-to-point sends, their gradients travel
back the same way. The training schedule is Megatron's non-interleaved 1F1B (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", section 2.2.1): stage ``s`` of ``p`` runs ``p - s - 1``
warm-up forwards, then alternates one forward and one backward, then drains the remaining backwards, so it holds
at most ``p - s`` micro-batches' activations. Sends are asynchronous and receives blocking, which cannot deadlock
because every stage receives in the order its neighbour sends. At one stage the schedule is forward, backward per
micro-batch, as without PP. Plain torch.distributed (gloo on CPU, nccl on GPU); megatron is not imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

Micro = TypeVar("Micro")


@dataclass(frozen=True)
class PipelineStage:
    """This rank's place in its pipeline: stage ``rank`` of ``size``, and the global ranks of all the stages."""

    rank: int = 0
    size: int = 1
    ranks: tuple[int, ...] = (0,)
    """Global rank of each stage of this rank's pipeline (same tensor- and data-parallel position)."""
    group: dist.ProcessGroup | None = None
    """The pipeline-parallel group (None at one stage)."""

    @property
    def first(self) -> bool:
        """Holds the embedding."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Holds the final norm and the output layer (or value head): computes log-probs, values and losses."""
        return self.rank == self.size - 1

    @property
    def last_rank(self) -> int:
        """Global rank of the last stage."""
        return self.ranks[-1]


def current_stage() -> PipelineStage:
    """This rank's stage from Megatron's parallel_state (initialised)."""
    from megatron.core import parallel_state

    size = parallel_state.get_pipeline_model_parallel_world_size()
    if size == 1:
        return PipelineStage(ranks=(dist.get_rank(),))
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    return PipelineStage(parallel_state.get_pipeline_model_parallel_rank(), size, ranks, group)


StageForward = Callable[[Any, "torch.Tensor | None"], torch.Tensor]
"""``(micro-batch, hidden from the previous stage or None on the first) -> output``: the hidden states for the next
stage, or on the last stage the model's output."""
OnOutput = Callable[[int, Any, torch.Tensor], "torch.Tensor | None"]
"""Last stage: ``(micro-batch index, micro-batch, output) -> loss`` to back-propagate (None when not training)."""


class _Schedule:
    """The point-to-point plumbing of one schedule run on one stage."""

    def __init__(self, stage: PipelineStage, forward: StageForward, hidden_shape: Callable[[Any], Sequence[int]],
                 dtype: torch.dtype, device: torch.device, on_output: OnOutput, train: bool) -> None:  # fmt: skip
        self.stage, self.forward_fn, self.hidden_shape = stage, forward, hidden_shape
        self.dtype, self.device, self.on_output, self.train = dtype, device, on_output, train
        self.sends: list[tuple[Any, torch.Tensor]] = []  # (work, tensor kept alive until the send completed)
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}  # index -> (input, output)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self.sends.append((dist.isend(tensor, dst=dst, group=self.stage.group, tag=tag), tensor))

    def _recv(self, shape: Sequence[int], src: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        dist.recv(buffer, src=src, group=self.stage.group, tag=tag)
        return buffer

    def forward(self, index: int, micro: Any) -> None:
        stage = self.stage
        hidden = None
        if not stage.first:
            hidden = self._recv(self.hidden_shape(micro), stage.ranks[stage.rank - 1], index)
            hidden.requires_grad_(self.train)
        output = self.forward_fn(micro, hidden)
        if stage.last:
            loss = self.on_output(index, micro, output)
            if self.train:
                self.saved[index] = (hidden, loss)
            return
        self._send(output, stage.ranks[stage.rank + 1], index)
        if self.train:
            self.saved[index] = (hidden, output)

    def backward(self, index: int) -> None:
        stage = self.stage
        hidden, output = self.saved.pop(index)
        assert output is not None, "the last stage's on_output returned no loss in a training schedule"
        if stage.last:
            output.backward()  # type: ignore[no-untyped-call]
        else:
            grad = self._recv(output.shape, stage.ranks[stage.rank + 1], index)
            torch.autograd.backward(output, grad)
        if hidden is not None:
            grad_in = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
            self._send(grad_in, stage.ranks[stage.rank - 1], index)

    def finish(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def run_schedule(
    stage: PipelineStage,
    micros: Sequence[Micro],
    forward: StageForward,
    *,
    hidden_shape: Callable[[Micro], Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    on_output: OnOutput,
    train: bool,
) -> None:
    """Run ``micros`` through the pipeline; every stage of it calls this with the same micro-batches.

    ``hidden_shape(micro)`` is the shape of the hidden states a stage receives (``[S, B, H]``), ``dtype`` theirs.
    With ``train`` the 1F1B schedule back-propagates every loss ``on_output`` returns (gradients accumulate in the
    parameters' ``.grad``); without, it is forward-only (call it under ``torch.no_grad()``).
    """
    schedule = _Schedule(stage, forward, hidden_shape, dtype, device, on_output, train)
    if not train:
        for index, micro in enumerate(micros):
            schedule.forward(index, micro)
    else:
        warmup = min(stage.size - stage.rank - 1, len(micros))
        for index in range(warmup):
            schedule.forward(index, micros[index])
        for index in range(warmup, len(micros)):
            schedule.forward(index, micros[index])
            schedule.backward(index - warmup)
        for index in range(len(micros) - warmup, len(micros)):
            schedule.backward(index)
    schedule.finish()  # not after an error: a failed neighbour would never receive (its error is the report)


def broadcast_from_last(stage: PipelineStage, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` of the last stage on every stage; the other stages pass buffers of the same shapes and dtypes
    (filled in place and returned)."""
    if stage.size > 1:
        for value in tensors.values():
            dist.broadcast(value, src=stage.last_rank, group=stage.group)
    return tensors


def broadcast_object_from_last(stage: PipelineStage, value: Any) -> Any:
    """A picklable value of the last stage, on every stage (the others pass anything, e.g. None)."""
    if stage.size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=stage.last_rank, group=stage.group)
    return box[0]

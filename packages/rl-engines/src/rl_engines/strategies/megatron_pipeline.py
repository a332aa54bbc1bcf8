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

With Megatron's virtual pipeline (``virtual_pipeline_model_parallel_size`` v > 1, the interleaved schedule of the
same paper, section 2.2.2) each stage holds v model chunks instead of one contiguous block: chunk c of stage s is
virtual stage ``c * p + s``, so a micro-batch passes through every stage v times (stage p - 1's chunk c feeds stage
0's chunk c + 1). The training order is megatron-core's: forwards in its schedule table (groups of N = p
micro-batches, each through chunk 0, then chunk 1, ...), backwards in the same table with the chunks reversed, after
``2 (p - s - 1) + (v - 1) N`` warm-up forwards. A step is one chunk, 1/v of a stage's layers, which shrinks the
pipeline bubble by v at the cost of v times the messages. The schedule of each stage is a plain list of steps
(:func:`stage_steps`), so its freedom from deadlock is checked on its own.
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
    chunks: int = 1
    """Model chunks on each stage (Megatron's virtual pipeline size; 1: one contiguous block of layers)."""
    grad_group: dist.ProcessGroup | None = None
    """The same ranks' group for gradients (None: ``group``). On its own, each direction's messages between two
    stages arrive in the order they were sent, which backends without message tags (NCCL) rely on: with a virtual
    pipeline of two stages, stage 0 sends both activations and gradients to stage 1."""

    @property
    def first(self) -> bool:
        """Holds the embedding (in its first chunk)."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Holds the final norm and the output layer (or value head), in its last chunk: computes log-probs, values
        and losses."""
        return self.rank == self.size - 1

    @property
    def last_rank(self) -> int:
        """Global rank of the last stage."""
        return self.ranks[-1]

    def before(self, chunk: int) -> tuple[int, int] | None:
        """(global rank, chunk) of the virtual stage that feeds this stage's ``chunk``; None for the first."""
        if self.rank > 0:
            return self.ranks[self.rank - 1], chunk
        return (self.ranks[-1], chunk - 1) if chunk > 0 else None

    def after(self, chunk: int) -> tuple[int, int] | None:
        """(global rank, chunk) of the virtual stage this stage's ``chunk`` feeds; None for the last."""
        if self.rank < self.size - 1:
            return self.ranks[self.rank + 1], chunk
        return (self.ranks[0], chunk + 1) if chunk < self.chunks - 1 else None


_GRAD_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def create_gradient_groups(world: int, stages: int) -> None:
    """A second group over each pipeline's ranks, for gradients (:attr:`PipelineStage.grad_group`); every rank calls
    this once, after Megatron's groups exist (its pipelines: ranks ``i, i + world/stages, ...``, PP outermost)."""
    stride = world // stages
    for first in range(stride):
        ranks = tuple(first + stage * stride for stage in range(stages))
        _GRAD_GROUPS[ranks] = dist.new_group(list(ranks))


def current_stage(chunks: int = 1) -> PipelineStage:
    """This rank's stage from Megatron's parallel_state (initialised), with ``chunks`` model chunks."""
    from megatron.core import parallel_state

    size = parallel_state.get_pipeline_model_parallel_world_size()
    if size == 1:
        return PipelineStage(ranks=(dist.get_rank(),))
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return PipelineStage(rank, size, ranks, group, chunks, _GRAD_GROUPS.get(ranks))


StageForward = Callable[[Any, "torch.Tensor | None", int], torch.Tensor]
"""``(micro-batch, hidden from the previous virtual stage or None on the first, chunk) -> output``: the hidden states
for the next virtual stage, or on the last one the model's output."""
OnOutput = Callable[[int, Any, torch.Tensor], "torch.Tensor | None"]
"""Last stage: ``(micro-batch index, micro-batch, output) -> loss`` to back-propagate (None when not training)."""
Step = tuple[str, int, int]
"""``("forward" | "backward", micro-batch index, chunk)``."""


def schedule_table(micros: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """megatron-core's order of (micro-batch, chunk) forwards: groups of ``group`` consecutive micro-batches (the
    last group takes what is left), each group through chunk 0, then chunk 1, ... (``get_schedule_table``)."""
    table = []
    for start in range(0, micros, group):
        members = range(start, min(start + group, micros))
        table += [(micro, chunk) for chunk in range(chunks) for micro in members]
    return table


def group_size(micros: int, stages: int) -> int:
    """Micro-batches per group of the interleaved schedule: ``stages`` (megatron-core's default
    ``microbatch_group_size_per_vp_stage``) when that leaves no short last group; else the smallest larger size that
    megatron-core accepts (the count left over is 0 or at least ``stages``), where megatron-core itself would stop
    with "the remainder of M ... should be 0, or larger than or equal to the pipeline-parallel size". Fewer
    micro-batches than stages: one group."""
    return next((n for n in range(stages, micros + 1) if micros % n == 0 or micros % n >= stages), stages)


def stage_steps(rank: int, stages: int, chunks: int, micros: int, *, train: bool) -> list[Step]:
    """Stage ``rank``'s steps: all forwards in :func:`schedule_table` order without ``train``; else warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards (1F1B; interleaved when
    ``chunks`` > 1, megatron-core's warm-up count ``2 (p - s - 1) + (v - 1) N`` and order)."""
    group = group_size(micros, stages)
    table = schedule_table(micros, chunks, group)
    forwards: list[Step] = [("forward", micro, chunk) for micro, chunk in table]
    if not train:
        return forwards
    backwards: list[Step] = [("backward", micro, chunks - 1 - chunk) for micro, chunk in table]
    warmup = stages - rank - 1 if chunks == 1 else 2 * (stages - rank - 1) + (chunks - 1) * group
    warmup = min(warmup, len(table))
    steps = forwards[:warmup]
    for index in range(len(table) - warmup):
        steps += [forwards[warmup + index], backwards[index]]
    return steps + backwards[len(table) - warmup :]


class _Schedule:
    """The point-to-point plumbing of one schedule run on one stage."""

    def __init__(self, stage: PipelineStage, forward: StageForward, hidden_shape: Callable[[Any], Sequence[int]],
                 dtype: torch.dtype, device: torch.device, on_output: OnOutput, train: bool) -> None:  # fmt: skip
        self.stage, self.forward_fn, self.hidden_shape = stage, forward, hidden_shape
        self.dtype, self.device, self.on_output, self.train = dtype, device, on_output, train
        self.sends: list[tuple[Any, torch.Tensor]] = []  # (work, tensor kept alive until the send completed)
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | None]] = {}  # -> (input, output)

    def _tag(self, index: int, chunk: int, grad: bool) -> int:
        """The message to (micro-batch ``index``, receiving ``chunk``): its hidden states, or their gradient."""
        return (index * self.stage.chunks + chunk) * 2 + grad

    def _group(self, tag: int) -> dist.ProcessGroup | None:
        """Activations on the pipeline group, gradients (odd tags) on its gradient group when there is one."""
        return self.stage.grad_group if tag % 2 and self.stage.grad_group is not None else self.stage.group

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self.sends.append((dist.isend(tensor, dst=dst, group=self._group(tag), tag=tag), tensor))

    def _recv(self, shape: Sequence[int], src: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        dist.recv(buffer, src=src, group=self._group(tag), tag=tag)
        return buffer

    def forward(self, index: int, chunk: int, micro: Any) -> None:
        before, after = self.stage.before(chunk), self.stage.after(chunk)
        hidden = None
        if before is not None:
            hidden = self._recv(self.hidden_shape(micro), before[0], self._tag(index, chunk, False))
            hidden.requires_grad_(self.train)
        output = self.forward_fn(micro, hidden, chunk)
        if after is None:
            loss = self.on_output(index, micro, output)
            if self.train:
                self.saved[index, chunk] = (hidden, loss)
            return
        self._send(output, after[0], self._tag(index, after[1], False))
        if self.train:
            self.saved[index, chunk] = (hidden, output)

    def backward(self, index: int, chunk: int) -> None:
        hidden, output = self.saved.pop((index, chunk))
        assert output is not None, "the last stage's on_output returned no loss in a training schedule"
        before, after = self.stage.before(chunk), self.stage.after(chunk)
        if after is None:
            output.backward()  # type: ignore[no-untyped-call]
        else:
            grad = self._recv(output.shape, after[0], self._tag(index, chunk, True))
            torch.autograd.backward(output, grad)
        if hidden is not None and before is not None:
            grad_in = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
            self._send(grad_in, before[0], self._tag(index, before[1], True))

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
    With ``train`` the (interleaved) 1F1B schedule back-propagates every loss ``on_output`` returns (gradients
    accumulate in the parameters' ``.grad``); without, it is forward-only (call it under ``torch.no_grad()``).
    """
    schedule = _Schedule(stage, forward, hidden_shape, dtype, device, on_output, train)
    for kind, index, chunk in stage_steps(stage.rank, stage.size, stage.chunks, len(micros), train=train):
        if kind == "forward":
            schedule.forward(index, chunk, micros[index])
        else:
            schedule.backward(index, chunk)
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

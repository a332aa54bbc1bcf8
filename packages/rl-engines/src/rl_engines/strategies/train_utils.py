"""Pieces of a training step that do not depend on the sharding engine: optimizer, schedule, metrics, offload."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from rl_core.losses import GlobalBatchInfo
from rl_engines.config import TrainingArgs
from rl_engines.objectives import ADDITIVE_METRICS

DECAYING_SCHEDULES = {"linear", "cosine", "cosine_with_restarts", "polynomial", "cosine_with_min_lr",
                      "cosine_warmup_with_min_lr", "warmup_stable_decay"}  # fmt: skip


def build_optimizer(params: Iterable[nn.Parameter], args: TrainingArgs) -> torch.optim.Optimizer:
    """AdamW with ROLL's training_args (decoupled weight decay, Loshchilov & Hutter 2019)."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, args: TrainingArgs, role: str
) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers' schedule ``lr_scheduler_type`` with warm-up; decaying schedules need ``max_steps``."""
    from transformers import get_scheduler

    prefix = f"{role}.training_args"
    if args.lr_scheduler_type in DECAYING_SCHEDULES and args.max_steps is None:
        raise ValueError(
            f"{prefix}.lr_scheduler_type={args.lr_scheduler_type!r} decays over {prefix}.max_steps, which is not "
            "set; set max_steps (optimizer steps) or use lr_scheduler_type: constant / constant_with_warmup."
        )
    warmup = args.warmup_steps
    if not warmup and args.warmup_ratio and args.max_steps:
        warmup = math.ceil(args.warmup_ratio * args.max_steps)
    if args.max_steps is not None and warmup >= args.max_steps and args.lr_scheduler_type in DECAYING_SCHEDULES:
        raise ValueError(
            f"{prefix}.warmup_steps={warmup} >= max_steps={args.max_steps}: the learning rate would never decay "
            "(ROLL FAQ: lr_decay_steps would be 0). Lower warmup_steps or raise max_steps."
        )
    try:
        return get_scheduler(  # type: ignore[no-any-return]
            args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=args.max_steps
        )
    except ValueError as err:
        raise ValueError(f"{prefix}.lr_scheduler_type={args.lr_scheduler_type!r}: {err}") from None


def global_batch_info(response_mask: torch.Tensor, group: dist.ProcessGroup | None = None) -> GlobalBatchInfo:
    """Valid tokens and sequences of a mini-batch summed over data-parallel ranks (one all-reduce)."""
    mask = response_mask.to(torch.bool)
    counts = all_reduce_sum(torch.tensor([mask.sum(), mask.any(dim=-1).sum()], dtype=torch.float64), group)
    return GlobalBatchInfo(num_tokens=float(counts[0]), num_seqs=float(counts[1]))


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum a small CPU tensor over ranks (through the GPU when the backend is nccl); identity for one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or values.numel() == 0:
        return values
    if dist.get_backend(group) == "nccl":
        on_device = values.cuda()
        dist.all_reduce(on_device, group=group)
        return on_device.cpu()
    dist.all_reduce(values, group=group)
    return values


class MetricAccumulator:
    """Sums micro-batch metrics so the result does not depend on how a mini-batch was split.

    Additive metrics (loss shares) are summed; the others are means over a micro-batch's valid tokens and are
    weighted by that micro-batch's share of the mini-batch's tokens. :meth:`result` sums over DP ranks and
    averages over mini-batches.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._minibatches = 0

    def add(self, metrics: dict[str, torch.Tensor], token_share: float) -> None:
        """One micro-batch's metrics; ``token_share`` = its valid tokens / the mini-batch's (all ranks)."""
        for name, value in metrics.items():
            weight = 1.0 if name in ADDITIVE_METRICS else token_share
            self._sums[name] = self._sums.get(name, 0.0) + weight * float(value)

    def end_minibatch(self) -> None:
        """Mark the end of one optimizer step's mini-batch."""
        self._minibatches += 1

    def result(self) -> dict[str, float]:
        """Metrics summed over DP ranks and averaged over mini-batches."""
        names = sorted(self._sums)
        values = all_reduce_sum(torch.tensor([self._sums[n] for n in names], dtype=torch.float64))
        count = max(self._minibatches, 1)
        return {name: float(v) / count for name, v in zip(names, values.tolist())}


def offload_optimizer_state(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, torch.device]]:
    """Move every device-resident optimizer state tensor to host memory; returns what moved from where."""
    moved = []
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                moved.append((index, key, value.device))
                state[key] = value.to("cpu", non_blocking=True)
    return moved


def reload_optimizer_state(optimizer: torch.optim.Optimizer, moved: list[tuple[int, str, torch.device]]) -> None:
    """Undo :func:`offload_optimizer_state`: exactly the tensors that moved go back (Adam's ``step`` counters,
    kept on the CPU by torch unless capturable, stay there)."""
    states = list(optimizer.state.values())
    for index, key, device in moved:
        states[index][key] = states[index][key].to(device, non_blocking=True)

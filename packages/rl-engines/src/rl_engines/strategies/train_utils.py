"""Pieces of a training step that do not depend on the sharding engine: optimizer, schedule, the checks and the
mini-batch loop of ``train_step``, metrics, offload."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rl_core.batch import BatchSizeError, RolloutBatch
from rl_core.losses import GlobalBatchInfo
from rl_core.losses.ratio_metrics import EXTREME_METRICS
from rl_engines.config import TrainingArgs
from rl_engines.objectives import ADDITIVE_METRICS, Objective

DECAYING_SCHEDULES = {"linear", "cosine", "cosine_with_restarts", "polynomial", "cosine_with_min_lr",
                      "cosine_warmup_with_min_lr", "warmup_stable_decay"}  # fmt: skip


def build_optimizer(
    params: Iterable[nn.Parameter], args: TrainingArgs, foreach: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW with ROLL's training_args (decoupled weight decay, Loshchilov & Hutter 2019); ``foreach=False``: one
    parameter at a time (parameters sharded over different device meshes cannot share a foreach kernel)."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        foreach=foreach,
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


def require_causal_lm(role: str, value_head: bool) -> None:
    """``compute_log_probs``'s check: a value-head model has no log-probs."""
    if value_head:
        raise RuntimeError(f"{role} has a value head; call compute_values")


def require_value_head(role: str, value_head: bool) -> None:
    """``compute_values``'s check: a causal LM has no values."""
    if not value_head:
        raise RuntimeError(f"{role} is a causal LM without a value head; set it up as the critic role")


class TrainScoring:
    """The scoring surface every train strategy shares: ``compute_log_probs`` / ``compute_values`` check the model
    kind and run the strategy's ``_infer`` (its no-grad pass over the infer micro-batch plan) under the method's
    name, which names the pass in the dynamic-batching metrics."""

    role: str
    value_head: bool

    def _infer(self, batch: RolloutBatch, method: str, *, temperature: float, with_entropy: bool,
               disable_adapter: bool = False) -> RolloutBatch:  # fmt: skip
        raise NotImplementedError

    def compute_log_probs(
        self, batch: RolloutBatch, *, temperature: float = 1.0, with_entropy: bool = False,
        disable_adapter: bool = False,
    ) -> RolloutBatch:  # fmt: skip
        """``log_probs [B, R]`` (and ``entropy``) of the responses under the current weights, no gradients.
        ``disable_adapter`` (LoRA): under the base model alone, i.e. the reference policy (ROLL's meta_info key)."""
        require_causal_lm(self.role, self.value_head)
        return self._infer(batch, "compute_log_probs", temperature=temperature, with_entropy=with_entropy,
                           disable_adapter=disable_adapter)  # fmt: skip

    def compute_values(self, batch: RolloutBatch) -> RolloutBatch:
        """Critic ``values [B, R]``."""
        require_value_head(self.role, self.value_head)
        return self._infer(batch, "compute_values", temperature=1.0, with_entropy=False)


def check_objective(role: str, objective: Objective, value_head: bool) -> None:
    """The objective must train what the model outputs: ``values`` for a value head, ``log_probs`` otherwise."""
    if (objective.output == "values") != value_head:
        raise ValueError(
            f"{role}: {type(objective).__name__} trains '{objective.output}', but this model is "
            f"{'a value head' if value_head else 'a causal LM'}; pass CriticObjective to the critic role "
            "and ActorObjective to actor_train."
        )


def check_minibatch(
    role: str, samples: int, args: TrainingArgs, *, per: str = "per rank", dp_note: str = ""
) -> tuple[int, int]:
    """``(micro-batch size, mini-batch size)`` of ``args``; BatchSizeError unless they divide ``samples``.

    ``per`` says what ``samples`` counts (``"per rank"``); ``dp_note`` follows "the role's data-parallel size" in
    the message (how the engine defines it).
    """
    micro = args.per_device_train_batch_size
    minibatch = micro * args.gradient_accumulation_steps
    if samples % minibatch:
        raise BatchSizeError(
            f"{role} got {samples} samples {per}, not a multiple of {role}.training_args."
            f"per_device_train_batch_size ({micro}) x gradient_accumulation_steps "
            f"({args.gradient_accumulation_steps}) = {minibatch}. Fix the batch sizes so that "
            "rollout_batch_size x num_return_sequences_in_group is a multiple of "
            f"{minibatch} x the role's data-parallel size{dp_note}."
        )
    return micro, minibatch


def global_batch_info(response_mask: torch.Tensor, group: dist.ProcessGroup | None = None) -> GlobalBatchInfo:
    """Valid tokens and sequences of a mini-batch summed over data-parallel ranks (one all-reduce)."""
    mask = response_mask.to(torch.bool)
    counts = all_reduce_sum(torch.tensor([mask.sum(), mask.any(dim=-1).sum()], dtype=torch.float64), group)
    return GlobalBatchInfo(num_tokens=float(counts[0]), num_seqs=float(counts[1]))


def gather_batch(batch: RolloutBatch, group: dist.ProcessGroup | None) -> tuple[RolloutBatch, slice]:
    """The concatenated batches of all ranks of ``group``, and the rows of this rank's own batch in it.

    ``dp_split`` hands every rank its own chunk; ranks that hold one model together (a tensor-parallel group)
    must compute on the same samples, so they pool their chunks and each returns its own rows at the end.
    """
    if group is None or dist.get_world_size(group) == 1:
        return batch, slice(0, len(batch))
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, batch, group=group)
    rank = dist.get_rank(group)
    start = sum(len(part) for part in parts[:rank])
    return RolloutBatch.concat(parts), slice(start, start + len(batch))


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum a small CPU tensor over ranks (through the GPU when the backend is nccl); identity for one rank."""
    return _all_reduce(values, group, dist.ReduceOp.SUM)


def all_reduce_max(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`all_reduce_sum` taking the elementwise max."""
    return _all_reduce(values, group, dist.ReduceOp.MAX)


def _all_reduce(values: torch.Tensor, group: dist.ProcessGroup | None, op: Any) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or values.numel() == 0:
        return values
    if dist.get_backend(group) == "nccl":
        on_device = values.cuda()
        dist.all_reduce(on_device, op=op, group=group)
        return on_device.cpu()
    dist.all_reduce(values, op=op, group=group)
    return values


class MetricAccumulator:
    """Sums micro-batch metrics so the result does not depend on how a mini-batch was split.

    Additive metrics (loss shares) are summed; the others are means over a micro-batch's valid tokens and are
    weighted by that micro-batch's share of the mini-batch's tokens. :meth:`result` sums over DP ranks and
    averages over mini-batches. The extremes (``EXTREME_METRICS``: ROLL's ``ratio_max`` / ``ratio_min``) are the
    max / min over every micro-batch, rank and mini-batch.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._maxima: dict[str, float] = {}  # a min is kept as the max of its negation
        self._minibatches = 0

    @staticmethod
    def neutral(name: str) -> torch.Tensor:
        """The value of ``name`` that changes nothing (for a rank that adds the names without reporting)."""
        kind = EXTREME_METRICS.get(name)
        return torch.tensor(-math.inf if kind == "max" else math.inf if kind == "min" else 0.0)

    @classmethod
    def reported(cls, metrics: dict[str, torch.Tensor], reports: bool) -> dict[str, torch.Tensor]:
        """``metrics`` as this rank adds them: as they are when it reports, else each name's :meth:`neutral` value
        (ranks that hold the same samples as another, so that every rank adds the same names)."""
        return metrics if reports else {name: cls.neutral(name) for name in metrics}

    def add(self, metrics: dict[str, torch.Tensor], token_share: float) -> None:
        """One micro-batch's metrics; ``token_share`` = its valid tokens / the mini-batch's (all ranks)."""
        for name, value in metrics.items():
            kind = EXTREME_METRICS.get(name)
            if kind is not None:  # a NaN wins, as torch.max shows it (a diverged ratio must not look plausible)
                signed = float(value) if kind == "max" else -float(value)
                self._maxima[name] = _nan_max(self._maxima.get(name, -math.inf), signed)
                continue
            weight = 1.0 if name in ADDITIVE_METRICS else token_share
            self._sums[name] = self._sums.get(name, 0.0) + weight * float(value)

    def end_minibatch(self) -> None:
        """Mark the end of one optimizer step's mini-batch."""
        self._minibatches += 1

    def result(self) -> dict[str, float]:
        """Metrics summed over DP ranks and averaged over mini-batches; the extremes over all (left out when no
        micro-batch held a token)."""
        names = sorted(self._sums)
        values = all_reduce_sum(torch.tensor([self._sums[n] for n in names], dtype=torch.float64))
        count = max(self._minibatches, 1)
        out = {name: float(v) / count for name, v in zip(names, values.tolist())}
        extremes = sorted(self._maxima)
        maxima = all_reduce_max(torch.tensor([self._maxima[n] for n in extremes], dtype=torch.float64))
        for name, value in zip(extremes, maxima.tolist()):
            if value != -math.inf:
                out[name] = value if EXTREME_METRICS[name] == "max" else -value
        return out


def _nan_max(a: float, b: float) -> float:
    """``max(a, b)``, NaN when either is (Python's ``max`` keeps whichever came first)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


OptimizerStep = Callable[[list[RolloutBatch], MetricAccumulator], float]
"""One mini-batch's optimizer step over its micro-batches; adds their metrics, returns the gradient norm."""


def run_minibatches(
    batch: RolloutBatch,
    split: Callable[[RolloutBatch], list[RolloutBatch]],
    minibatch: int,
    scheduler: Any,
    optimizer_step: OptimizerStep,
) -> dict[str, float]:
    """``optimizer_step`` on each ``minibatch``-sample slice of ``batch``, cut into micro-batches by ``split`` (a
    :class:`~rl_engines.strategies.micro_batches.MicroBatchPlanner`'s, or fixed-size slices).

    Returns the metrics summed over DP ranks and averaged over mini-batches, plus ``grad_norm`` (mean over the
    steps with a finite norm; NaN when none), ``lr`` (mean of the rates the steps applied) and ``skipped_steps``.
    """
    metrics = MetricAccumulator()
    norms, lrs = [], []
    for mini in batch.split(minibatch):
        lrs.append(scheduler.get_last_lr()[0])  # the rate this step applies
        norms.append(optimizer_step(split(mini), metrics))
    result = metrics.result()
    finite = [norm for norm in norms if math.isfinite(norm)]  # skipped steps are counted, not averaged in
    result.update(
        grad_norm=sum(finite) / len(finite) if finite else math.nan,
        lr=sum(lrs) / len(lrs),
        skipped_steps=len(norms) - len(finite),
    )
    return result


def minibatch_info(micros: list[RolloutBatch], group: dist.ProcessGroup | None = None) -> GlobalBatchInfo:
    """:func:`global_batch_info` of the micro-batches of one mini-batch together."""
    return global_batch_info(torch.cat([m.batch["response_mask"] for m in micros]), group)


def token_share(micro: RolloutBatch, info: GlobalBatchInfo) -> float:
    """The micro-batch's valid tokens / the mini-batch's (all ranks): its weight in :class:`MetricAccumulator`."""
    tokens = float(micro.batch["response_mask"].to(torch.bool).sum())
    return tokens / max(info.num_tokens, 1.0)


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

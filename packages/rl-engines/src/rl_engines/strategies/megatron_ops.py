"""Collective math of the Megatron strategies, in plain torch.distributed (no megatron import).

Vocabulary-parallel log-softmax and entropy (each tensor-parallel rank holds a slice of the vocabulary), the
gradient norm and data-parallel gradient sum, the optimizer-state partition over data-parallel ranks, and the
exchange that gives every rank of a model-parallel group the same batch. Every function is exact for a group of
one, so it is testable in a single process.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rl_engines.strategies.train_utils import all_reduce_sum


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank computes the same loss from the sum, so each rank's
    gradient of its own summand is the gradient of the sum (Megatron's ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = value.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_ranks(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable sum of ``value`` over ``group`` (identity for a group of one or None)."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    return _SumOverRanks.apply(value, group)  # type: ignore[no-untyped-call,no-any-return]


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / temperature)`` at ``targets`` over a vocabulary split across ``group``.

    ``logits [B, R, Vl]`` is this rank's slice of the (padded) vocabulary, columns ``vocab_start .. + Vl``;
    columns at or past ``vocab_size`` (Megatron's vocabulary padding) are excluded, so the result equals the
    unpadded model's. ``targets [B, R]`` are global token ids. Entropy ``H = log Z - E_p[z]`` of the same
    distribution when asked. Both ``[B, R]`` float32, differentiable, identical on every rank of ``group``.
    """
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    ids = torch.arange(vocab_start, vocab_start + scaled.shape[-1], device=scaled.device)
    padding = ids >= vocab_size  # [Vl]
    scaled = scaled.masked_fill(padding, float("-inf"))
    peak = scaled.detach().max(dim=-1).values  # [B, R]; a shift, so no gradient is needed
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - peak.unsqueeze(-1)  # -inf at padding
    exp = shifted.exp()
    log_z = sum_over_ranks(exp.sum(dim=-1), group).log()  # log sum_v exp(z_v - peak)
    local = (targets >= vocab_start) & (targets < vocab_start + scaled.shape[-1])
    index = (targets - vocab_start).clamp(0, scaled.shape[-1] - 1).unsqueeze(-1)
    picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~local, 0.0)
    log_probs = sum_over_ranks(picked, group) - log_z
    if not with_entropy:
        return log_probs, None
    weighted = (exp * shifted.masked_fill(padding, 0.0)).sum(dim=-1)  # sum_v exp(z_v) z_v on this slice
    mean_logit = sum_over_ranks(weighted, group) / log_z.exp()
    return log_probs, log_z - mean_logit


def gather_vocab(logits: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Full-vocabulary logits ``[..., V]`` from each rank's slice ``[..., Vl]`` (no gradient), padding trimmed."""
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size]


def sum_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum ``.grad`` over ``group`` (data-parallel ranks) in one flat all-reduce per dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def grad_norm(
    owned: Iterable[nn.Parameter],
    group: dist.ProcessGroup | None,
    experts: Iterable[nn.Parameter] = (),
    expert_group: dist.ProcessGroup | None = None,
) -> float:
    """Global L2 norm of the gradients; ``owned`` lists each distinct parameter on exactly one rank of ``group``
    (TP shards on every rank, replicated tensors on TP rank 0 only), so nothing is counted twice. ``group`` None
    means no tensor parallelism (data-parallel ranks hold identical summed gradients and must not add up).
    ``experts``: MoE expert parameters, distinct on each rank of ``expert_group`` (expert parallelism), summed
    over it first."""
    total = _squares(owned)
    expert_total = _squares(experts)
    if expert_group is not None:
        expert_total = all_reduce_sum(expert_total.cpu().reshape(1), expert_group)[0]
    total = total + expert_total
    if group is None:  # no tensor parallelism: this rank holds every gradient (None is not "the world" here)
        return math.sqrt(float(total))
    return math.sqrt(float(all_reduce_sum(total.cpu().reshape(1), group)[0]))


def _squares(params: Iterable[nn.Parameter]) -> torch.Tensor:
    squares = [param.grad.detach().float().pow(2).sum() for param in params if param.grad is not None]
    return torch.stack(squares).sum().double().cpu() if squares else torch.zeros((), dtype=torch.float64)


def clip_gradients(params: Iterable[nn.Parameter], norm: float, max_norm: float | None) -> None:
    """Scale gradients by ``max_norm / (norm + 1e-6)`` when that is below 1 (``torch.nn.utils.clip_grad_norm_``)."""
    if max_norm is None or not math.isfinite(norm):
        return
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coef)


def partition_optimizer_state(
    optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    """``optimizer`` (same class, parameters and hyper-parameters) with its state partitioned over ``group``.

    ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO", section 5.1), what Megatron's DistributedOptimizer does: each
    data-parallel rank keeps the state of a disjoint set of whole parameters (balanced greedily by size), updates
    only those and broadcasts them after the step (torch's ``ZeroRedundancyOptimizer``). The gradients must already
    be summed over ``group``; as AdamW is elementwise the update equals the unpartitioned one. A group of one (or
    None) returns ``optimizer`` itself. ``optimizer`` must not have taken a step yet (its state is not carried).
    """
    if group is None or dist.get_world_size(group) == 1:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer  # ~1 s to import: only when used

    accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold keys __init__ does not take
    hyper = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    params = [param for param_group in optimizer.param_groups for param in param_group["params"]]
    return ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), process_group=group, **hyper)


class ChainedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters stepped as one (Megatron's ``ChainedOptimizer``): a MoE model's
    dense and expert parameters, whose state partitions over different groups. ``param_groups`` are the parts'
    own group dicts (so an LR scheduler sets every part's rate), ``state`` their merged per-parameter states."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:  # no Optimizer.__init__: the parts hold all
        self.parts = parts
        self.defaults = dict(parts[0].defaults)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for part in self.parts for group in part.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {param: value for part in self.parts for param, value in part.state.items()}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``state_dict`` over the chained parameter order (each part's groups in turn), split over the parts."""
        groups, first_group, first_param = state_dict["param_groups"], 0, 0
        for part in self.parts:
            count = len(part.param_groups)
            own = groups[first_group : first_group + count]
            size = sum(len(group["params"]) for group in part.param_groups)
            span = range(first_param, first_param + size)
            part.load_state_dict({
                "state": {index - first_param: value for index, value in state_dict["state"].items() if index in span},
                "param_groups": [{**g, "params": [i - first_param for i in g["params"]]} for g in own],
            })  # fmt: skip
            first_group, first_param = first_group + count, first_param + size


def chained_optimizer(parts: Sequence[tuple[torch.optim.Optimizer, dist.ProcessGroup | None]],
                      distributed: bool) -> torch.optim.Optimizer:  # fmt: skip
    """``(optimizer, its data-parallel group)`` parts as one optimizer, each part's state partitioned over its group
    when ``distributed`` (:func:`partition_optimizer_state`); one part is returned as itself."""
    built = [partition_optimizer_state(opt, group) if distributed else opt for opt, group in parts]
    return built[0] if len(built) == 1 else ChainedOptimizer(built)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: the partition's own one under :func:`partition_optimizer_state`
    (each part's, chained, for a :class:`ChainedOptimizer`), else ``optimizer`` itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        parts = [local_optimizer(part) for part in optimizer.parts]
        same = all(a is b for a, b in zip(parts, optimizer.parts, strict=True))
        return optimizer if same else ChainedOptimizer(parts)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim  # type: ignore[no-any-return]
    return optimizer


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of the tensors in the optimizer state this rank holds (AdamW: ``exp_avg`` + ``exp_avg_sq`` +
    one ``step`` per parameter that has taken a step)."""
    states = local_optimizer(optimizer).state.values()
    return sum(value.numel() for state in states for value in state.values() if isinstance(value, torch.Tensor))

"""Expert parallelism for ``fsdp2_train`` / ``fsdp2_infer`` (ROLL's strategy_config ``ep_size``, ``efsdp_size``).

A transformers MoE layer keeps its experts in two stacked parameters (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``: Qwen3-MoE, Qwen2-MoE, Qwen3-VL-MoE). With ``ep_size`` > 1 the ranks form ROLL's
expert mesh ``(eddp, efsdp, ep)`` (``eddp = world / (efsdp_size * ep_size)``; the ``ep`` ranks are consecutive):

- each rank of an ``ep`` group holds ``E / ep_size`` experts of every layer (rank k: experts ``[k E/ep, (k+1) E/ep)``),
  sharded by FSDP2 over ``efsdp`` and replicated over ``eddp`` (HSDP); everything else (attention, norms, routers,
  shared experts, embeddings) is sharded over the dense mesh as without expert parallelism;
- a MoE layer's experts see the tokens of the whole ``ep`` group: each rank gathers the group's hidden states and
  routing, its experts add their weighted outputs, and the sums go back to the ranks the tokens came from (an
  all-gather and a reduce-scatter, differentiable: every expert gets the gradient of every token routed to it);
- gradients are summed (the strategy's losses are global shares), so each expert's gradient is summed over the ranks
  holding it; the global norm counts each expert once (:func:`grad_norm`); exports gather the experts over the
  ``ep`` ranks in expert order, and checkpoints keep each ``ep`` rank's experts under its own names
  (:func:`checkpoint_name`), so resuming needs the same ``ep_size``.

Samples stay data-parallel over all ranks, as in ROLL. ``moe_use_grouped_mm`` (torch's grouped GEMM over a rank's
experts) is a kernel choice: the experts run one after another here, the same math.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

EP_KEYS: dict[str, tuple[type, ...]] = {"ep_size": (int,), "efsdp_size": (int,), "moe_use_grouped_mm": (bool,)}
"""ROLL's fsdp2 expert-parallel keys (strategy_config)."""
GROUPED_MM_NOTE = (
    "torch's grouped GEMM over a rank's experts (a GPU kernel choice); the experts run one after another here "
    "(transformers' eager experts), the same math"
)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
CHECKPOINT_TAG = ".ep_rank_"
"""An expert tensor's checkpoint name: ``<name>.ep_rank_<k>`` (rank k's experts)."""


@dataclass
class ExpertMesh:
    """This rank's place on the expert mesh ``(eddp, efsdp, ep)``."""

    ep: int
    efsdp: int
    eddp: int
    ep_rank: int
    ep_group: Any
    shard_mesh: Any
    """The mesh FSDP2 shards the experts over: ``(eddp, efsdp)`` (HSDP) or ``(efsdp,)``."""


def check_expert_options(options: dict[str, Any], world: int, prefix: str) -> tuple[int, int]:
    """``(ep_size, efsdp_size)``; their product must divide the world size, each >= 1."""
    ep, efsdp = int(options.get("ep_size") or 1), int(options.get("efsdp_size") or 1)
    for key, value in (("ep_size", ep), ("efsdp_size", efsdp)):
        if value < 1:
            raise ValueError(f"{prefix}.{key}={value} must be >= 1.")
    if world % (ep * efsdp):
        raise ValueError(
            f"{prefix}.efsdp_size={efsdp} x {prefix}.ep_size={ep} = {ep * efsdp} must divide the role's world size "
            f"{world} (ROLL's rule: the expert mesh is (world / (efsdp_size * ep_size), efsdp_size, ep_size))."
        )
    return ep, efsdp


def expert_mesh(ep: int, efsdp: int, device_type: str) -> ExpertMesh:
    """The expert mesh over all ranks (a collective: every rank builds it)."""
    from torch.distributed.device_mesh import init_device_mesh

    eddp = dist.get_world_size() // (ep * efsdp)
    mesh = init_device_mesh(device_type, (eddp, efsdp, ep), mesh_dim_names=("eddp", "efsdp", "ep"))
    shard = mesh["eddp", "efsdp"] if eddp > 1 else mesh["efsdp"]
    return ExpertMesh(ep, efsdp, eddp, mesh.get_local_rank("ep"), mesh.get_group("ep"), shard)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stacked-experts modules of ``model`` (name, module)."""
    found = []
    for name, module in model.named_modules():
        params = [getattr(module, p, None) for p in EXPERT_PARAMS]
        if all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params) and hasattr(module, "num_experts"):
            found.append((name, module))
    return found


def split_experts(model: nn.Module, mesh: ExpertMesh, prefix: str) -> list[nn.Module]:
    """Keep this ``ep`` rank's experts of every MoE layer and route the layer's tokens through the ``ep`` group;
    returns the expert modules (FSDP2 shards each over ``mesh.shard_mesh``)."""
    modules = expert_modules(model)
    if not modules:
        raise ValueError(f"{prefix}.ep_size={mesh.ep}: the model has no stacked MoE experts to split; remove it.")
    for name, found in modules:
        module: Any = found
        total = int(module.num_experts)
        if total % mesh.ep:
            raise ValueError(f"{prefix}.ep_size={mesh.ep} does not divide the {total} experts of {name}; pick a "
                             "divisor.")  # fmt: skip
        count = total // mesh.ep
        if count % mesh.efsdp:
            raise ValueError(f"{prefix}.efsdp_size={mesh.efsdp} does not divide the {count} experts each ep rank "
                             f"holds ({total} / ep_size {mesh.ep}); pick a divisor.")  # fmt: skip
        start = mesh.ep_rank * count
        for param in EXPERT_PARAMS:
            full = getattr(module, param)
            setattr(module, param, nn.Parameter(full.data[start : start + count].clone()))
        module.num_experts = count
        module.ep_slice = (start, count)
        module.ep_group = mesh.ep_group
        module.forward = types.MethodType(_ep_forward, module)
    return [module for _, module in modules]


def expert_param_names(model: nn.Module) -> set[str]:
    """Names of the expert parameters split over the ``ep`` ranks (after :func:`split_experts`)."""
    return {f"{name}.{param}" if name else param for name, module in model.named_modules()
            if hasattr(module, "ep_slice") for param in EXPERT_PARAMS}  # fmt: skip


def _ep_forward(self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
    """The layer's experts over the ``ep`` group's tokens; returns this rank's tokens' outputs."""
    group = self.ep_group
    start, count = self.ep_slice
    rows = torch.tensor([hidden.shape[0]], device=hidden.device)
    sizes = [torch.zeros_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, rows, group=group)
    most = int(max(int(size) for size in sizes))
    pad = most - hidden.shape[0]
    hidden_all = _GatherRows.apply(nn.functional.pad(hidden, (0, 0, 0, pad)), group)  # type: ignore[no-untyped-call]
    weights_all = _GatherRows.apply(nn.functional.pad(top_k_weights, (0, 0, 0, pad)), group)  # type: ignore[no-untyped-call]
    index = nn.functional.pad(top_k_index, (0, 0, 0, pad), value=-1)
    parts = [torch.empty_like(index) for _ in sizes]
    dist.all_gather(parts, index.contiguous(), group=group)
    local = torch.cat(parts) - start
    local[(local < 0) | (local >= count)] = count  # another rank's expert (or padding): the skipped index
    eager = getattr(type(self).forward, "__wrapped__", type(self).forward)  # transformers' own experts loop
    out = eager(self, hidden_all, local, weights_all)
    if torch.is_grad_enabled():  # every rank's backward then runs the same collectives, tokens for its experts or not
        out = _Join.apply(out, hidden_all, weights_all)  # type: ignore[no-untyped-call]
    return _ScatterRows.apply(out, group)[: hidden.shape[0]]  # type: ignore[no-untyped-call]


class _Join(torch.autograd.Function):
    """``out`` as it is, tied to the gathered inputs (zero gradient): a rank whose experts got no token computes an
    output with no path back to them, and its backward would skip the gathers' collectives its group runs."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.inputs = [(x.shape, x.dtype, x.device) for x in inputs]
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs)
        return (grad, *zeros)


class _GatherRows(torch.autograd.Function):
    """The group's tensors concatenated along rows (equal rows per rank); backward: this rank's rows of the summed
    gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _ScatterRows(torch.autograd.Function):
    """This rank's rows of the group's summed tensors; backward: the group's gradients concatenated.

    Under activation checkpointing (non-reentrant: the forward is recomputed when the backward first unpacks a saved
    tensor, and only until every saved tensor is back) the ranks of a group must recompute at the same point and
    through the same collectives, though a rank whose experts got no token saves nothing in between. So this saves
    its output (the recompute runs through every collective of the layer) and its backward unpacks it first (every
    rank recomputes here, before any backward collective)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        mine = total.chunk(dist.get_world_size(group))[dist.get_rank(group)].clone()
        ctx.save_for_backward(mine)
        return mine

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.saved_tensors  # noqa: B018 - unpacked for its effect: a checkpointed layer recomputes here on every rank
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


def grad_norm(model: nn.Module, experts: set[str], dense_replicas: int, mesh: ExpertMesh) -> float:
    """The global gradient L2 norm, each weight counted once: a dense weight's shards over its FSDP mesh (replicated
    ``dense_replicas`` times), an expert weight's over ``efsdp`` and the ``ep`` ranks (replicated ``eddp`` times);
    one all-reduce over the world."""
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        square = grad.detach().double().pow(2).sum().cpu()
        if name in experts:
            expert += square
        else:
            dense += square
    total = (dense / dense_replicas + expert / mesh.eddp).reshape(1)
    if dist.get_backend() == "nccl":
        total = total.cuda()
    dist.all_reduce(total)
    return float(total.sqrt())


def clip_gradients(model: nn.Module, norm: float, max_norm: float | None) -> None:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` when below 1 (torch's clip_grad_norm_ rule)."""
    if not max_norm or not torch.isfinite(torch.tensor(norm)):
        return
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(coef)


def gather_experts(full: torch.Tensor, mesh: ExpertMesh) -> torch.Tensor:
    """One expert parameter of every ``ep`` rank (this rank's ``E / ep`` experts, unsharded), in expert order."""
    parts = [torch.empty_like(full) for _ in range(mesh.ep)]
    dist.all_gather(parts, full.contiguous(), group=mesh.ep_group)
    return torch.cat(parts)


def checkpoint_name(name: str, mesh: ExpertMesh) -> str:
    """An expert tensor's name in a checkpoint: its ``ep`` rank's own (the ranks hold different experts under the
    same parameter name)."""
    return f"{name}{CHECKPOINT_TAG}{mesh.ep_rank}"

"""LoRA on Megatron-core's tensor-parallel linears (``megatron_train``, ROLL's ``model_args.lora_*`` keys).

Each adapter belongs to one HF projection (``self_attn.q_proj`` ... ``mlp.down_proj``), as peft's do, so the
adapters train, export and merge exactly like :mod:`rl_engines.strategies.lora`'s: ``A`` from
:func:`~rl_engines.strategies.lora.init_factor` (the same init on every engine and layout), ``B`` zeros, both fp32,
scale ``lora_alpha / lora_rank``. They are sharded like their base weights:

- a column-parallel linear (``linear_qkv`` = q, k, v; ``linear_fc1`` = gate, up) splits its output rows over TP
  ranks, so each part's ``B`` is split by rows (this rank's query groups / ffn rows) and ``A`` is replicated; the
  rank's output delta is assembled in Megatron's fused layout (per query group q, k, v; gate rows then up rows);
  ``A x`` passes through ``copy_to_tensor_model_parallel_region`` so that ``A``'s gradient is summed over the ranks;
- a row-parallel linear (``linear_proj`` = o_proj, ``linear_fc2`` = down_proj) splits its input columns, so ``A`` is
  split by columns, ``A x`` is summed over the ranks (``reduce_from_tensor_model_parallel_region``) and ``B`` is
  replicated.

The adapters live outside the GPTModel (forward hooks on the base linears add their delta), so the model's own
parameters keep Megatron's names: the frozen base is exported and synced with the adapters merged into each rank's
shard, and the adapters alone are gathered under PEFT's names (``base_model.model.model.layers.<i>...lora_A.weight``).
Sequence parallelism at TP > 1 (a sequence-split input) is refused at config time.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from rl_ckpt.layout import fuse_qkv
from rl_engines.config import LORA_ALL_LINEAR, ModelArgs
from rl_engines.strategies.lora import PEFT_PREFIX, init_factor
from rl_engines.strategies.megatron_weights import RankLayout, _from_stage

LINEARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("column", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "self_attention.linear_proj": ("row", ("self_attn.o_proj",)),
    "mlp.linear_fc1": ("column", ("mlp.gate_proj", "mlp.up_proj")),
    "mlp.linear_fc2": ("row", ("mlp.down_proj",)),
}
"""Megatron linear (under ``decoder.layers.<i>.``) -> its parallel kind and the HF projections fused in it."""
PROJECTIONS = tuple(part for _, parts in LINEARS.values() for part in parts)
"""The HF projections LoRA can adapt, in HF (and peft) module order."""


MEGATRON_OTHERS = ("embedding.word_embeddings", "output_layer")
"""Megatron module paths LoRA does not adapt (the embedding and the output head)."""


def adapted_modules(args: ModelArgs, role: str, num_layers: int) -> set[str]:
    """The HF module paths (``model.layers.<i>.self_attn.q_proj``) ``lora_target`` adapts: HF names (``q_proj``),
    Megatron names (``linear_qkv``: every projection fused in it) and ``all-linear`` on every layer, or a regular
    expression; a ValueError names the key when something matches nothing, or the expression also matches the
    embedding or the output head (not adapted, as on the peft strategies).

    A regular expression is matched, as ROLL's mcore adapters match it, against Megatron's module paths
    (``decoder.layers.<i>.self_attention.linear_qkv``, ``decoder.layers.<i>.mlp.linear_fc2``, with the model's
    global layer number ``<i>``), so ``.*proj`` adapts ``linear_proj`` (o_proj) alone, and a matched fused linear
    adapts every projection fused in it. (ROLL numbers the layers of each pipeline stage from 0; here ``<i>`` is the
    layer's number in the whole model at every pipeline size.)"""
    targets, key = args.lora_targets(), f"{role}.model_args.lora_target"
    if isinstance(targets, str):
        return _regex_adapted(targets, key, num_layers)
    names = [part.rsplit(".", 1)[-1] for part in PROJECTIONS] + [m.rsplit(".", 1)[-1] for m in LINEARS]
    paths = [f"model.layers.{layer}.{part}" for layer in range(num_layers) for part in PROJECTIONS]
    parts: set[str] = set()
    missing = []
    for target in targets:
        if target in LORA_ALL_LINEAR:
            parts.update(PROJECTIONS)
            continue
        found = [p for p in PROJECTIONS if p.endswith(f".{target}")]
        found += [p for m, (_, fused) in LINEARS.items() if m.endswith(f".{target}") for p in fused]
        parts.update(found)
        if not found:
            missing.append(target)
    if missing:
        raise ValueError(f"{key} names {missing}, which match no linear layer of the Megatron model; its linear "
                         f"layers are {names} (or use all-linear).")  # fmt: skip
    return {path for path in paths if path.split(".", 3)[3] in parts}


def _regex_adapted(pattern: str, key: str, num_layers: int) -> set[str]:
    """The HF module paths of the projections fused in the Megatron linears whose paths ``pattern`` matches."""
    others = [path for path in MEGATRON_OTHERS if re.fullmatch(pattern, path)]
    if others:
        raise ValueError(f"{key}={pattern!r} also matches {others}, which are not linear layers LoRA adapts here; "
                         f"narrow it to the model's linear layers {list(LINEARS)}.")  # fmt: skip
    matched = {f"model.layers.{layer}.{part}" for layer in range(num_layers) for linear, (_, fused) in LINEARS.items()
               if re.fullmatch(pattern, f"decoder.layers.{layer}.{linear}") for part in fused}  # fmt: skip
    if matched:
        return matched
    hf = any(
        re.fullmatch(pattern, f"model.layers.{layer}.{part}") for layer in range(num_layers) for part in PROJECTIONS
    )
    hint = (" It matches HF module paths (model.layers.<i>.self_attn.q_proj); ROLL's megatron_train matches "
            "Megatron's, so write it for those (q_proj, k_proj and v_proj are one linear_qkv; gate_proj and up_proj "
            "one linear_fc1)." if hf else "")  # fmt: skip
    raise ValueError(
        f"{key}={pattern!r} matches no linear layer of the Megatron model (a regular expression is "
        "matched against whole Megatron module paths, as in ROLL, such as "
        f"'decoder.layers.0.self_attention.linear_qkv'); its linear layers are {list(LINEARS)}.{hint}"
    )


@dataclass
class Factor:
    """One adapter on this rank: ``a`` [r, in or in/tp], ``b`` [out or out/tp, r]; which of them is TP-split."""

    a: nn.Parameter
    b: nn.Parameter
    split: str
    """``b`` (column-parallel: rows split) or ``a`` (row-parallel: columns split)."""


def _shapes(layout: RankLayout) -> dict[str, tuple[int, int]]:
    """HF projection -> full (out, in)."""
    s = layout.spec
    q, kv = s.num_attention_heads * s.head_dim, s.num_query_groups * s.head_dim
    h, f = s.hidden_size, s.ffn_hidden_size
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    return {
        **shapes,
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (f, h),
        "mlp.up_proj": (f, h),
        "mlp.down_proj": (h, f),
    }


class MegatronLora:
    """This rank's adapters on its stage's layers, hooked into ``module`` (a GPTModel stage)."""

    def __init__(self, module: nn.Module, layout: RankLayout, args: ModelArgs, role: str, seed: int,
                 device: torch.device) -> None:  # fmt: skip
        self.layout, self.scale, self.enabled = layout, args.lora_scale, True
        self.adapted = adapted_modules(args, role, layout.spec.num_layers)
        self.factors: dict[str, Factor] = {}
        """By HF module path of the global layer (``model.layers.<i>.self_attn.q_proj``)."""
        tp, rank, shapes = layout.tp, layout.tp_rank, _shapes(layout)
        for local, number in enumerate(layout.local_layers):
            layer: Any = module.decoder.layers[local]  # type: ignore[index,union-attr]
            for linear, (kind, fused) in LINEARS.items():
                names = [f"model.layers.{number}.{p}" for p in fused]
                for name, part in zip(names, fused, strict=True):
                    if name not in self.adapted:
                        continue
                    out, fan_in = shapes[part]
                    a = init_factor(seed, name, args.lora_rank, fan_in)
                    b = torch.zeros(out // tp if kind == "column" else out, args.lora_rank)
                    if kind == "row":
                        a = a.chunk(tp, dim=1)[rank].clone()
                    self.factors[name] = Factor(nn.Parameter(a.to(device)), nn.Parameter(b.to(device)),
                                                "b" if kind == "column" else "a")  # fmt: skip
                if any(name in self.adapted for name in names):
                    hook = self._column_hook(names) if kind == "column" else self._row_hook(names[0])
                    layer.get_submodule(linear).register_forward_hook(hook)

    # ---- parameters ----------------------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` by HF module path, in HF order."""
        for name, factor in self.factors.items():
            yield f"{name}.lora_A.weight", factor.a
            yield f"{name}.lora_B.weight", factor.b

    def sharded_names(self) -> set[str]:
        """The factors split over TP ranks (column-parallel ``B``, row-parallel ``A``)."""
        return {f"{name}.lora_{factor.split.upper()}.weight" for name, factor in self.factors.items()}

    @contextlib.contextmanager
    def disabled(self, disable: bool = True) -> Iterator[None]:
        """The base model alone inside the block (the reference policy) when ``disable``."""
        was, self.enabled = self.enabled, self.enabled and not disable
        try:
            yield
        finally:
            self.enabled = was

    # ---- forward -------------------------------------------------------------------------------------------
    def _delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        factor = self.factors[name]
        return F.linear(F.linear(x, factor.a.to(x.dtype)), factor.b.to(x.dtype))

    def _column_hook(self, names: list[str]) -> Any:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        def hook(module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, Any]) -> Any:
            if not self.enabled:
                return output
            out, bias = output
            x, lead = args[0], out.shape[:-1]
            pieces: list[torch.Tensor | None] = []
            for name in names:
                factor = self.factors.get(name)
                if factor is None:
                    pieces.append(None)
                    continue
                u = copy_to_tensor_model_parallel_region(F.linear(x, factor.a.to(x.dtype)))
                pieces.append(F.linear(u, factor.b.to(x.dtype)))
            return out + self.scale * self._fused(names, pieces, lead, out), bias

        return hook

    def _fused(self, names: list[str], pieces: list[torch.Tensor | None], lead: Any, out: torch.Tensor) -> torch.Tensor:
        """The parts' output deltas in the rank's fused layout (missing parts zero)."""
        shapes, tp = _shapes(self.layout), self.layout.tp
        filled = [p if p is not None else out.new_zeros(*lead, shapes[n.split(".", 3)[3]][0] // tp)
                  for n, p in zip(names, pieces, strict=True)]  # fmt: skip
        if len(filled) == 2:  # gate rows, then up rows
            return torch.cat(filled, dim=-1)
        groups = self.layout.spec.num_query_groups // tp  # per query group: its q heads, k head, v head
        q, k, v = (t.reshape(*lead, groups, -1) for t in filled)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)

    def _row_hook(self, name: str) -> Any:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        def hook(module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, Any]) -> Any:
            if not self.enabled:
                return output
            out, bias = output
            factor, x = self.factors[name], args[0]
            u = reduce_from_tensor_model_parallel_region(F.linear(x, factor.a.to(x.dtype)))
            return out + self.scale * F.linear(u, factor.b.to(x.dtype)), bias

        return hook

    # ---- weights -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def merged(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``params`` (this rank's base parameters by Megatron name) with every adapter merged into its shard:
        ``W + scale B A`` in fp32, stored in ``W``'s dtype."""
        out = dict(params)
        numbers, tp = self.layout.local_layers, self.layout.tp
        shapes = _shapes(self.layout)
        for key, weight in params.items():
            match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)\.weight", key)
            if match is None or match.group(2) not in LINEARS:
                continue
            kind, fused = LINEARS[match.group(2)]
            names = [f"model.layers.{numbers[int(match.group(1))]}.{p}" for p in fused]
            if not any(n in self.factors for n in names):
                continue
            deltas = []
            for name, part in zip(names, fused, strict=True):
                factor = self.factors.get(name)
                rows, cols = shapes[part]
                if factor is None:
                    shard = (rows // tp, cols) if kind == "column" else (rows, cols // tp)
                    deltas.append(torch.zeros(shard))
                else:
                    deltas.append(factor.b.float() @ factor.a.float())
            if len(deltas) == 3:
                delta = fuse_qkv(deltas[0], deltas[1], deltas[2], self.layout.spec.num_query_groups // tp)
            else:
                delta = torch.cat(deltas) if len(deltas) == 2 else deltas[0]
            out[key] = (weight.float() + self.scale * delta.to(weight.device)).to(weight.dtype)
        return out

    def export(self, group: dist.ProcessGroup | None, stage: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Every adapter in full under PEFT's file names, gathered over the TP group and broadcast from its
        pipeline stage (a collective: every rank of the model's TP x PP group iterates and gets each tensor)."""
        layout, device = (
            self.layout,
            next(iter(self.factors.values())).a.device if self.factors else torch.device("cpu"),
        )
        for layer in range(layout.spec.num_layers):
            owner = layout.stage_of(layer)
            names = [f"model.layers.{layer}.{p}" for p in PROJECTIONS if f"model.layers.{layer}.{p}" in self.adapted]
            items = None
            if owner == layout.pp_rank:
                items = []
                for name in names:
                    factor = self.factors[name]
                    a, b = (_gathered(t, layout.tp, group, dim) if factor.split == which else t.detach()
                            for t, which, dim in ((factor.a, "a", 1), (factor.b, "b", 0)))  # fmt: skip
                    items += [(f"{PEFT_PREFIX}{name}.lora_A.weight", a), (f"{PEFT_PREFIX}{name}.lora_B.weight", b)]
            yield from _from_stage(stage, owner, items, device)


def _gathered(t: torch.Tensor, tp: int, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    if tp == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)

"""HF-named full tensors <-> this rank's Megatron-core parameters, with rl_ckpt's layout (QKV / gate-up fusion,
TP splits, vocabulary padding, pipeline stages).

Notation as in ``rl_ckpt.layout``: H hidden, d head dim, nq query heads, g query groups, F ffn size, V vocabulary,
Vp padded vocabulary, tp tensor-parallel size. The critic's value head is HF ``score.{weight,bias}`` ([1, H], [1]).
Under pipeline parallelism a stage holds the layers ``[offset, offset + n)`` under local names
(``decoder.layers.<layer - offset>``); with a virtual pipeline it holds one such block per model chunk, numbered on
from one chunk to the next. HF tensors of other stages are checked and skipped on load and broadcast from their
stage on export. With tied embeddings the last stage keeps its own copy of the embedding as
``output_layer.weight`` (as Megatron does), loaded from the same HF tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rl_ckpt.experts import split_fused
from rl_ckpt.families import FAMILIES
from rl_ckpt.layout import fuse_fc1, fuse_qkv, pad_rows, split
from rl_ckpt.mcore_to_hf import StageShards, layer_to_hf
from rl_ckpt.spec import VISION_MODULE, ModelSpec, vl_text_name
from rl_engines.strategies.megatron_pipeline import PipelineStage

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_QKV = re.compile(r"self_attn\.([qkv])_proj\.(weight|bias)")
_FC1 = {"mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up"}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_SHARED = re.compile(r"mlp\.shared_expert(_gate|\.gate_proj|\.up_proj|\.down_proj)\.weight")
VALUE_HEAD = {"score.weight": "output_layer.weight", "score.bias": "output_layer.bias"}


@dataclass(frozen=True)
class RankLayout:
    """Where this rank sits: its TP rank among ``tp``, the padded vocabulary, whether it has a value head, and its
    pipeline stage (``pp_rank`` of ``pp``, holding ``vp`` model chunks; ``stage_offsets[k]`` is virtual stage k's
    first layer, then ``num_layers``: chunk c of stage s is virtual stage ``c * pp + s``)."""

    spec: ModelSpec
    tp_rank: int
    tp: int
    padded_vocab: int
    value_head: bool
    pp_rank: int = 0
    pp: int = 1
    stage_offsets: tuple[int, ...] = ()
    """``pp * vp + 1`` layer boundaries of the virtual stages; empty means one stage holding every layer."""
    ep_rank: int = 0
    ep: int = 1
    """Expert parallelism (MoE): this rank holds experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)`` of a layer."""
    vp: int = 1
    """Model chunks per stage (Megatron's virtual pipeline size)."""
    vision: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """A VL model's vision-tower tensors (HF file names, ``visual.*``) and shapes: on the first stage, replicated
    over TP ranks, as ``vision_model.*`` (:mod:`.megatron_vision`)."""

    @property
    def local_experts(self) -> int:
        """Experts per layer on this rank (MoE)."""
        return self.spec.num_experts // self.ep

    @property
    def offsets(self) -> tuple[int, ...]:
        """The stage boundaries, ``(0, num_layers)`` at one stage."""
        return self.stage_offsets or (0, self.spec.num_layers)

    @property
    def first(self) -> bool:
        """This stage holds the embedding."""
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        """This stage holds the final norm and the output layer / value head."""
        return self.pp_rank == self.pp - 1

    @property
    def tied_copy(self) -> bool:
        """The last stage holds its own copy of tied embeddings as ``output_layer.weight`` (PP > 1)."""
        return self.pp > 1 and self.spec.tied_embeddings and not self.value_head

    def stage_of(self, layer: int) -> int:
        """The pipeline stage holding global decoder layer ``layer``."""
        return next(k for k in range(self.pp * self.vp) if layer < self.offsets[k + 1]) % self.pp

    @property
    def local_layers(self) -> tuple[int, ...]:
        """The global decoder layers of this stage in local order (chunk by chunk)."""
        blocks = (range(self.offsets[k], self.offsets[k + 1]) for k in range(self.pp_rank, self.pp * self.vp, self.pp))
        return tuple(layer for block in blocks for layer in block)

    def local_number(self, layer: int) -> int:
        """Global decoder layer ``layer``'s local number on this stage (``decoder.layers.<n>``); -1 elsewhere."""
        layers = self.local_layers
        return layers.index(layer) if layer in layers else -1


@dataclass(frozen=True)
class Target:
    """One HF tensor's destination: the Megatron key, the HF shape expected, and how it is laid out."""

    key: str
    shape: tuple[int, ...]
    kind: str
    """``vocab`` (pad rows, split rows), ``rows`` / ``cols`` (split dim 0 / 1), ``copy`` (replicated),
    ``qkv:<q|k|v>`` or ``fc1:<gate|up>`` (one part of a fused tensor), ``elsewhere`` (another pipeline stage's)."""


ELSEWHERE = "elsewhere"


def _elsewhere(target: Target | None, here: bool) -> Target | None:
    """``target`` when it is on this stage, else its ``elsewhere`` stand-in (same HF shape, no key)."""
    return target if target is None or here else Target("", target.shape, ELSEWHERE)


def _layer_target(layout: RankLayout, layer: int, suffix: str) -> Target | None:
    s = layout.spec
    h, d, g, nq, f = s.hidden_size, s.head_dim, s.num_query_groups, s.num_attention_heads, s.ffn_hidden_size
    mc = f"decoder.layers.{layout.local_number(layer)}."  # local numbering on this stage
    norms = FAMILIES.get(s.model_type).layer_norms
    if suffix in norms:
        size = d if "q_norm" in suffix or "k_norm" in suffix else h
        return Target(mc + norms[suffix], (size,), "copy")
    if match := _QKV.fullmatch(suffix):
        which, kind = match.groups()
        if kind == "bias" and not s.qkv_bias:
            return None
        rows = nq * d if which == "q" else g * d
        return Target(f"{mc}self_attention.linear_qkv.{kind}", (rows, h) if kind == "weight" else (rows,),
                      f"qkv:{which}")  # fmt: skip
    if suffix == "self_attn.o_proj.weight":
        return Target(f"{mc}self_attention.linear_proj.weight", (h, nq * d), "cols")
    if s.moe:
        return _moe_target(layout, mc, suffix)
    if suffix in _FC1:
        return Target(f"{mc}mlp.linear_fc1.weight", (f, h), f"fc1:{_FC1[suffix]}")
    if suffix == "mlp.down_proj.weight":
        return Target(f"{mc}mlp.linear_fc2.weight", (h, f), "cols")
    return None


def _moe_target(layout: RankLayout, mc: str, suffix: str) -> Target | None:
    """A MoE layer's router (replicated) and experts: an expert of another expert-parallel rank is ``elsewhere``."""
    s = layout.spec
    h, i = s.hidden_size, s.moe_ffn_hidden_size
    if suffix == "mlp.gate.weight":
        return Target(f"{mc}mlp.router.weight", (s.num_experts, h), "copy")
    if s.moe_shared_expert_ffn_hidden_size and (shared := _SHARED.fullmatch(suffix)):
        return _shared_expert_target(layout, mc, shared.group(1))
    match = _EXPERT.fullmatch(suffix)
    if match is None or int(match.group(1)) >= s.num_experts:
        return None
    expert, proj = int(match.group(1)), match.group(2)
    local = expert - layout.ep_rank * layout.local_experts
    key = f"{mc}mlp.experts.local_experts.{local}."
    if proj == "down_proj":
        target = Target(f"{key}linear_fc2.weight", (h, i), "cols")
    else:
        target = Target(f"{key}linear_fc1.weight", (i, h), f"fc1:{proj.removesuffix('_proj')}")
    return _elsewhere(target, 0 <= local < layout.local_experts)


def _shared_expert_target(layout: RankLayout, mc: str, part: str) -> Target:
    """Qwen2-MoE's shared expert (a SwiGLU MLP on every token, replicated over expert-parallel ranks) and its gate."""
    h, j = layout.spec.hidden_size, layout.spec.moe_shared_expert_ffn_hidden_size
    key = f"{mc}mlp.shared_experts."
    if part == "_gate":
        return Target(f"{key}gate_weight", (1, h), "copy")
    if part == ".down_proj":
        return Target(f"{key}linear_fc2.weight", (h, j), "cols")
    return Target(f"{key}linear_fc1.weight", (j, h), f"fc1:{part.removeprefix('.').removesuffix('_proj')}")


def hf_target(layout: RankLayout, name: str) -> Target | None:
    """Where HF tensor ``name`` goes on this rank (kind ``elsewhere``: on another pipeline stage), or None when
    the model has no such tensor."""
    s = layout.spec
    if layout.vision:  # transformers' module names (model.language_model.*, model.visual.*) as the files spell them
        name = vl_text_name(name)
        shape = dict(layout.vision).get(name)
        if shape is not None:
            return _elsewhere(Target(f"{VISION_MODULE}.{name.removeprefix('visual.')}", shape, "copy"), layout.first)
    vocab_shape = (s.vocab_size, s.hidden_size)
    embedding = Target("embedding.word_embeddings.weight", vocab_shape, "vocab")
    if name == "model.embed_tokens.weight":
        if layout.tied_copy and layout.last:
            return Target("output_layer.weight", vocab_shape, "vocab")
        return _elsewhere(embedding, layout.first)
    if name == "lm_head.weight" and not layout.value_head:
        if s.tied_embeddings:  # the one shared matrix, as in HF (and the last stage's copy under PP)
            return hf_target(layout, "model.embed_tokens.weight")
        return _elsewhere(Target("output_layer.weight", vocab_shape, "vocab"), layout.last)
    if name == "model.norm.weight":
        return _elsewhere(Target("decoder.final_layernorm.weight", (s.hidden_size,), "copy"), layout.last)
    if name in VALUE_HEAD and layout.value_head:
        shape = (1, s.hidden_size) if name.endswith("weight") else (1,)
        return _elsewhere(Target(VALUE_HEAD[name], shape, "copy"), layout.last)
    match = _LAYER.fullmatch(name)
    if match and int(match.group(1)) < s.num_layers:
        layer = int(match.group(1))
        return _elsewhere(_layer_target(layout, layer, match.group(2)), layout.stage_of(layer) == layout.pp_rank)
    return None


class WeightLoader:
    """Copies HF-named full tensors into this rank's parameters; fused tensors (QKV, gate/up) are written once all
    their parts arrived, which may span several calls (weight-sync buckets)."""

    def __init__(self, module: nn.Module, layout: RankLayout, role: str) -> None:
        self.layout, self.role = layout, role
        self.params = {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.written: set[str] = set()

    def target(self, name: str, tensor: torch.Tensor) -> Target:
        """The checked destination of ``name``; KeyError / ValueError naming the tensor otherwise."""
        found = hf_target(self.layout, name)
        if found is None or (found.kind != ELSEWHERE and found.key not in self.params):
            raise KeyError(
                f"{self.role}: weight {name!r} has no counterpart in this Megatron model "
                f"({self.layout.spec.model_type}, {self.layout.spec.num_layers} layers); are the two roles the same "
                "architecture?"
            )
        if tuple(tensor.shape) != found.shape:
            raise ValueError(
                f"{self.role}: weight {name!r} has shape {tuple(tensor.shape)} but {found.shape} here; the two roles "
                "must load the same model."
            )
        return found

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Check and place every tensor (a stacked expert tensor expert by expert, :mod:`rl_ckpt.experts`); returns
        how many HF tensors were taken."""
        spec = self.layout.spec
        given = 0
        for name, tensor in weights:
            given += 1
            parts = (
                split_fused(name, tensor, spec.hidden_size, spec.moe_ffn_hidden_size) if spec.fused_experts else None
            )
            for part_name, part in parts or ((name, tensor),):
                self._place(part_name, part)
        return given

    def _place(self, name: str, tensor: torch.Tensor) -> None:
        target = self.target(name, tensor)
        if target.kind == ELSEWHERE:
            return  # another pipeline stage's tensor (checked above)
        if ":" in target.kind:
            self._add_part(target, tensor)
        else:
            self._write(target.key, self._shard(target, tensor))

    def _shard(self, target: Target, tensor: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if target.kind == "vocab":
            return split(pad_rows(tensor, lay.padded_vocab), lay.tp, 0, target.key)[lay.tp_rank]
        if target.kind in ("rows", "cols"):
            return split(tensor, lay.tp, 0 if target.kind == "rows" else 1, target.key)[lay.tp_rank]
        return tensor

    def _add_part(self, target: Target, tensor: torch.Tensor) -> None:
        group, part = target.kind.split(":")
        parts = self.pending.setdefault(target.key, {})
        parts[part] = tensor.detach().clone()  # the sender's buffer (a shared-memory slot) is reused
        lay = self.layout
        if group == "qkv" and len(parts) == 3:
            fused = fuse_qkv(parts["q"], parts["k"], parts["v"], lay.spec.num_query_groups)
            self._write(target.key, split(fused, lay.tp, 0, target.key)[lay.tp_rank])
        elif group == "fc1" and len(parts) == 2:
            self._write(target.key, fuse_fc1(parts["gate"], parts["up"], lay.tp)[lay.tp_rank])
        else:
            return
        del self.pending[target.key]

    def _write(self, key: str, shard: torch.Tensor) -> None:
        param = self.params[key]
        if param.shape != shard.shape:  # rl_ckpt's layout and Megatron's disagree: a bug, not a user error
            raise RuntimeError(f"{key}: resharded HF tensor has shape {tuple(shard.shape)}, parameter {param.shape}")
        param.data.copy_(shard)
        self.written.add(key)

    def missing(self) -> list[str]:
        """Megatron parameters not written yet (and parts still waiting for their siblings)."""
        return sorted(set(self.params) - self.written) + sorted(f"{k} (partial)" for k in self.pending)


def _all_shards(param: torch.Tensor, sharded: bool, tp: int, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every TP rank's shard of ``param``; a replicated tensor is its own shard everywhere (no communication)."""
    if tp == 1 or not sharded:
        return [param.detach()] * tp
    parts = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return parts


def sharded_names(module: nn.Module) -> set[str]:
    """Names of the parameters Megatron splits over TP ranks (its ``tensor_model_parallel`` attribute)."""
    return {name for name, param in module.named_parameters() if getattr(param, "tensor_model_parallel", False)}


HFTensors = list[tuple[str, torch.Tensor]]


def _from_stage(stage: PipelineStage, owner: int, items: HFTensors | None, device: torch.device) -> HFTensors:
    """``items`` (HF name, tensor) of pipeline stage ``owner`` on every stage: their names, shapes and dtypes as one
    object, then each tensor, broadcast over the pipeline group."""
    if stage.size == 1:
        assert items is not None
        return items
    src = stage.ranks[owner]
    metas = [[(name, tuple(t.shape), t.dtype) for name, t in items] if items is not None else None]
    dist.broadcast_object_list(metas, src=src, group=stage.group)
    if items is None:
        items = [(name, torch.empty(shape, dtype=dtype, device=device)) for name, shape, dtype in metas[0] or []]
    for _, tensor in items:
        dist.broadcast(tensor if tensor.is_contiguous() else tensor.contiguous(), src=src, group=stage.group)
    return items


def _global_experts(
    params: Mapping[str, torch.Tensor], layout: RankLayout, prefix: str, ep_group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """A MoE layer's experts under their global index (SequentialMLP's names), gathered over the expert-parallel
    group: rank r holds experts ``[r * E / ep, (r + 1) * E / ep)`` as its local experts 0.."""
    out: dict[str, torch.Tensor] = {}
    for fc in ("linear_fc1", "linear_fc2"):
        local = torch.stack([params[f"{prefix}mlp.experts.local_experts.{e}.{fc}.weight"].detach()
                             for e in range(layout.local_experts)])  # fmt: skip
        every = _gather_experts(local, layout.ep, ep_group) if layout.ep > 1 else local
        out.update({f"{prefix}mlp.experts.local_experts.{e}.{fc}.weight": every[e] for e in range(len(every))})
    return out


def _gather_experts(local: torch.Tensor, ep: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def export_hf(
    params: Mapping[str, torch.Tensor],
    sharded: set[str],
    layout: RankLayout,
    group: dist.ProcessGroup | None,
    stage: PipelineStage | None = None,
    ep_group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors from this rank's ``params`` (Megatron names; ``sharded`` ones split over TP), gathered
    over the TP group and, under pipeline parallelism, broadcast from the stage that holds them (a collective:
    every rank of the model's TP x PP group iterates, and each gets every tensor). HF order: a tied
    ``lm_head.weight`` comes second, as the same tensor as ``model.embed_tokens.weight``.
    """
    spec, tp = layout.spec, layout.tp
    stage = stage or PipelineStage(ranks=(dist.get_rank() if dist.is_initialized() else 0,))
    paths = [Path(f"<tensor-parallel rank {r}>") for r in range(tp)]
    device = next(iter(params.values())).device

    def shards(key: str) -> list[torch.Tensor]:
        return _all_shards(params[key], key in sharded, tp, group)

    def vocab(key: str) -> torch.Tensor:
        return torch.cat(shards(key), dim=0)[: spec.vocab_size]

    def piece(owner: int, make: Callable[[], HFTensors]) -> HFTensors:
        return _from_stage(stage, owner, make() if owner == layout.pp_rank else None, device)

    [(name, embed)] = piece(0, lambda: [("model.embed_tokens.weight", vocab("embedding.word_embeddings.weight"))])
    yield name, embed
    if spec.tied_embeddings and not layout.value_head:
        yield "lm_head.weight", embed  # right after its twin, so weight sync sends it once (as an alias)
    if layout.vision:  # replicated over TP ranks: no gather
        yield from piece(0, lambda: [(name, params[f"{VISION_MODULE}.{name.removeprefix('visual.')}"].detach())
                                     for name, _ in layout.vision])  # fmt: skip
    for layer in range(spec.num_layers):

        def layer_tensors(layer: int = layer) -> HFTensors:
            local = layout.local_number(layer)
            prefix = f"decoder.layers.{local}."
            keys = [key for key in params if key.startswith(prefix) and ".mlp.experts." not in key]
            gathered = {key: shards(key) for key in keys}
            if spec.moe:  # every expert (gathered over EP ranks), then each TP rank's part of them
                experts = _global_experts(params, layout, prefix, ep_group)
                split = f"{prefix}mlp.experts.local_experts.0.linear_fc1.weight" in sharded
                gathered.update({key: _all_shards(value, split, tp, group) for key, value in experts.items()})
            states = [{key: parts[r] for key, parts in gathered.items()} for r in range(tp)]
            return list(layer_to_hf(StageShards(states, paths), spec, local, layer))

        yield from piece(layout.stage_of(layer), layer_tensors)
    yield from piece(layout.pp - 1, lambda: _last_stage_tensors(params, layout, vocab))


def _last_stage_tensors(
    params: Mapping[str, torch.Tensor], layout: RankLayout, vocab: Callable[[str], torch.Tensor]
) -> HFTensors:
    """The final norm and the value head or (untied) lm_head, in HF order."""
    out = [("model.norm.weight", params["decoder.final_layernorm.weight"].detach())]
    if layout.value_head:
        out += [("score.weight", params["output_layer.weight"].detach()),
                ("score.bias", params["output_layer.bias"].detach())]  # fmt: skip
    elif not layout.spec.tied_embeddings:
        out.append(("lm_head.weight", vocab("output_layer.weight")))
    return out

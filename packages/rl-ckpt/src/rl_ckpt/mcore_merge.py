"""Megatron-core tensors -> HF tensors, shared by both checkpoint formats (per-rank files and torch_dist).

A format yields :class:`StageShards`: the model state dicts of one piece of the model (a PP stage's TP ranks, or one
already-merged layer), with megatron-core's local-spec key names and layer numbers local to the piece. The tensors
may be on disk and not read yet (``sources``): the merge is then a plan (views and concatenations), and the bytes
move once, from the rank files into the output file. :func:`iter_hf_sources` turns the pieces into HF tensors in
order, holding one piece at a time, and refuses tensors it would otherwise drop (biases, experts, ...);
:func:`iter_hf_tensors` reads each into memory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.experts import stack_experts
from rl_ckpt.families import FAMILIES
from rl_ckpt.hf_io import vocab_size_from_tokenizer
from rl_ckpt.layout import fc1_parts, qkv_parts
from rl_ckpt.sources import Source, cat, materialize, rows, shape_of
from rl_ckpt.spec import VISION_MODULE, ModelSpec, arg, spec_from_mcore_args

_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT_KEY = re.compile(
    r"(decoder\.layers\.\d+\.mlp\.experts\.)(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))"
)
"""A rank's local expert j: SequentialMLP's ``local_experts.<j>.linear_fc1.weight`` or Transformer Engine's grouped
GEMM ``linear_fc1.weight<j>`` (megatron-core writes either, by ``moe_grouped_gemm``)."""
_GROUPED_KEY = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.)weight([12])")
"""megatron-core's legacy GroupedMLP (``moe_use_legacy_grouped_gemm``): a rank's experts in two matrices,
``weight1 [H, E_local * 2I/tp]`` and ``weight2 [E_local * I/tp, H]``, which its forward views as
``[E_local, H, 2I/tp]`` (each expert's gate columns then its up columns) and ``[E_local, I/tp, H]``."""
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


class StageShards:
    """The model state dicts of one piece's TP ranks, with merging that checks shapes across ranks.

    ``paths`` name where each state dict came from (error messages); ``first`` / ``last``: the piece holds the
    embedding / the final norm and output layer. ``used`` collects the keys read, see :meth:`unused_keys`.
    """

    def __init__(
        self,
        states: Sequence[Mapping[str, Source]],
        paths: Sequence[Path],
        *,
        first: bool = False,
        last: bool = False,
    ) -> None:
        self.states = states
        self.paths = paths
        self.first, self.last = first, last
        self.used: set[str] = set()

    def shards(self, key: str) -> list[Source]:
        """One tensor per TP rank; raises naming the state dict that lacks ``key`` or disagrees in shape."""
        for state, path in zip(self.states, self.paths):
            if key not in state:
                raise CheckpointError(f"tensor {key} is missing from {path}")
        self.used.add(key)
        out = [state[key] for state in self.states]
        for t, path in zip(out[1:], self.paths[1:]):
            if shape_of(t) != shape_of(out[0]):
                raise CheckpointError(
                    f"tensor {key} has shape {shape_of(out[0])} in {self.paths[0]} but {shape_of(t)} in "
                    f"{path}; the rank files come from different models or one is corrupt"
                )
        return out

    def concat(self, key: str, dim: int) -> Source:
        """TP shards of ``key`` concatenated along ``dim``, not computed (the only shard itself when TP = 1)."""
        return cat(self.shards(key), dim)

    def cat(self, key: str, dim: int) -> torch.Tensor:
        """TP shards of ``key`` concatenated along ``dim`` (the only shard itself when TP = 1)."""
        return materialize(self.concat(key, dim))

    def num_layers(self) -> int:
        """Number of decoder layers in this piece (local numbering 0..n-1)."""
        found = {int(m.group(1)) for key in self.states[0] if (m := _LAYER_KEY.match(key))}
        if found != set(range(len(found))):
            raise CheckpointError(f"{self.paths[0]}: local layer numbers {sorted(found)} are not 0..n-1")
        return len(found)

    def check(self, t: Source, shape: tuple[int, ...], key: str) -> Source:
        """``t`` when it has ``shape``; else raise naming the tensor, the rank files and the args."""
        if shape_of(t) != shape:
            raise CheckpointError(
                f"tensor {key} from {', '.join(map(str, self.paths))} merges to shape {shape_of(t)} but the "
                f"args imply {shape}; the file is corrupt or the args (or --model_type / --vocab_size) are wrong"
            )
        return t

    def unused_keys(self) -> list[str]:
        """Tensors of this piece no HF tensor was made from (a model feature rl-ckpt does not convert)."""
        return sorted(set(self.states[0]) - self.used)


def layer_to_hf(stage: StageShards, spec: ModelSpec, local: int, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of global layer ``layer`` from local layer ``local`` of ``stage`` (see :func:`layer_sources`)."""
    for name, src in layer_sources(stage, spec, local, layer):
        yield name, materialize(src)


def layer_sources(stage: StageShards, spec: ModelSpec, local: int, layer: int) -> Iterator[tuple[str, Source]]:
    """HF tensors of global layer ``layer`` from local layer ``local`` of ``stage``, as views / concatenations.

    linear_qkv [g*(r+2)*d, H] -> q [nq*d, H], k, v [g*d, H]; linear_fc1 shards [2F/tp, H] -> gate, up [F, H].
    """
    mc, hf = f"decoder.layers.{local}.", f"model.layers.{layer}.self_attn."
    h, d, g, nq, f = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_query_groups,
        spec.num_attention_heads,
        spec.ffn_hidden_size,
    )
    rows_qkv = (nq + 2 * g) * d
    for kind, tail in (("weight", (h,)), ("bias", ())) if spec.qkv_bias else (("weight", (h,)),):
        key = f"{mc}self_attention.linear_qkv.{kind}"
        q, k, v = qkv_parts(stage.check(stage.concat(key, 0), (rows_qkv, *tail), key), g, d)
        yield from ((f"{hf}{n}_proj.{kind}", t) for n, t in (("q", q), ("k", k), ("v", v)))
    key = f"{mc}self_attention.linear_proj.weight"
    yield f"{hf}o_proj.weight", stage.check(stage.concat(key, 1), (h, nq * d), key)
    if spec.moe:
        yield from _moe_sources(stage, spec, mc, layer)
    else:
        key = f"{mc}mlp.linear_fc1.weight"
        gate, up = fc1_parts([stage.check(s, (2 * f // len(stage.paths), h), key) for s in stage.shards(key)])
        mlp = f"model.layers.{layer}.mlp."
        yield f"{mlp}gate_proj.weight", gate
        yield f"{mlp}up_proj.weight", up
        key = f"{mc}mlp.linear_fc2.weight"
        yield f"{mlp}down_proj.weight", stage.check(stage.concat(key, 1), (h, f), key)
    for hf_name, mc_name in FAMILIES.get(spec.model_type).layer_norms.items():
        size = d if "q_norm" in hf_name or "k_norm" in hf_name else h
        yield f"model.layers.{layer}.{hf_name}", stage.check(stage.shards(mc + mc_name)[0], (size,), mc + mc_name)


def _moe_sources(stage: StageShards, spec: ModelSpec, mc: str, layer: int) -> Iterator[tuple[str, Source]]:
    """A MoE layer (experts under their global index, see :func:`merge_expert_ranks`; at TP > 1 each expert and the
    shared expert split over the TP ranks as a dense MLP is, Megatron's expert tensor parallelism at its default size):
    the router, every expert's gate / up / down projections in HF's per-expert names (stacked into two tensors where
    the model's files stack them, :mod:`rl_ckpt.experts`), and Qwen2-MoE's gated shared expert."""
    mlp, h = f"model.layers.{layer}.mlp.", spec.hidden_size
    key = f"{mc}mlp.router.weight"
    yield f"{mlp}gate.weight", stage.check(stage.shards(key)[0], (spec.num_experts, h), key)
    experts = [(f"{mc}mlp.experts.local_experts.{e}.", f"{mlp}experts.{e}.", spec.moe_ffn_hidden_size)
               for e in range(spec.num_experts)]  # fmt: skip
    if spec.fused_experts:
        yield from _stacked_experts(stage, spec, mlp, [source for source, _, _ in experts])
    parts = [] if spec.fused_experts else experts
    if spec.moe_shared_expert_ffn_hidden_size:
        parts.append((f"{mc}mlp.shared_experts.", f"{mlp}shared_expert.", spec.moe_shared_expert_ffn_hidden_size))
    for source, target, size in parts:
        (gate, up), down = _expert_mlp(stage, h, source, size)
        yield f"{target}gate_proj.weight", gate
        yield f"{target}up_proj.weight", up
        yield f"{target}down_proj.weight", down
    if spec.moe_shared_expert_ffn_hidden_size:
        key = f"{mc}mlp.shared_experts.gate_weight"
        yield f"{mlp}shared_expert_gate.weight", stage.check(stage.shards(key)[0], (1, h), key)


def _expert_mlp(stage: StageShards, h: int, source: str, size: int) -> tuple[tuple[Source, Source], Source]:
    """(gate, up), down of one expert's (or the shared expert's) SwiGLU MLP under ``source``: linear_fc1 shards
    ``[2I/tp, H]`` (each rank's gate rows on its up rows), linear_fc2 ``[H, I/tp]`` concatenated along columns."""
    key = f"{source}linear_fc1.weight"
    fc1 = fc1_parts([stage.check(s, (2 * size // len(stage.paths), h), key) for s in stage.shards(key)])
    key = f"{source}linear_fc2.weight"
    return fc1, stage.check(stage.concat(key, 1), (h, size), key)


def _stacked_experts(stage: StageShards, spec: ModelSpec, mlp: str, experts: list[str]) -> Iterator[tuple[str, Source]]:
    """``experts.gate_up_proj`` / ``experts.down_proj`` of a layer from its experts' ``linear_fc1`` / ``linear_fc2``
    (keys under ``experts``, in order). At TP = 1 the stacks are views of the shards (read when written); at TP > 1
    each expert's TP shards are merged in memory first (one layer's experts at a time)."""
    h, size = spec.hidden_size, spec.moe_ffn_hidden_size
    if len(stage.paths) == 1:
        fc1 = [stage.check(stage.shards(f"{e}linear_fc1.weight")[0], (2 * size, h), f"{e}linear_fc1.weight")
               for e in experts]  # fmt: skip
        fc2 = [stage.check(stage.shards(f"{e}linear_fc2.weight")[0], (h, size), f"{e}linear_fc2.weight")
               for e in experts]  # fmt: skip
    else:
        mlps = [_expert_mlp(stage, h, e, size) for e in experts]
        fc1 = [materialize(cat(list(parts), 0)) for parts, _ in mlps]
        fc2 = [materialize(down) for _, down in mlps]
    gate_up, down = stack_experts(fc1, fc2)
    yield f"{mlp}experts.gate_up_proj", gate_up
    yield f"{mlp}experts.down_proj", down


def check_moe_layout(spec: ModelSpec, tp: int, ep: int, where: str) -> None:
    """Expert parallelism only on a MoE model, dividing its experts; at TP > 1 a MoE model's experts (and shared
    expert) split over the TP ranks as its dense MLPs are (Megatron's expert tensor parallelism at its default size,
    TP), so TP divides their intermediate sizes."""
    if ep > 1 and not spec.moe:
        raise CheckpointError(f"{where}: expert-parallel size {ep} on a dense {spec.model_type} model")
    if spec.moe and spec.num_experts % ep:
        raise CheckpointError(f"{where}: expert-parallel size {ep} does not divide the {spec.num_experts} experts")
    for key, size in (("moe_intermediate_size", spec.moe_ffn_hidden_size),
                      ("shared_expert_intermediate_size", spec.moe_shared_expert_ffn_hidden_size)):  # fmt: skip
        if spec.moe and size % tp:
            raise CheckpointError(f"{where}: tensor-parallel size {tp} does not divide {key}={size}; each expert is "
                                  "split over the TP ranks")  # fmt: skip


def merge_expert_ranks(states: Sequence[Mapping[str, Source]], local_experts: int) -> dict[str, Source]:
    """One state dict from the expert-parallel ranks of one TP rank and stage: rank e's local expert j becomes
    expert ``e * local_experts + j`` (SequentialMLP names), everything else is taken from rank 0 (the router,
    attention and norms are replicated over the expert-parallel ranks)."""
    merged: dict[str, Source] = {}
    for rank, state in enumerate(states):
        for key, value in _grouped_as_local_experts(state, local_experts).items():
            match = _EXPERT_KEY.fullmatch(key)
            if match is None:
                if rank == 0:
                    merged[key] = value
                continue
            prefix, fc = match.group(1), match.group(3) or match.group(4)
            local = int(match.group(2) or match.group(5))
            if local >= local_experts:
                raise CheckpointError(f"{key}: local expert {local} but the args give {local_experts} per rank")
            merged[f"{prefix}local_experts.{rank * local_experts + local}.{fc}.weight"] = value
    return merged


def _grouped_as_local_experts(state: Mapping[str, Source], local_experts: int) -> Mapping[str, Source]:
    """``state`` with a legacy GroupedMLP's ``weight1`` / ``weight2`` as SequentialMLP's per-expert ``linear_fc1``
    ``[2I/tp, H]`` / ``linear_fc2`` ``[H, I/tp]``. Unlike the other layouts, which stay on disk until written, these
    are read into memory when the piece is merged: every grouped expert matrix of the rank file's stage at once (the
    transposed view GroupedMLP's forward takes cannot be streamed as rows)."""
    grouped = {key: match for key in state if (match := _GROUPED_KEY.fullmatch(key))}
    if not grouped:
        return state
    out = {key: value for key, value in state.items() if key not in grouped}
    for key, match in grouped.items():
        prefix, which = match.groups()
        matrix = materialize(state[key])
        hidden = matrix.shape[0] if which == "1" else matrix.shape[1]
        if matrix.numel() % (local_experts * hidden):
            raise CheckpointError(f"{key}: shape {tuple(matrix.shape)} does not hold {local_experts} experts of "
                                  f"hidden size {hidden}")  # fmt: skip
        experts = (matrix.reshape(local_experts, hidden, -1) if which == "1"
                   else matrix.reshape(local_experts, -1, hidden)).transpose(1, 2)  # fmt: skip
        for j in range(local_experts):
            out[f"{prefix}local_experts.{j}.linear_fc{which}.weight"] = experts[j].contiguous()
    return out


def vocab_rows(stage: StageShards, key: str, spec: ModelSpec) -> Source:
    """[Vp, H] merged over TP, trimmed to [V, H]."""
    full = stage.concat(key, 0)
    shape = shape_of(full)
    if shape[0] < spec.vocab_size or shape[1:] != (spec.hidden_size,):
        stage.check(full, (spec.vocab_size, spec.hidden_size), key)
    return rows(full, 0, spec.vocab_size)


class McoreSource(Protocol):
    """An opened Megatron-core checkpoint of either format."""

    @property
    def args(self) -> object: ...

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def iteration_dir(self) -> Path: ...

    def stages(self) -> Iterator[StageShards]:
        """The model's pieces in order, each read only when asked for (the caller drops it before the next)."""
        ...


def _end_of_piece(stage: StageShards, spec: ModelSpec) -> Iterator[tuple[str, Source]]:
    if stage.last:
        yield "model.norm.weight", stage.check(stage.shards(FINAL_NORM)[0], (spec.hidden_size,), FINAL_NORM)
        if not spec.tied_embeddings:
            yield "lm_head.weight", vocab_rows(stage, OUTPUT, spec)
        elif OUTPUT in stage.states[0]:
            stage.used.add(OUTPUT)  # tied + PP > 1: the last stage's copy of the embedding
    unused = stage.unused_keys()
    if unused:
        raise CheckpointError(
            f"{stage.paths[0]} holds tensors rl-ckpt does not convert: {', '.join(unused[:6])}"
            f"{' ...' if len(unused) > 6 else ''} (linear biases, grouped MoE weights in one tensor and other "
            "extras are not supported yet)"
        )


def iter_hf_tensors(ckpt: McoreSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in memory) in order, holding only one piece (PP stage or layer) at a time."""
    for name, src in iter_hf_sources(ckpt):
        tensor = materialize(src)
        del src  # else it keeps the last piece's tensors alive while the next piece is read
        yield name, tensor


def iter_hf_sources(ckpt: McoreSource) -> Iterator[tuple[str, Source]]:
    """Yield (HF name, source: views / concatenations of the checkpoint's tensors) in order, one piece at a time; a
    vision-language model's names as its HF files spell them."""
    spec = ckpt.spec
    for name, source in _text_named_sources(ckpt):
        yield spec.file_name(name), source
        del source  # else it keeps the last piece's tensors alive while the next piece is planned


def _text_named_sources(ckpt: McoreSource) -> Iterator[tuple[str, Source]]:
    spec = ckpt.spec
    offset = 0
    for stage in ckpt.stages():
        if stage.first:
            yield "model.embed_tokens.weight", vocab_rows(stage, EMBEDDING, spec)
            yield from _vision_tower(stage)
        n_local = stage.num_layers()
        for local in range(n_local):
            yield from layer_sources(stage, spec, local, offset + local)
        offset += n_local
        yield from _end_of_piece(stage, spec)
        del stage  # release this piece before the next one is read
    if offset != spec.num_layers:
        raise CheckpointError(f"{ckpt.iteration_dir}: found {offset} layers in all, the args say {spec.num_layers}")


def _vision_tower(stage: StageShards) -> Iterator[tuple[str, Source]]:
    """A vision-language model's vision tower (``vision_model.*``, the same on every TP rank) as ``visual.*``."""
    prefix = f"{VISION_MODULE}."
    for key in [key for key in stage.states[0] if key.startswith(prefix)]:
        yield "visual." + key.removeprefix(prefix), stage.shards(key)[0]


def _config_in(folder: Any) -> dict[str, Any] | None:
    config = Path(folder) / "config.json" if isinstance(folder, (str, Path)) and folder else None
    if config is None or not config.is_file():
        return None
    return dict(json.loads(config.read_text(encoding="utf-8")))


def checkpoint_spec(
    args: object, *, vocab_size: int | None, model_type: str | None, tokenizer_path: Path | str | None
) -> ModelSpec:
    """The model of a checkpoint from its args, completed by the HF config.json of ``tokenizer_path`` or, failing
    that, of the folder the args name as ``tokenizer_model`` (Megatron-LM's HuggingFaceTokenizer path).

    Megatron-LM's args record neither the HF model type nor the unpadded vocabulary size; such a config.json gives
    both, and is written out verbatim (rope scaling, token ids) once its sizes are checked against the args.
    """
    hf_config = arg(args, "hf_config")
    if not isinstance(hf_config, Mapping):
        hf_config = _config_in(tokenizer_path) or _config_in(arg(args, "tokenizer_model"))
    if vocab_size is None and hf_config is None and tokenizer_path is not None and not arg(args, "vocab_size"):
        vocab_size = vocab_size_from_tokenizer(Path(tokenizer_path))
    return spec_from_mcore_args(args, vocab_size, model_type, hf_config)

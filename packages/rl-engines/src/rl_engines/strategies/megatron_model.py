"""A Megatron-core ``GPTModel`` built from a HF folder, loaded with this rank's shards, and its forward pass.

Supported families are rl_ckpt's dense decoders (Qwen2 / Qwen3 / Llama / Mistral: RMSNorm, SwiGLU, RoPE, GQA,
optional QKV bias and qk-norm, tied or untied embeddings) and Qwen3-MoE (every layer a softmax top-k router over
SwiGLU experts, split over ``expert_model_parallel_size`` ranks), built from Megatron's local (non
Transformer-Engine) layer spec; and the language model of Qwen2-VL / Qwen2.5-VL / Qwen3-VL with their vision tower
(:mod:`.megatron_vision`). megatron is imported inside functions only, so this module imports without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rl_ckpt.experts import router_name
from rl_ckpt.hf_io import HFCheckpoint
from rl_ckpt.layout import padded_vocab_size
from rl_ckpt.spec import ModelSpec, language_config, spec_from_hf_config
from rl_core.batch import RolloutBatch
from rl_engines.strategies.megatron_chunks import ModelChunks
from rl_engines.strategies.megatron_config import MegatronOptions, check_moe_options, pipeline_layout_stages
from rl_engines.strategies.megatron_norms import local_block_spec
from rl_engines.strategies.megatron_ops import vocab_parallel_log_probs
from rl_engines.strategies.megatron_pipeline import (
    OnOutput,
    PipelineStage,
    broadcast_from_last,
    create_gradient_groups,
    current_stage,
    run_schedule,
)
from rl_engines.strategies.megatron_vision import (
    InterleavedMRoPE,
    MegatronVision,
    attach_vision,
    check_vl_options,
    mrope,
)
from rl_engines.strategies.megatron_weights import ELSEWHERE, RankLayout, WeightLoader, export_hf, hf_target
from rl_engines.strategies.micro_batches import MicroBatchPlanner, in_batch_order
from rl_engines.strategies.model_io import model_inputs, response_length, widen
from rl_engines.strategies.packing import PackedBatch, block_causal_mask
from rl_engines.strategies.train_utils import gather_batch
from rl_engines.vision import is_vl_config

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
"""Megatron's default vocabulary padding (rows past the tokenizer's vocabulary are masked out of every softmax)."""


def read_spec(model_path: str, role: str) -> ModelSpec:
    """The (language model's) architecture of a HF folder; raises naming ``model_name_or_path`` for what Megatron
    cannot build."""
    config = _read_config(model_path)
    try:
        spec = spec_from_hf_config(config)
        text = language_config(config) if spec.vision else config
    except Exception as err:  # rl_ckpt names the unsupported model_type / option
        raise ValueError(f"{role}.model_args.model_name_or_path={model_path!r}: {err}") from None
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(
            f"{role}.model_args.model_name_or_path={model_path!r} uses rope scaling {rope!r}, which megatron_train / "
            "megatron_infer do not build yet; use fsdp2_train / hf_infer for this model."
        )
    if text.get("use_sliding_window"):
        raise ValueError(f"{role}: sliding-window attention ({model_path}) is not supported by the Megatron adapter.")
    return spec


def _read_config(model_path: str) -> dict[str, Any]:
    return json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def init_model_parallel(options: MegatronOptions, seed: int, role: str) -> None:
    """Megatron's process groups for this layout (reused when already set up with the same sizes) and RNG.

    Megatron's rank order: TP ranks are consecutive, then DP, then PP (world = TP x DP x PP; stage s holds global
    ranks ``[s * TP * DP, (s + 1) * TP * DP)``)."""
    from megatron.core import parallel_state, tensor_parallel

    tp, pp = options.tensor_model_parallel_size, options.pipeline_model_parallel_size
    ep, vp = options.expert_model_parallel_size, options.virtual_pipeline_model_parallel_size
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1)  # fmt: skip
        if have != (tp, pp, ep, vp):
            raise RuntimeError(
                f"{role}: this process already runs Megatron with tensor_model_parallel_size={have[0]}, "
                f"pipeline_model_parallel_size={have[1]}, expert_model_parallel_size={have[2]}, "
                f"virtual_pipeline_model_parallel_size={have[3]}; one process holds one Megatron layout."
            )
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                                                 expert_model_parallel_size=ep)  # fmt: skip
        if pp > 1:
            create_gradient_groups(dist.get_world_size(), pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(
    spec: ModelSpec,
    options: MegatronOptions,
    params_dtype: torch.dtype,
    device: torch.device,
    aux_loss_coef: float = 0.0,
    mrope_section: list[int] | None = None,
) -> Any:
    """Megatron's TransformerConfig for ``spec``: no dropout, no fused CUDA kernels (they need Apex / TE);
    ``mrope_section``: a VL model's multimodal RoPE sections."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=options.tensor_model_parallel_size,
        pipeline_model_parallel_size=options.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_virtual(options),
        account_for_embedding_in_pipeline_split=options.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=options.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=options.pipeline_model_parallel_layout,
        pipeline_dtype=params_dtype,  # of the hidden states sent between stages
        sequence_parallel=options.sequence_parallel,
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        recompute_modules=None if options.recompute_modules is None else list(options.recompute_modules),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=True,  # overwritten by the HF weights, but it also tags TP-split weights
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        mrope_section=mrope_section,
        **_moe_config(spec, options, aux_loss_coef),
    )


def _moe_config(spec: ModelSpec, options: MegatronOptions, aux_loss_coef: float) -> dict[str, Any]:
    """TransformerConfig's MoE settings for a Qwen3-MoE / Qwen2-MoE ``spec``: HF's router (softmax over the
    experts, top-k, renormalised when ``norm_topk_prob``: Megatron's top-k then softmax, else softmax then top-k) in
    fp32, no capacity limit (no token is dropped), Megatron's load-balancing loss (``aux_loss``) at
    ``aux_loss_coef`` (0: none)."""
    if not spec.moe:
        return {}
    return {
        "num_moe_experts": spec.num_experts,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_router_topk": spec.moe_topk,
        "moe_router_pre_softmax": not spec.moe_norm_topk_prob,
        "moe_shared_expert_intermediate_size": spec.moe_shared_expert_ffn_hidden_size or None,
        "moe_shared_expert_gate": spec.moe_shared_expert_ffn_hidden_size > 0,  # Qwen2-MoE: sigmoid(x w) * shared
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if aux_loss_coef else "none",
        "moe_aux_loss_coeff": float(aux_loss_coef),
        "moe_token_dispatcher_type": options.moe_token_dispatcher_type,
        "moe_grouped_gemm": False,
        "moe_layer_recompute": options.moe_layer_recompute,
        "expert_model_parallel_size": options.expert_model_parallel_size,
    }


class ValueHead(nn.Module):
    """The critic's ``score`` head ([1, H] + bias, replicated on every TP rank) in place of GPTModel's output layer."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple[Any, None]:
        """``hidden [S, B, H]`` (sequence-split under SP) -> ``values [S, B, 1]``; GPTModel's output-layer call."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return nn.functional.linear(hidden, self.weight, self.bias), None


def check_local_model(config: Any, options: MegatronOptions, role: str) -> None:
    """The MoE keys against the model when its folder is here already (pre-flight); otherwise once it is loaded.
    A vision-language model refuses what the Megatron strategies do not build for it, naming the key."""
    path = Path(str(config.model_args.model_name_or_path))
    if not (path / "config.json").is_file():
        return
    check_moe_options(options, read_spec(str(path), role), role)
    if is_vl_config(_read_config(str(path))):
        check_vl_options(config, role, str(path))


@dataclass
class MegatronModel:
    """One rank's GPTModel (its pipeline stage's part; :class:`ModelChunks` of them under a virtual pipeline) plus
    what its forward pass and weight mapping need."""

    module: Any
    role: str
    layout: RankLayout
    tp_group: Any
    sequence_parallel: bool
    device: torch.device
    stage: PipelineStage = field(default_factory=PipelineStage)
    mp_group: Any = None
    """The TP x PP group of ranks that hold one model replica together (None when that is this rank alone)."""
    vision: MegatronVision | None = None
    """A vision-language model's vision tower and multimodal positions (:mod:`.megatron_vision`)."""
    loader: WeightLoader = field(init=False)

    def __post_init__(self) -> None:
        self.loader = WeightLoader(self.module, self.layout, self.role)

    @property
    def chunks(self) -> tuple[Any, ...]:
        """The GPTModels that run this stage's forward, chunk 0 first (the module itself without a virtual
        pipeline)."""
        return self.module.chunks if isinstance(self.module, ModelChunks) else (self.module,)

    def takes_input(self, chunk: int) -> bool:
        """``chunk`` takes the previous virtual stage's hidden states (it is not the embedding's)."""
        return not (self.stage.first and chunk == 0)

    def gives_output(self, chunk: int) -> bool:
        """``chunk`` ends the model (final norm and output layer / value head)."""
        return self.stage.last and chunk == len(self.chunks) - 1

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this rank's logits slice."""
        return self.layout.tp_rank * self.layout.padded_vocab // self.layout.tp

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' (and hidden states') dtype."""
        return next(self.module.parameters()).dtype  # type: ignore[no-any-return]

    def _padding(self, length: int) -> int:
        """Right padding of a sequence: under sequence parallelism it must split evenly over the TP ranks."""
        return -length % self.layout.tp if self.sequence_parallel else 0

    def hidden_shape(self, ids: torch.Tensor) -> tuple[int, int, int]:
        """``[S, B, H]`` of the hidden states this stage receives for ``ids [B, S]`` (``S/tp`` rows, after the
        padding, under sequence parallelism)."""
        seq = ids.shape[1] + self._padding(ids.shape[1])
        rows = seq // self.layout.tp if self.sequence_parallel else seq
        return rows, ids.shape[0], self.layout.spec.hidden_size

    def run(self, ids: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor | None = None,
            segments: torch.Tensor | None = None, chunk: int = 0,
            source: RolloutBatch | None = None) -> torch.Tensor:  # fmt: skip
        """``ids [B, S]``, ``mask [B, S]`` (True = real token) -> the last stage's ``[B, S, Vp/tp]`` logits
        (``[B, S, 1]`` values); earlier (virtual) stages return the hidden states ``[S, B, H]`` for the next one,
        and every one but the first takes the previous one's as ``hidden``. ``segments [B, S]`` (packed rows: the
        sample of each token) keeps attention within each sample. ``chunk``: which of this stage's model chunks
        runs (virtual pipeline). ``source``: the batch of ``ids``, whose pictures a VL model sees."""
        length = ids.shape[1]
        extra = self._padding(length)
        positions = self._positions(ids, mask, source)
        ids, mask = nn.functional.pad(ids, (0, extra)), nn.functional.pad(mask, (0, extra))
        seq = ids.shape[1]
        if segments is None:
            segments = torch.zeros_like(ids, device=self.device)  # one sample per row
        else:
            segments = nn.functional.pad(segments.to(self.device), (0, extra), value=-1)
        allowed = block_causal_mask(segments) & mask.unsqueeze(1)
        if positions is None:
            # RoPE is relative, so Megatron's 0..S-1 positions equal HF's left-padding-aware position_ids here, and
            # within each sample of a packed row (attention never leaves it) its own restarting ones.
            positions = torch.arange(seq, device=self.device).expand_as(ids)
        elif extra:  # the sequence-parallel padding counts on
            positions = torch.cat([positions, positions[..., -1:] + torch.arange(1, extra + 1, device=self.device)], -1)
        module = self.chunks[chunk]
        if self.takes_input(chunk):
            module.set_input_tensor(hidden)
        # A MoE layer's router leaves padding out of its load-balancing loss (padding_mask: True = padding).
        routing = {"padding_mask": ~mask} if self.layout.spec.moe else {}
        if self.vision is not None and not self.takes_input(chunk):
            first, deepstack = self.vision.decoder_input(module, ids, source, self.sequence_parallel)
            block: dict[str, Any] = {} if deepstack is None else {"extra_block_kwargs": {"context": deepstack}}
            out = module(ids, positions, ~allowed.unsqueeze(1), decoder_input=first, **block, **routing)
        else:
            out = module(ids, positions, ~allowed.unsqueeze(1), **routing)  # mask [B, 1, S, S], True = masked
        return out[:, :length] if self.gives_output(chunk) else out  # type: ignore[no-any-return]

    def _positions(self, ids: torch.Tensor, mask: torch.Tensor, source: RolloutBatch | None) -> torch.Tensor | None:
        """A VL model's ``[3, B, S]`` multimodal RoPE positions (None for a text model)."""
        if self.vision is None:
            return None
        return self.vision.positions(ids, mask, source, self.device)

    def forward(self, batch: RolloutBatch | PackedBatch, hidden: torch.Tensor | None = None,
                chunk: int = 0) -> torch.Tensor:  # fmt: skip
        """This stage's forward of ``batch`` (through model ``chunk``); the last one returns the outputs at the
        positions that predict the responses: ``[B, R, Vp/tp]`` logits (row t predicts response token t) or
        ``[B, R, 1]`` values; ``[1, N, .]`` for a packed batch's N response tokens (one row, or a row per sample).
        Padding: prompts left, responses right (see model_io)."""
        last = self.gives_output(chunk)
        if isinstance(batch, PackedBatch):
            if self.vision is not None:
                raise ValueError(
                    f"{self.role}.use_sequence_packing: the Megatron strategies do not pack vision-language batches; "
                    "set it to false (fsdp2_train packs them)."
                )
            segments = batch.segments.to(self.device)
            out = self.run(batch.input_ids.to(self.device), batch.real.to(self.device), hidden, segments, chunk)
            return batch.predicting(out).unsqueeze(0) if last else out
        inputs = model_inputs(batch, self.device)
        out = self.run(inputs["input_ids"], inputs["attention_mask"].bool(), hidden, chunk=chunk, source=batch)
        if not last:
            return out
        length, resp = out.shape[1], response_length(batch)
        return out[:, length - resp - 1 : length - 1]

    def export(self, params: dict[str, torch.Tensor], sharded: set[str],
               ep_group: Any = None) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """:func:`export_hf` of this rank's ``params`` (a VL model's under transformers' module names)."""
        weights = export_hf(params, sharded, self.layout, self.tp_group, self.stage, ep_group)
        if self.vision is None:
            yield from weights
            return
        names = self.vision.module_names
        for name, tensor in weights:
            yield names.get(name, name), tensor

    def batch_hidden_shape(self, batch: RolloutBatch | PackedBatch) -> tuple[int, int, int]:
        """:meth:`hidden_shape` of ``batch``'s input ids."""
        return self.hidden_shape(batch.input_ids if isinstance(batch, PackedBatch) else batch.batch["input_ids"])

    def head(self, batch: RolloutBatch | PackedBatch, out: torch.Tensor, *, temperature: float,
             with_entropy: bool) -> dict[str, torch.Tensor]:  # fmt: skip
        """Last stage: ``values`` (value head) or ``log_probs`` (and ``entropy``) of the responses from
        :meth:`forward`'s ``out``, ``[B, R]`` float32."""
        if isinstance(batch, PackedBatch):
            outputs = self._head(out, batch.targets.unsqueeze(0), temperature, with_entropy)
            return {key: batch.scatter(value[0]) for key, value in outputs.items()}
        return self._head(out, batch.batch["responses"], temperature, with_entropy)

    def _head(self, out: torch.Tensor, targets: torch.Tensor, temperature: float,
              with_entropy: bool) -> dict[str, torch.Tensor]:  # fmt: skip
        if self.layout.value_head:
            return {"values": out[..., 0].float()}
        log_probs, entropy = vocab_parallel_log_probs(
            out, targets.to(self.device), vocab_start=self.vocab_start, vocab_size=self.layout.spec.vocab_size,
            temperature=temperature, with_entropy=with_entropy, group=self.tp_group,
        )  # fmt: skip
        return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}

    def schedule(self, micros: Sequence[RolloutBatch | PackedBatch], on_output: OnOutput, *, train: bool) -> None:
        """:func:`run_schedule` of ``micros`` through this model's pipeline (every TP x PP rank calls it)."""
        run_schedule(self.stage, micros, self.forward, hidden_shape=self.batch_hidden_shape, dtype=self.dtype,
                     device=self.device, on_output=on_output, train=train)  # fmt: skip

    @property
    def counted(self) -> bool:
        """This rank's samples are its own: the first rank of its model-parallel group (whose ranks pool them)."""
        return self.mp_group is None or dist.get_rank(self.mp_group) == 0

    @torch.no_grad()
    def score(self, batch: RolloutBatch, planner: MicroBatchPlanner, name: str, *, temperature: float,
              with_entropy: bool) -> RolloutBatch:  # fmt: skip
        """``values`` or ``log_probs`` (and ``entropy``) ``[B, R]`` of this rank's ``batch``: the model-parallel
        ranks pool their batches, run them through the pipeline in the ``planner``'s micro-batches (each rank plans
        the same pooled batch alike), the last stage's results are broadcast to the others, and every rank returns
        its own rows (on the CPU); ``meta_info["metrics"]``: ROLL's dynamic-batching counts of the pass ``name``."""
        pooled, own = gather_batch(batch, self.mp_group)
        plan = planner.plan(pooled)
        parts: list[dict[str, torch.Tensor]] = []
        width = response_length(pooled)

        def on_output(index: int, run: RolloutBatch, out: torch.Tensor) -> None:
            parts.append(widen(self.head(run, out, temperature=temperature, with_entropy=with_entropy), width))

        self.schedule(planner.runs([pooled.index(indices) for indices in plan]), on_output, train=False)
        keys = ["values"] if self.layout.value_head else ["log_probs", "entropy"][: 1 + with_entropy]
        shape = (len(pooled), width)
        if self.stage.last:
            ordered = in_batch_order(parts, plan)
            tensors = {key: ordered[key].to(self.device) for key in keys}
        else:
            tensors = {key: torch.empty(shape, dtype=torch.float32, device=self.device) for key in keys}
        tensors = broadcast_from_last(self.stage, tensors)
        metrics = planner.dynamic_batching_metrics(name, counted=self.counted)
        return RolloutBatch({key: value[own].cpu() for key, value in tensors.items()},
                            meta_info={**batch.meta_info, "metrics": metrics})  # fmt: skip


def _check_divisors(spec: ModelSpec, options: MegatronOptions, role: str, model_path: str) -> None:
    """TP must divide the heads, KV groups and FFN sizes (a MoE model's experts and shared expert are split over the
    TP ranks too), PP the layers; errors name the key and the model's field."""
    prefix = f"{role}.strategy_args.strategy_config"
    tp, pp = options.tensor_model_parallel_size, options.pipeline_model_parallel_size
    sizes = [("num_attention_heads", spec.num_attention_heads), ("num_key_value_heads", spec.num_query_groups),
             ("intermediate_size", spec.ffn_hidden_size)]  # fmt: skip
    if spec.moe:
        sizes += [("moe_intermediate_size", spec.moe_ffn_hidden_size),
                  ("shared_expert_intermediate_size", spec.moe_shared_expert_ffn_hidden_size)]  # fmt: skip
    for key, value in sizes:
        if value % tp:
            raise ValueError(
                f"{prefix}.tensor_model_parallel_size={tp} does not divide the model's {key}={value} "
                f"({model_path}/config.json); Megatron splits them over TP ranks. Pick a divisor."
            )
    if options.pipeline_model_parallel_layout is not None:
        _check_layout(spec, options, prefix, model_path)
        return
    extra = [key for key in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
             if getattr(options, key)]  # fmt: skip
    counted = spec.num_layers + len(extra)  # the embedding / the loss each count as a layer in the split
    what = f"num_hidden_layers={spec.num_layers}" + "".join(f" + 1 ({prefix}.{key})" for key in extra)
    if counted % pp:
        raise ValueError(
            f"{prefix}.pipeline_model_parallel_size={pp} does not divide the model's {what} "
            f"({model_path}/config.json); the stages get equal numbers of (counted) layers. Pick a divisor."
        )
    vp = options.virtual_pipeline_model_parallel_size
    if counted % (pp * vp):
        raise ValueError(
            f"{prefix}.pipeline_model_parallel_size={pp} x {prefix}.virtual_pipeline_model_parallel_size={vp} does not "
            f"divide the model's {what} ({model_path}/config.json); every model chunk gets the same number of "
            "(counted) layers. Pick divisors."
        )


def _check_layout(spec: ModelSpec, options: MegatronOptions, prefix: str, model_path: str) -> None:
    """``pipeline_model_parallel_layout`` places as many decoder layers as the model has."""
    layout = str(options.pipeline_model_parallel_layout)
    placed = "".join(pipeline_layout_stages(layout, f"{prefix}.pipeline_model_parallel_layout")).count("t")
    if placed != spec.num_layers:
        raise ValueError(
            f"{prefix}.pipeline_model_parallel_layout={layout!r} places {placed} decoder layers ('t'); the model has "
            f"num_hidden_layers={spec.num_layers} ({model_path}/config.json). Place each layer once."
        )


def _virtual(options: MegatronOptions) -> int | None:
    """Megatron's ``virtual_pipeline_model_parallel_size`` (None: no virtual pipeline)."""
    vp = options.virtual_pipeline_model_parallel_size
    return vp if vp > 1 else None


def _stage_offsets(config: Any, pp: int, vp: int, layout: str | None = None) -> tuple[int, ...]:
    """Each virtual stage's first layer (Megatron's ``get_transformer_layer_offset``; chunk c of stage s is virtual
    stage ``c * pp + s``), then the number of layers. With a ``pipeline_model_parallel_layout`` they are counted
    from its stages, which lie in that order (megatron-core's offset reads the calling rank's stage, whatever
    ``pp_rank`` it is given)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if layout is not None:
        counts = [stage.count("t") for stage in pipeline_layout_stages(layout, "pipeline_model_parallel_layout")]
        return tuple(sum(counts[:k]) for k in range(len(counts) + 1))

    offsets = (get_transformer_layer_offset(config, vp_stage=k // pp if vp > 1 else None, pp_rank=k % pp)
               for k in range(pp * vp))  # fmt: skip
    return (*(int(offset) for offset in offsets), config.num_layers)


def build_model(
    model_path: str,
    options: MegatronOptions,
    *,
    role: str,
    params_dtype: torch.dtype,
    device: torch.device,
    value_head: bool,
    seed: int,
    aux_loss_coef: float = 0.0,
) -> MegatronModel:
    """This rank's GPTModel stage in ``params_dtype`` (also the compute dtype) with the HF folder's weights; a
    critic gets a fresh ``score`` head (HF's init).

    Under pipeline parallelism Megatron keeps tied embeddings as two parameters (the first stage's embedding, the
    last stage's output layer) whose gradients are summed; GPTModel's own set-up of that copy moves it to CUDA, so
    the stages are built untied and the copy is loaded from the same HF tensor (megatron_weights) and its gradient
    summed by the train strategy."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = read_spec(model_path, role)
    check_moe_options(options, spec, role)
    _check_divisors(spec, options, role, model_path)
    tp, pp = options.tensor_model_parallel_size, options.pipeline_model_parallel_size
    vp = options.virtual_pipeline_model_parallel_size
    stage = current_stage(vp)
    padded = padded_vocab_size(spec.vocab_size, MAKE_VOCAB_SIZE_DIVISIBLE_BY, tp)
    hf_config = _read_config(model_path)
    section, interleaved = mrope(hf_config) if is_vl_config(hf_config) else (None, False)
    config = transformer_config(spec, options, params_dtype, device, aux_loss_coef, section)
    experts = {"num_experts": spec.num_experts, "moe_grouped_gemm": False} if spec.moe else {}
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm, **experts)
    chunks = [
        GPTModel(
            config,
            local_block_spec(config, layer_spec, chunk if vp > 1 else None),
            vocab_size=padded,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=stage.first and chunk == 0,
            post_process=stage.last and chunk == vp - 1,
            share_embeddings_and_output_weights=spec.tied_embeddings and not value_head and pp == 1,
            position_embedding_type="rope" if section is None else "mrope",
            rotary_base=int(spec.rotary_base),
            vp_stage=chunk if vp > 1 else None,
        )
        for chunk in range(vp)
    ]
    vision = None
    if section is not None:
        vision = attach_vision(chunks, model_path, stage.first, params_dtype, device, role, value_head, options)
        if interleaved:
            for chunk_model in chunks:
                chunk_model.rotary_pos_emb = InterleavedMRoPE(spec.head_dim, spec.rotary_base, section)
    if value_head and stage.last:
        chunks[-1].output_layer = ValueHead(spec.hidden_size, options.sequence_parallel, params_dtype)
    module = chunks[0] if vp == 1 else ModelChunks(chunks)
    module.to(device)
    offsets = _stage_offsets(config, pp, vp, options.pipeline_model_parallel_layout)
    layout = RankLayout(spec, parallel_state.get_tensor_model_parallel_rank(), tp, padded, value_head,
                        stage.rank, pp, offsets, parallel_state.get_expert_model_parallel_rank(),
                        options.expert_model_parallel_size, vp,
                        tuple(vision.shapes.items()) if vision is not None else ())  # fmt: skip
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    mp_group = parallel_state.get_model_parallel_group() if tp * pp > 1 else None
    model = MegatronModel(module, role, layout, group, options.sequence_parallel, device, stage, mp_group, vision)
    load_folder(model, model_path, seed)
    return model


def load_folder(model: MegatronModel, model_path: str, seed: int) -> None:
    """Load this rank's tensors of the HF folder; initialise a missing value head like HF does."""
    source = HFCheckpoint(Path(model_path))
    hf_config = source.config
    if model.layout.value_head and model.stage.last:
        generator = torch.Generator().manual_seed(seed)  # the same head on every TP rank
        head = model.module.output_layer
        std = float(hf_config.get("initializer_range", 0.02))
        head.weight.data.copy_(torch.randn(head.weight.shape, generator=generator) * std)
        head.bias.data.zero_()
        model.loader.written.update({"output_layer.weight", "output_layer.bias"})
    names = [name for name in source.weight_map if name != "lm_head.weight" or not model.layout.value_head]
    model.loader.load((name, source.get(name)) for name in names if _on_stage(model.layout, name))
    missing = model.loader.missing()
    if missing:
        raise ValueError(f"{model_path}: the folder lacks tensors for the Megatron parameters {missing}")
    if dist.is_initialized() and model.mp_group is not None:
        dist.barrier(group=model.mp_group)


def _on_stage(layout: RankLayout, name: str) -> bool:
    """Whether HF tensor ``name`` has a home on this stage (others are not read from disk)."""
    target = hf_target(layout, router_name(name))  # a stacked expert tensor: on its layer's stage, every EP rank
    return target is None or target.kind != ELSEWHERE

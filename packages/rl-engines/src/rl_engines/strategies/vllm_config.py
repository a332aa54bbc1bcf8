"""``strategy_config`` of the ``vllm`` strategy (ROLL's vLLM keys) and the vLLM process environment.

Imports no vLLM: the adapter builds ``vllm.LLM(**engine_kwargs(...))`` after :func:`configure_vllm_env` has set
the variables vLLM reads when it is first imported.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

from rl_engines.config import WorkerConfig, WorkerConfigError, build_dataclass

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
CPU_KV_CACHE_BYTES = 256 << 20
"""KV cache of a CPU engine when ``kv_cache_memory_bytes`` is unset (the CPU backend would otherwise reserve
``gpu_memory_utilization`` of the host's memory). vLLM books every 16-token block in Python, so a cache far
larger than the work slows each step; 256 MiB holds ~20k tokens of a 0.5B model in bf16."""


@dataclass
class VllmStrategyConfig:
    """Keys of ``<role>.strategy_args.strategy_config`` for ``strategy_name: vllm`` (all optional)."""

    gpu_memory_utilization: float = 0.9
    """Fraction of device memory for weights, activations and KV cache (ROLL's examples use 0.6 when colocated)."""
    block_size: int | None = None
    """Tokens per KV-cache block; null lets vLLM pick the platform's default."""
    max_model_len: int | None = None
    """Context length (prompt + response); null derives it from the model config."""
    load_format: str = "auto"
    """``auto`` / ``safetensors`` / ``pt`` read the checkpoint; ``dummy`` starts from random weights that the first
    weight sync replaces (ROLL's choice for actor_infer: the train role loads the checkpoint anyway)."""
    enforce_eager: bool | None = None
    """No torch.compile / CUDA graphs. Null: true on CPU (compiling costs ~25 s per engine, buys little there),
    false on GPU."""
    optimization_level: int | None = None
    """vLLM's ``-O`` level, 0-3: how much it compiles and captures (0 nothing ... 3 most); null = vLLM's default.
    With ``enforce_eager`` (the default on CPU) nothing is compiled at any level."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the n samples of a prompt); reset after every weight sync."""
    max_num_seqs: int | None = None
    """Sequences per engine step; null = vLLM's default."""
    max_num_batched_tokens: int | None = None
    """Tokens per engine step; null = vLLM's default."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache size in bytes; null = 256 MiB on CPU, derived from gpu_memory_utilization on GPU."""
    sleep_level: int = 1
    """What ``offload`` frees on GPU: 1 moves weights to host memory, 2 discards them (the next weight sync must
    bring every weight back). Sleep is a no-op on CPU."""
    tensor_parallel_size: int | None = None
    """ROLL passes it to vLLM: one engine over this many devices. Here it is the worker's ``num_gpus_per_worker``;
    given, it must equal it."""
    disable_log_stats: bool = True
    """vLLM's periodic throughput log lines off (vllm.LLM's own default)."""
    disable_custom_all_reduce: bool = True
    """vLLM's custom all-reduce kernel off for tensor parallel engines (ROLL's default: it can hang with TP > 1)."""
    limit_mm_per_prompt: dict[str, int] | None = None
    """Most items of each modality in one prompt (``{image: 10}``: ROLL's VL agentic configs allow one picture per
    turn), which ROLL passes to vLLM for a multimodal model. The vLLM adapter here refuses vision-language models (it
    would drop the pictures) and vLLM rejects the key on a text model, so it is checked and not passed (logged)."""
    disable_mm_preprocessor_cache: bool = False
    """vLLM's cache of multimodal processor outputs off (ROLL's video config: each video is seen once, the cache
    would only hold memory; vLLM >= 0.13 spells it ``mm_processor_cache_gb: 0``). A text model has no multimodal
    processor and vLLM rejects the key on one; the adapter here serves text models, so it is not passed (logged)."""
    cudagraph_capture_sizes: list[int] | None = None
    """Decode batch sizes vLLM captures a CUDA graph for (ROLL's Qwen3.5 files), passed to vLLM as its
    ``compilation_config.cudagraph_capture_sizes`` on a GPU engine that is not eager; null = vLLM's sizes. A CPU
    engine captures no CUDA graphs: it is checked and logged there."""
    cuda_graph_sizes: list[int] | None = None
    """vLLM 0.10's name for them (ROLL's Qwen3-235B file), with its meaning: several values are the sizes; one value
    ``N`` stands for ``[1, 2, 4]`` and the multiples of 8 up to ``N``. Give one of the two keys."""
    cache_dir: str | None = None
    """Where vLLM and torch inductor keep caches, compile artifacts and IPC sockets; null = a per-user folder in
    the system temp dir, shared by runs so later engines start warm."""

    def validate(self, prefix: str) -> None:
        """Raise :class:`WorkerConfigError` naming ``<prefix>.<key>`` for the first bad value."""
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise WorkerConfigError(
                f"{prefix}.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise WorkerConfigError(f"{prefix}.{name} must be >= 1 or null, got {value}.")
        if self.load_format not in LOAD_FORMATS:
            raise WorkerConfigError(f"{prefix}.load_format={self.load_format!r}; use one of {list(LOAD_FORMATS)}.")
        if self.optimization_level is not None and self.optimization_level not in range(4):
            raise WorkerConfigError(f"{prefix}.optimization_level must be 0, 1, 2 or 3, got {self.optimization_level}.")
        if self.sleep_level not in (1, 2):
            raise WorkerConfigError(f"{prefix}.sleep_level must be 1 or 2, got {self.sleep_level}.")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if len(sizes) == 1 and isinstance(sizes[0], int):  # vLLM 0.10: one value is the largest size
                sizes = [size for size in (1, 2, 4, *range(8, sizes[0] + 1, 8)) if size <= sizes[0]]
            given = self.cudagraph_capture_sizes
            if given is not None and set(given) != set(sizes):
                raise WorkerConfigError(
                    f"{prefix}.cuda_graph_sizes and {prefix}.cudagraph_capture_sizes are two names of vLLM's "
                    "CUDA-graph batch sizes and disagree; keep one."
                )
            self.cudagraph_capture_sizes = sizes
        if any(not isinstance(size, int) or isinstance(size, bool) or size < 1
               for size in self.cudagraph_capture_sizes or ()):  # fmt: skip
            raise WorkerConfigError(
                f"{prefix}.cudagraph_capture_sizes must be batch sizes >= 1, got {self.cudagraph_capture_sizes!r}."
            )
        for modality, count in (self.limit_mm_per_prompt or {}).items():
            if not isinstance(count, int) or count < 0:
                raise WorkerConfigError(f"{prefix}.limit_mm_per_prompt.{modality} must be an int >= 0, got {count!r}.")


def parse_vllm_config(config: WorkerConfig, role: str) -> VllmStrategyConfig:
    """The validated ``strategy_config`` of ``role``; errors name ``<role>.strategy_args.strategy_config.<key>``."""
    prefix = f"{role}.strategy_args.strategy_config"
    parsed = build_dataclass(VllmStrategyConfig, config.strategy_args.strategy_config, prefix)
    parsed.validate(prefix)
    tp = parsed.tensor_parallel_size
    if tp is not None and tp != config.num_gpus_per_worker:
        raise WorkerConfigError(
            f"{prefix}.tensor_parallel_size={tp} but {role}.num_gpus_per_worker={config.num_gpus_per_worker}: each "
            f"{role} worker runs one vLLM engine over its own devices; set num_gpus_per_worker: {tp} (and a "
            "device_mapping that it divides) or drop tensor_parallel_size."
        )
    return parsed


def default_cache_dir() -> str:
    """``<system temp dir>/rl_engines_vllm-<uid>``: outside the checkout and the home directory."""
    return os.path.join(tempfile.gettempdir(), f"rl_engines_vllm-{os.getuid()}")


def configure_vllm_env(cache_dir: str) -> None:
    """Set what vLLM reads from the environment, before it is imported (user-set values win, except one).

    The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the adapter reaches its worker
    directly to reload weights and rescale logits, and a worker process of its own would double memory. Caches,
    compile artifacts and IPC sockets go under ``cache_dir``; usage statistics are off.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    defaults = {
        "VLLM_CACHE_ROOT": os.path.join(cache_dir, "vllm"),
        "VLLM_CONFIG_ROOT": os.path.join(cache_dir, "config"),
        "VLLM_RPC_BASE_PATH": os.path.join(cache_dir, "rpc"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)


def engine_kwargs(config: WorkerConfig, options: VllmStrategyConfig, *, on_cpu: bool, seed: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for this role."""
    kwargs: dict[str, Any] = {
        "model": config.model_args.model_name_or_path,
        "dtype": VLLM_DTYPES[config.model_args.dtype],
        "seed": seed,
        "tensor_parallel_size": config.num_gpus_per_worker,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "load_format": options.load_format,
        "enforce_eager": on_cpu if options.enforce_eager is None else options.enforce_eager,
        "enable_prefix_caching": options.enable_prefix_caching,
        "enable_sleep_mode": not on_cpu,
        "kv_cache_memory_bytes": options.kv_cache_memory_bytes or (CPU_KV_CACHE_BYTES if on_cpu else None),
        "disable_log_stats": options.disable_log_stats,
        "disable_custom_all_reduce": options.disable_custom_all_reduce,
    }
    optional = ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "optimization_level")
    kwargs.update({name: getattr(options, name) for name in optional if getattr(options, name) is not None})
    if options.cudagraph_capture_sizes and not kwargs["enforce_eager"] and not on_cpu:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sorted(set(options.cudagraph_capture_sizes))}
    return {key: value for key, value in kwargs.items() if value is not None}

"""The strategy registry (``strategy_args.strategy_name``) and what every strategy shares.

A strategy runs one role's model inside one worker process: a *train* strategy (actor_train, critic) owns
parameters, optimizer and checkpoints; an *infer* strategy (actor_infer, reference) generates and scores. Both
kinds expose the same small surface, checked by the contract suites ``tests/rl_engines/test_engines_contract_*.py``.
"""

from __future__ import annotations

import datetime
import importlib
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rl_core.batch import RolloutBatch
from rl_core.registry import Registry
from rl_engines.config import GeneratingArgs, WorkerConfig
from rl_engines.objectives import Objective


class Strategy(Protocol):
    """Surface shared by train and infer strategies."""

    kind: str
    """``"train"`` or ``"infer"``."""

    def initialize(self) -> None:
        """Load the model (and optimizer); called once, after torch.distributed is set up."""

    def compute_log_probs(
        self, batch: RolloutBatch, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> RolloutBatch:
        """``log_probs [B, R]`` (and ``entropy``) of the batch's responses, without gradients."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under HF names; a collective on train strategies: every rank iterates."""
        ...

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Copy named weights into the model; returns how many tensors were loaded."""
        ...

    def offload(self) -> None:
        """Move weights (and optimizer state) to host memory so a colocated role can use the device."""

    def reload(self) -> None:
        """Bring what :meth:`offload` moved back onto the device."""


class TrainStrategy(Strategy, Protocol):
    """A strategy that trains."""

    def compute_values(self, batch: RolloutBatch) -> RolloutBatch:
        """Critic ``values [B, R]`` (value-head models only)."""
        ...

    def train_step(self, batch: RolloutBatch, objective: Objective) -> dict[str, float]:
        """Optimizer steps over this rank's shard of a rollout batch; metrics reduced over DP ranks."""
        ...

    def save_checkpoint(self, path: str) -> None:
        """Atomically write model, optimizer, scheduler and RNG state (a collective)."""

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""

    def save_hf(self, path: str) -> None:
        """Write a HuggingFace model folder (safetensors + config + tokenizer) on rank 0."""


class InferStrategy(Strategy, Protocol):
    """A strategy that generates."""

    def generate(self, batch: RolloutBatch, generating_args: GeneratingArgs | None = None) -> RolloutBatch:
        """Sample responses for the batch's prompts."""
        ...


StrategyClass = Any  # a class taking (config: WorkerConfig, role: str) and implementing a Strategy protocol
STRATEGIES: Registry[StrategyClass] = Registry("strategy", "strategy_args.strategy_name")
BUILT_IN_STRATEGIES = {
    "fsdp2_train": "fsdp2",
    "fsdp2_infer": "fsdp2_infer",
    "hf_infer": "hf_infer",
    "deepspeed_train": "deepspeed_train",
    "megatron_train": "megatron_train",
    "megatron_infer": "megatron_infer",
    "vllm": "vllm_infer",
    "sglang": "sglang_infer",
}
"""Built-in strategy name -> its module under ``rl_engines.strategies``, imported (and so registered) on first use:
a worker process imports only the strategy it runs (an inference worker never loads torch's distributed
checkpointing, DeepSpeed's state code or Megatron's)."""


def registered_strategies() -> Registry[StrategyClass]:
    """The registry with every built-in strategy imported (what ``rl_engines.strategies.STRATEGIES`` returns)."""
    for name in BUILT_IN_STRATEGIES:
        _import_built_in(name)
    return STRATEGIES


def _import_built_in(name: str) -> None:
    if name in BUILT_IN_STRATEGIES and name not in STRATEGIES:
        importlib.import_module(f"rl_engines.strategies.{BUILT_IN_STRATEGIES[name]}")


def create_strategy(config: WorkerConfig, role: str) -> Any:
    """Instantiate the strategy ``config.strategy_args.strategy_name`` for ``role`` (not yet initialised)."""
    name = config.strategy_args.strategy_name
    _import_built_in(name)
    if name not in STRATEGIES:
        raise ValueError(
            f"{role}.strategy_args.strategy_name={name!r} is not a registered strategy; valid names: "
            f"{registered_strategies().names()}."
        )
    return STRATEGIES.get(name)(config, role)


def reject_unknown_keys(config: dict[str, Any], known: set[str], prefix: str) -> None:
    """Raise naming ``<prefix>.<key>`` for every key of a strategy_config the strategy does not read."""
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(
            f"unknown key(s) {[f'{prefix}.{k}' for k in unknown]}; this strategy reads {sorted(known)}. "
            "Remove them or pick the strategy they belong to."
        )


def worker_device() -> torch.device:
    """``cuda`` (the first visible GPU, which the placement made this worker's) when available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ensure_process_group(timeout_s: float = 1800.0) -> None:
    """Make sure torch.distributed is initialised; a lone process gets a world of one (gloo, in-memory store).

    Workers started by a WorkerGroup initialise the real group first (gloo on CPU, nccl on GPU); this only
    covers in-process use such as notebooks and single-process tests.
    """
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        raise RuntimeError(
            "WORLD_SIZE > 1 but torch.distributed is not initialised; call init_process_group() in the worker "
            "before initialising a strategy."
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = dist.HashStore()  # type: ignore[attr-defined]
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


def require_engine_package(module: str, strategy: str, extra: str) -> None:
    """Fail early, naming the install command, when ``strategy``'s engine ``module`` is not importable."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"strategy_name={strategy} needs the {module} package, which is not installed in this worker's "
            f"environment: pip install 'rl-engines[{extra}]' (see docs/engines.md), or pick another strategy_name."
        )

"""The Ray actor that runs one rank of a role: it owns a strategy and exposes what the pipeline calls.

Every role (actor_train, actor_infer, reference, critic) uses this one class; the strategy chosen by
``strategy_args.strategy_name`` decides what the methods do. Train metrics come back with ROLL's prefixes
(``actor/pg_loss``, ``critic/value_loss``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs, WorkerConfig
from rl_engines.objectives import Objective
from rl_engines.profiling import profile_call
from rl_engines.shared_processes import GuestContext, HostedRole
from rl_engines.strategies.base import create_strategy
from rl_engines.strategies.model_io import in_checkpoint_names
from rl_engines.weight_sync import (
    BroadcastGroup,
    SharedStaging,
    SharedStagingReader,
    TensorMeta,
    expand_aliases,
    load_in_process,
    receive_by_broadcast,
    send_by_broadcast,
    send_on_host,
    shared_memory_available,
    unpack_from_store,
)
from rl_engines.worker_group import WorkerBase, rank_variables

METRIC_PREFIX = {"actor_train": "actor", "critic": "critic"}
ROLE_NAMED_METRICS = frozenset({"load_balancing_loss"})
"""Metrics ROLL logs under the worker's own name (Megatron's router losses: ``actor_train/load_balancing_loss``)."""
SYNC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, then back as it was.

    A worker's start imports its engine (transformers, megatron-core, ...) and builds its model: a few hundred
    thousand objects that all live as long as the process. With the collector on, each of its passes walks them
    again; measured on a 2-core CPU machine, a worker's start is about 15% faster without them. Garbage with cycles
    made meanwhile waits for the next pass after the block, which the block's allocations bring soon.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class RoleWorker(WorkerBase):
    """One rank of a role; create through ``WorkerGroup(role, RoleWorker, ..., init_args=(config, guests))``.

    ``guests`` (role -> :class:`~rl_engines.shared_processes.HostedRole`): ranks of other roles this worker hosts.
    """

    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        env: dict[str, str],
        config: WorkerConfig,
        guests: Mapping[str, HostedRole] | None = None,
    ) -> None:
        super().__init__(role, rank, world_size, master_addr, master_port, env)
        self.config = config
        self.strategy: Any = None
        self._broadcast: BroadcastGroup | None = None
        self._staging: SharedStaging | None = None
        self._reader: SharedStagingReader | None = None
        for name, hosted in (guests or {}).items():  # same devices and system_envs (plan_sharing's rules)
            if rank in hosted.ranks:
                variables = rank_variables(hosted.ranks[rank], hosted.world_size, master_addr, master_port)
                context = GuestContext(variables)
                with context.active():  # the guest's WorkerBase sets its rank variables; the host keeps its own
                    worker = RoleWorker(name, hosted.ranks[rank], hosted.world_size, master_addr, master_port, env,
                                        hosted.config)  # fmt: skip
                self.guests[name] = (worker, context)

    def initialize(self, collective_timeout_s: float | None = None) -> str:
        """Join the role's process group (unless its strategy needs none: ``shares_process``), build and load the
        strategy; returns the device it runs on."""
        with collector_paused():  # the engine's imports and the model: objects that live as long as the worker
            strategy = create_strategy(self.config, self.role)  # parses the config; the engine loads in initialize
            if not getattr(strategy, "shares_process", False):
                self.init_process_group(timeout_s=collective_timeout_s)
            torch.manual_seed(self.config.training_args.seed)
            self.strategy = strategy
            self.strategy.initialize()
        return str(self.strategy.device)

    # ---- compute -------------------------------------------------------------------------------------------
    @profile_call
    def generate(self, batch: RolloutBatch, generating_args: GeneratingArgs | None = None) -> RolloutBatch:
        """Sample responses (infer strategies)."""
        return self.strategy.generate(batch, generating_args)  # type: ignore[no-any-return]

    @profile_call
    def compute_log_probs(
        self, batch: RolloutBatch, temperature: float = 1.0, with_entropy: bool = False, disable_adapter: bool = False
    ) -> RolloutBatch:
        """Log-probs (and entropy) of the batch's responses; ``disable_adapter``: under a LoRA model's base alone
        (the reference policy)."""
        extra = {"disable_adapter": True} if disable_adapter else {}  # only LoRA-capable strategies take it
        return self.strategy.compute_log_probs(  # type: ignore[no-any-return]
            batch, temperature=temperature, with_entropy=with_entropy, **extra
        )

    @profile_call
    def compute_values(self, batch: RolloutBatch) -> RolloutBatch:
        """Critic values."""
        return self.strategy.compute_values(batch)  # type: ignore[no-any-return]

    @profile_call
    def train_step(self, batch: RolloutBatch, objective: Objective) -> dict[str, float]:
        """Train on this rank's shard; metrics prefixed ``actor/`` or ``critic/`` (the router's with the role name;
        names already namespaced, such as verl's ``rollout_corr/...`` from the bypass-mode loss, as they are)."""
        metrics = self.strategy.train_step(batch, objective)
        prefix = METRIC_PREFIX.get(self.role, self.role)
        return {name if "/" in name else f"{self.role if name in ROLE_NAMED_METRICS else prefix}/{name}": value
                for name, value in metrics.items()}  # fmt: skip

    # ---- state ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Atomic checkpoint (collective over the role)."""
        self.strategy.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint."""
        self.strategy.load_checkpoint(path)

    def save_hf(self, path: str) -> None:
        """HuggingFace folder of the current weights (rank 0 writes)."""
        self.strategy.save_hf(path)

    def offload(self) -> None:
        """Free the device for a colocated role."""
        self.strategy.offload()

    def reload(self) -> None:
        """Take the device back."""
        self.strategy.reload()

    def needs_every_weight(self) -> bool:
        """Whether every weight sync into this inference worker must carry every tensor, frozen ones too: unless its
        engine loads any subset of tensors (``loads_any_subset``: engines that fuse or reload by layer need a
        layer's tensors together) and keeps its weights while offloaded (vLLM ``sleep_level: 2`` drops them)."""
        discards = getattr(self.strategy, "discards_weights", None)
        return not getattr(self.strategy, "loads_any_subset", False) or (discards is not None and bool(discards()))

    # ---- weight sync: sender side (train roles) ------------------------------------------------------------
    def _sync_dtype(self, dtype: str | None) -> torch.dtype | None:
        return None if dtype is None else SYNC_DTYPES[dtype]

    def send_weights_on_host(
        self,
        shm_receivers: list[Any],
        store_receivers: list[Any],
        bucket_bytes: int,
        dtype: str | None = None,
        timeout_s: float | None = None,
        names: str = "module",
        guest: str | None = None,
        frozen: bool = True,
    ) -> dict[str, float]:
        """Colocated sync: every rank un-shards; rank 0 sends each bucket through shared memory to receivers on
        its host (falling back to the object store where /dev/shm is missing) and through the object store to
        the rest; a rank hosting a rank of the inference role ``guest`` loads it in process. ``names``: see
        :func:`_weights_to_send`."""
        weights = self._weights_to_send(names, frozen)
        local = self._guest_loader(guest)
        if local is not None and (self.rank != 0 or not (shm_receivers or store_receivers)):
            return load_in_process(weights, local, bucket_bytes=bucket_bytes, dtype=self._sync_dtype(dtype)).metrics()
        if self.rank != 0:
            for _ in weights:  # take part in each all-gather
                pass
            return {}
        if not shared_memory_available():
            shm_receivers, store_receivers = [], [*shm_receivers, *store_receivers]
        if shm_receivers and (self._staging is None or self._staging.slot_bytes != bucket_bytes):
            self.close_staging()
            self._staging = SharedStaging(bucket_bytes)
        stats = send_on_host(
            weights, staging=self._staging, shm_receivers=shm_receivers, store_receivers=store_receivers,
            bucket_bytes=bucket_bytes, dtype=self._sync_dtype(dtype), timeout_s=timeout_s, load=local,
        )  # fmt: skip
        return stats.metrics()

    def _guest_loader(self, guest: str | None) -> Callable[[Iterable[tuple[str, torch.Tensor]]], int] | None:
        """``load_weights`` of the rank of ``guest`` this worker hosts (None: it hosts none)."""
        if guest is None or guest not in self.guests:
            return None
        worker = self.guests[guest][0]
        if not isinstance(worker, RoleWorker):
            raise TypeError(f"{self.role} rank {self.rank}: the hosted {guest!r} is not a role worker")
        return worker.strategy.load_weights  # type: ignore[no-any-return]

    def _weights_to_send(self, names: str, frozen: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return weights_to_send(self.strategy, names, frozen)

    def close_staging(self) -> None:
        """Unlink the shared-memory slots of colocated syncs (also done by Python's resource tracker at exit)."""
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def reserve_port(self) -> tuple[str, int]:
        """This node's ip and a free port on it (where the weight-sync group's store listens)."""
        return self.node_ip(), self.free_port()

    def join_broadcast_group(self, master_addr: str, master_port: int, rank: int, world_size: int,
                             timeout_s: float) -> None:  # fmt: skip
        """Join the weight-sync group (train rank 0 is its rank 0; inference workers follow)."""
        self._broadcast = BroadcastGroup(master_addr, master_port, rank, world_size, timeout_s)

    def send_weights_by_broadcast(
        self, bucket_bytes: int, dtype: str | None = None, names: str = "module", frozen: bool = True
    ) -> dict[str, float]:
        """Separate sync, sender side: every rank un-shards, rank 0 broadcasts each bucket (``frozen``: see
        :meth:`_weights_to_send`)."""
        weights = self._weights_to_send(names, frozen)
        if self.rank != 0:
            for _ in weights:
                pass
            return {}
        if self._broadcast is None:
            raise RuntimeError(f"{self.role} rank 0 has not joined the weight-sync group")
        stats = send_by_broadcast(weights, self._broadcast, bucket_bytes=bucket_bytes, dtype=self._sync_dtype(dtype))
        return stats.metrics()

    # ---- weight sync: receiver side (inference roles) ------------------------------------------------------
    def receive_shared_bucket(self, name: str, metas: list[TensorMeta]) -> int:
        """Load one bucket from the sender's shared-memory slot ``name``."""
        if self._reader is None:
            self._reader = SharedStagingReader()
        return int(self.strategy.load_weights(expand_aliases(self._reader.read(name, metas))))

    def receive_weight_bucket(self, payload: list[Any]) -> int:
        """Load one bucket pushed through the object store."""
        return int(self.strategy.load_weights(expand_aliases(unpack_from_store(payload))))

    def receive_weights_by_broadcast(self) -> int:
        """Load every bucket broadcast by train rank 0 until its end-of-stream marker."""
        if self._broadcast is None:
            raise RuntimeError(f"{self.role} rank {self.rank} has not joined the weight-sync group")
        return sum(int(self.strategy.load_weights(expand_aliases(b))) for b in receive_by_broadcast(self._broadcast))


def weights_to_send(strategy: Any, names: str, frozen: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """What a train ``strategy`` sends in a weight sync. ``names``: ``module``, the (merged) named weights;
    ``checkpoint``, the same under a model folder's names (a strategy on a transformers model,
    ``transformers_model()``, converts them; others name them so already); ``adapters``, a LoRA model's adapters
    alone. Without ``frozen``, the strategy's frozen weights (its ``frozen`` names, ``model_args.freeze_module_prefix``)
    are left out; every rank still iterates all of them (each may be a collective)."""
    if names == "adapters":
        adapters: Iterator[tuple[str, torch.Tensor]] = strategy.adapter_weights()
        return adapters
    weights: Iterator[tuple[str, torch.Tensor]] = strategy.named_weights()
    skip = set() if frozen else set(getattr(strategy, "frozen", ()))
    if skip:
        weights = ((name, value) for name, value in weights if name not in skip)
    model = getattr(strategy, "transformers_model", None)
    if names == "checkpoint" and model is not None:
        return in_checkpoint_names(model(), weights)
    return weights

"""Train -> infer weight sync between two worker groups (ROLL's model_update), timed per sync."""

from __future__ import annotations

import time
from typing import Any

from rl_engines.weight_sync import DEFAULT_BUCKET_BYTES, SYNC_NAMES
from rl_engines.worker_group import WorkerGroup


class ModelUpdater:
    """Push ``train``'s current weights into every worker of ``infer``.

    ``colocated=True`` (the roles share devices, hence hosts) goes through shared memory (the object store for
    receivers on another host); ``False`` builds a dedicated broadcast group (gloo / nccl) once, at construction.
    ``dtype`` (fp32, bf16, fp16) casts floating weights before they travel, e.g. fp32 masters into a bf16 engine.
    ``names`` picks what travels: ``"module"`` the (merged) weights under the train model's own names (engines built
    on transformers), ``"checkpoint"`` the same under the names a model folder stores (engines with their own
    loaders: vLLM, SGLang; they differ for transformers' fused MoE experts), ``"adapters"`` a LoRA actor's adapters
    alone (an engine serving LoRA adapters).
    The train role may be offloaded: its strategy brings the weights back to the device for the sync. Frozen weights
    (``model_args.freeze_module_prefix``) never change, so they travel with the first sync only into an engine that
    loads any subset of tensors and keeps its weights (``hf_infer``), with every sync into the others (vLLM, whose
    ``sleep_level: 2`` drops the weights and whose loads go by layer; Megatron, which fuses q/k/v; SGLang).
    """

    def __init__(
        self,
        train: WorkerGroup,
        infer: WorkerGroup,
        *,
        colocated: bool,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: str | None = None,
        timeout_s: float = 600.0,
        names: str = "module",
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if names not in SYNC_NAMES:
            raise ValueError(f"names={names!r}; use one of {list(SYNC_NAMES)}")
        self.train, self.infer = train, infer
        self.colocated = colocated
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.names = names
        self.syncs = 0
        self._hosts: list[bool] | None = None
        self._discards: bool | None = None
        hosted = infer.hosted_ranks
        if hosted and not (colocated and {infer.actors[rank] for rank in hosted} <= set(train.actors)):
            raise ValueError(f"{infer.role} rank(s) {sorted(hosted)} run in another role's processes; only that role "
                             f"can sync weights into them, not {train.role}.")  # fmt: skip
        if not colocated:
            self._join_broadcast_group()

    def _join_broadcast_group(self) -> None:
        addr, port = self.train.call("reserve_port", dispatch="rank_zero")
        world = 1 + self.infer.world_size
        n = self.infer.world_size
        sender = self.train.call_async(
            "join_broadcast_group", addr, port, 0, world, self.timeout_s, dispatch="rank_zero"
        )
        receivers = self.infer.call_async(
            "join_broadcast_group",
            [addr] * n, [port] * n, list(range(1, world)), [world] * n, [self.timeout_s] * n,
            dispatch="all_ranks_list",
        )  # fmt: skip
        sender.get()
        receivers.get()

    def _receivers_by_host(self) -> tuple[list[Any], list[Any]]:
        """Inference workers with processes of their own on train rank 0's host (shared memory) and elsewhere
        (object store); hosted ranks load in process, from the train rank that hosts them."""
        if self._hosts is None:
            sender = self.train.call("node_ip", dispatch="rank_zero")
            self._hosts = [ip == sender for ip in self.infer.call("node_ip")]
        own = [(actor, same) for rank, (actor, same) in enumerate(zip(self.infer.actors, self._hosts))
               if rank not in self.infer.hosted_ranks]  # fmt: skip
        return [a for a, same in own if same], [a for a, same in own if not same]

    def close(self) -> None:
        """Release the sender's shared-memory slots (the next colocated sync creates them again)."""
        if self.colocated and self.train.actors:
            self.train.call("close_staging", dispatch="rank_zero")

    def sync(self) -> dict[str, float]:
        """Transfer the weights; returns ``time/model_update`` (wall seconds seen by the driver) and byte counts."""
        start = time.perf_counter()
        if self._discards is None:
            self._discards = bool(self.infer.call("needs_every_weight", dispatch="rank_zero"))
        frozen = self.syncs == 0 or self._discards
        if self.colocated:
            shm, store = self._receivers_by_host()
            guest = self.infer.role if self.infer.hosted_ranks else None
            results = self.train.call("send_weights_on_host", shm, store, self.bucket_bytes, self.dtype, self.timeout_s,
                                      self.names, guest, frozen)  # fmt: skip
        else:
            receiving = self.infer.call_async("receive_weights_by_broadcast")
            results = self.train.call("send_weights_by_broadcast", self.bucket_bytes, self.dtype, self.names, frozen)
            receiving.get()
        metrics = dict(results[0])
        elapsed = time.perf_counter() - start
        metrics["time/model_update"] = elapsed
        metrics["model_update/gigabytes_per_s"] = metrics.get("model_update/bytes", 0.0) / max(elapsed, 1e-9) / 1e9
        self.syncs += 1
        return metrics

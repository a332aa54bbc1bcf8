"""Start every configured role on Ray in one call: placement checked first, then workers, then models.

``Roles`` is what a pipeline holds: one :class:`WorkerGroup` per role, the placement plan (which roles are
colocated), turn-taking for colocated roles, and a :class:`ModelUpdater` per train -> infer pair.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from rl_engines.config import WorkerConfig
from rl_engines.model_update import ModelUpdater
from rl_engines.placement import ClusterSpec, PlacementPlan, RoleResources, plan_placement
from rl_engines.ray_cluster import ResourcePool
from rl_engines.role_worker import RoleWorker
from rl_engines.shared_processes import hosted_roles, plan_sharing
from rl_engines.weight_sync import DEFAULT_BUCKET_BYTES
from rl_engines.worker_group import WorkerError, WorkerGroup

INFERENCE_ROLES = ("actor_infer", "reward")
logger = logging.getLogger(__name__)


TRAIN_ROLES = ("actor_train", "critic")


def check_strategy(role: str, config: WorkerConfig) -> None:
    """The role's strategy_name must be registered and of the right kind (train roles need a train strategy), and
    its strategy_config must parse: checked on the driver, before any worker starts."""
    from rl_engines.strategies import STRATEGIES

    key = f"{role}.strategy_args.strategy_name"
    name = config.strategy_args.strategy_name
    if name not in STRATEGIES:
        raise ValueError(f"{key}={name!r} is not a registered strategy; valid names: {STRATEGIES.names()}.")
    kind = STRATEGIES.get(name).kind
    wanted = "train" if role in TRAIN_ROLES else "infer"
    if kind != wanted:
        valid = sorted(n for n in STRATEGIES.names() if STRATEGIES.get(n).kind == wanted)
        words = {"train": "a training", "infer": "an inference"}
        raise ValueError(f"{key}={name!r} is {words[kind]} strategy, but {role} needs {words[wanted]} strategy: "
                         f"one of {valid}.")  # fmt: skip
    check_lora(role, config, getattr(STRATEGIES.get(name), "lora", None))
    check_router_loss(role, config)
    from rl_engines.strategies import create_strategy

    create_strategy(config, role)  # parses strategy_config, naming bad keys; engines load only in initialize()


def syncs_adapters(config: WorkerConfig) -> bool:
    """Whether an inference role takes the actor's LoRA adapters alone: ``lora_*`` keys on it and an engine that
    serves adapters (``lora = "adapters"``, vLLM); otherwise it takes merged weights."""
    from rl_engines.strategies import STRATEGIES

    name = config.strategy_args.strategy_name
    return config.model_args.lora and getattr(STRATEGIES.get(name), "lora", None) == "adapters"


def sync_names(config: WorkerConfig) -> str:
    """What a weight sync into this inference role sends (:class:`ModelUpdater`'s ``names``): the adapters alone
    (:func:`syncs_adapters`), weights under checkpoint names for an engine with its own loader (``weight_names =
    "checkpoint"``: vLLM, SGLang), else weights under the train model's own names."""
    from rl_engines.strategies import STRATEGIES

    if syncs_adapters(config):
        return "adapters"
    return str(getattr(STRATEGIES.get(config.strategy_args.strategy_name), "weight_names", "module"))


def check_lora_pair(train: WorkerConfig, infer: WorkerConfig) -> None:
    """An inference role with ``lora_*`` keys serves the adapters the train role trains: the same rank and alpha
    (its own keys write the adapter config vLLM loads); a ValueError names both keys otherwise."""
    if not infer.model_args.lora or not train.model_args.lora:
        return
    for key, mine, theirs in (("lora_rank", infer.model_args.lora_rank, train.model_args.lora_rank),
                              ("lora_alpha", infer.model_args.alpha, train.model_args.alpha)):  # fmt: skip
        if mine != theirs:
            raise ValueError(
                f"actor_infer.model_args.{key}={mine} but actor_train.model_args.{key}={theirs}: actor_infer serves "
                f"the adapters actor_train trains; give both the same {key}."
            )


def check_router_loss(role: str, config: WorkerConfig) -> None:
    """``model_args.moe_aux_loss_coef`` only on a role whose strategy adds the router loss (``router_loss = True``:
    the torch-native training strategies, see :mod:`rl_engines.strategies.moe`)."""
    coef = config.model_args.moe_aux_loss_coef
    if coef is None:
        return
    from rl_engines.strategies import STRATEGIES

    name = config.strategy_args.strategy_name
    if not getattr(STRATEGIES.get(name), "router_loss", False):
        able = sorted(n for n in STRATEGIES.names() if getattr(STRATEGIES.get(n), "router_loss", False))
        raise ValueError(
            f"{role}.model_args.moe_aux_loss_coef={coef} is set, but {role}.strategy_args.strategy_name={name!r} adds "
            f"no router loss (only a training role's loss has one, on {able}); remove the key from {role}."
        )


def check_lora(role: str, config: WorkerConfig, support: str | None) -> None:
    """``model_args.lora_*`` only where the role's strategy does what ROLL does with them: a training strategy that
    trains adapters (``lora = "adapters"``), an inference one that takes the actor's merged weights (``"merged"``)."""
    if not config.model_args.lora:
        return
    from rl_engines.strategies import STRATEGIES

    key, name = f"{role}.model_args.lora_target", config.strategy_args.strategy_name
    if role not in ("actor_train", "actor_infer"):
        raise ValueError(
            f"{key} is set, but LoRA adapters belong to the policy (actor_train trains them, actor_infer receives "
            f"them); {role} takes no adapters. Remove the lora_* keys of {role}."
        )
    wanted = ("adapters",) if role == "actor_train" else ("merged", "adapters")
    if support not in wanted:
        able = sorted(n for n in STRATEGIES.names() if getattr(STRATEGIES.get(n), "lora", None) in wanted
                      and STRATEGIES.get(n).kind == ("train" if role == "actor_train" else "infer"))  # fmt: skip
        raise ValueError(
            f"{key} is set, but {role}.strategy_args.strategy_name={name!r} cannot "
            f"{'train LoRA adapters' if role == 'actor_train' else 'take the LoRA actor weights'} here; use one of "
            f"{able}, or remove the lora_* keys of {role}."
        )


def plan_roles(cluster: ClusterSpec, configs: Mapping[str, WorkerConfig]) -> PlacementPlan:
    """Validate every role's strategy and device_mapping against the cluster (raises before anything starts)."""
    resources = []
    for name, config in configs.items():
        check_strategy(name, config)
        if not config.device_mapping:
            raise ValueError(f"{name}.device_mapping is empty; give the devices the role runs on.")
        is_infer = name in INFERENCE_ROLES or name.startswith("rewards.")
        resources.append(RoleResources(name, config.device_mapping, config.num_gpus_per_worker, is_inference=is_infer))
    return plan_placement(cluster, resources)


class Roles:
    """Worker groups for ``configs`` (role name -> WorkerConfig) on a running Ray (see ``start_ray``).

    Construction plans placement (bad mappings fail here, naming the role), starts every role's workers at once,
    then loads every role's model concurrently. ``rpc_timeout`` (seconds, ROLL key) bounds every remote call.
    An inference role on exactly another role's devices runs in that role's processes where the results are those
    of separate processes (:mod:`rl_engines.shared_processes`; ``share_processes=False``: every role in its own).
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        configs: Mapping[str, WorkerConfig],
        *,
        rpc_timeout: float = 3600.0,
        system_envs: dict[str, str] | None = None,
        use_gpu: bool | None = None,
        share_processes: bool = True,
    ) -> None:
        self.configs = dict(configs)
        self.plan = plan_roles(cluster, self.configs)
        self.rpc_timeout = rpc_timeout
        envs = {name: {**(system_envs or {}), **config.system_envs} for name, config in self.configs.items()}
        self.shared = plan_sharing(self.plan, self.configs, envs) if share_processes else {}
        """Guest role -> where its shared ranks run (:mod:`rl_engines.shared_processes`)."""
        self.pool = ResourcePool(cluster, use_gpu=use_gpu)
        self.groups: dict[str, WorkerGroup] = {}
        self._updaters: list[ModelUpdater] = []
        try:
            for name in sorted(self.configs, key=lambda role: role in self.shared):  # hosts first
                guest = self.shared.get(name)
                host_actors = self.groups[guest.host].actors if guest is not None else ()
                hosted = {rank: host_actors[host_rank] for rank, host_rank in guest.ranks.items()} if guest else {}
                guests = hosted_roles(self.shared, name, self.plan, self.configs)
                self.groups[name] = WorkerGroup(
                    name, RoleWorker, self.plan.roles[name], self.pool, rpc_timeout=rpc_timeout,
                    system_envs=envs[name], init_args=(self.configs[name], guests), wait=False, hosted=hosted,
                )  # fmt: skip
                if guest is not None:
                    logger.info("%s: rank(s) %s run in the worker processes of %s (same devices and system_envs; "
                                "%s needs no process of its own)", name, sorted(guest.ranks), guest.host,
                                self.configs[name].strategy_args.strategy_name)  # fmt: skip
            self.groups = {name: self.groups[name] for name in self.configs}  # config order
            for group in self.groups.values():  # processes of all roles start (and import) side by side
                group.wait_started()
            futures = [group.call_async("initialize", rpc_timeout) for group in self.groups.values()]
            for future in futures:
                future.get()
        except BaseException:
            self.shutdown()
            raise

    def __getitem__(self, role: str) -> WorkerGroup:
        if role not in self.groups:
            raise KeyError(f"role {role!r} is not configured; configured roles: {sorted(self.groups)}")
        return self.groups[role]

    def model_updater(
        self,
        train: str = "actor_train",
        infer: str = "actor_infer",
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: str | None = None,
    ) -> ModelUpdater:
        """A weight sync from ``train`` to ``infer``: shared memory when colocated, a broadcast group when separate.
        A LoRA ``infer`` role whose engine serves adapters (``lora_*`` keys on it, ROLL's choice) gets the adapters
        alone; any other gets the weights (merged with the adapters)."""
        colocated = self.plan.is_colocated(train, infer)
        check_lora_pair(self.configs[train], self.configs[infer])
        updater = ModelUpdater(self[train], self[infer], colocated=colocated, bucket_bytes=bucket_bytes, dtype=dtype,
                               timeout_s=self.rpc_timeout, names=sync_names(self.configs[infer]))  # fmt: skip
        self._updaters.append(updater)
        return updater

    def activate(self, role: str) -> None:
        """Give ``role`` its devices: offload the roles colocated with it, reload it (ROLL's turn-taking)."""
        for other in self.groups:
            if other != role and self.plan.is_colocated(role, other):
                self.groups[other].call("offload")
        self[role].call("reload")

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Shorthand for ``roles[role].call(method, ...)``."""
        return self[role].call(method, *args, **kwargs)

    def shutdown(self) -> None:
        """Release sync buffers, kill every worker and free the placement groups (idempotent)."""
        for updater in self._updaters:
            with contextlib.suppress(WorkerError):  # a dead sender's slots are unlinked by its resource tracker
                updater.close()
        self._updaters = []
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
        if getattr(self, "pool", None) is not None:
            self.pool.remove()
            self.pool = None  # type: ignore[assignment]

    def __enter__(self) -> Roles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

"""Plan where each role's workers run, and validate it before any worker starts.

A cluster is ``num_nodes × num_gpus_per_node`` devices with global ids ``0 .. N-1``; global id ``g`` lives on node
``g // num_gpus_per_node`` as local device ``g % num_gpus_per_node`` (ROLL's numbering). On a CPU-only machine the
ids are CPU worker slots and the same plan applies; nothing here touches CUDA or Ray.

A role's workers take consecutive groups of ``num_gpus_per_worker`` ids from its ``device_mapping``, in the order
written. Roles that share devices are *colocated* (ROLL offloads one and reloads the other between phases); roles
with disjoint devices are *separate*. Partial overlap (two roles sharing some but not all of their devices, e.g.
reference on 0-3 while actor_train is on 0-7) is deliberately allowed, since placement itself has no conflict, but
it is reported in ``PlacementPlan.partial_overlaps``: it is usually a typo and it unbalances offload / reload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rl_engines.device_mapping import parse_device_mapping


class PlacementError(ValueError):
    """A role's resources do not fit the cluster; the message names the role key, the bad ids and the fix."""


@dataclass(frozen=True)
class ClusterSpec:
    """The devices a job may use: ``num_nodes`` machines with ``num_gpus_per_node`` devices (or CPU slots) each."""

    num_nodes: int
    """Number of machines in the Ray cluster."""
    num_gpus_per_node: int
    """Devices per machine; on a CPU-only machine, the number of CPU worker slots per machine."""

    def __post_init__(self) -> None:
        for name in ("num_nodes", "num_gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlacementError(f"{name} must be a positive integer, got {value!r}.")

    @property
    def num_devices(self) -> int:
        """Total devices in the cluster: ``num_nodes * num_gpus_per_node``."""
        return self.num_nodes * self.num_gpus_per_node


@dataclass(frozen=True)
class RoleResources:
    """What one role (actor_train, actor_infer, reference, critic, reward) asks for."""

    name: str
    """Role name as in the config, e.g. ``actor_infer``; error messages say ``<name>.device_mapping``."""
    device_mapping: list[int]
    """Global device ids the role uses (already parsed; see ``parse_device_mapping``)."""
    num_gpus_per_worker: int = 1
    """Devices per worker. Only inference roles may use more than one (e.g. vLLM tensor parallelism)."""
    is_inference: bool = False
    """True for generation roles (actor_infer, a generative reward); training roles always use 1 device per worker."""


@dataclass(frozen=True)
class WorkerPlacement:
    """One worker of a role: its rank, the node it runs on, and its devices."""

    rank: int
    """Rank within the role, ``0 .. world_size-1``."""
    node_rank: int
    """Node the worker runs on."""
    global_device_ids: tuple[int, ...]
    """Device ids in cluster numbering."""
    local_device_ids: tuple[int, ...]
    """The same devices numbered within the node (what CUDA_VISIBLE_DEVICES would list)."""


@dataclass(frozen=True)
class RolePlacement:
    """Where every worker of one role runs."""

    name: str
    """Role name."""
    num_gpus_per_worker: int
    """Devices per worker."""
    workers: tuple[WorkerPlacement, ...]
    """Workers in rank order."""

    @property
    def world_size(self) -> int:
        """Number of workers: ``len(device_mapping) // num_gpus_per_worker``."""
        return len(self.workers)

    @property
    def device_ids(self) -> frozenset[int]:
        """All global device ids the role uses."""
        return frozenset(i for worker in self.workers for i in worker.global_device_ids)

    @property
    def node_ranks(self) -> tuple[int, ...]:
        """Nodes the role runs on, ascending."""
        return tuple(sorted({worker.node_rank for worker in self.workers}))


@dataclass(frozen=True)
class PartialOverlap:
    """Two roles that share some, but not all, of their devices."""

    roles: tuple[str, str]
    """The two role names, in config order."""
    shared_device_ids: tuple[int, ...]
    """Devices both roles use, ascending."""


@dataclass(frozen=True)
class PlacementPlan:
    """The validated placement of all roles on a cluster."""

    cluster: ClusterSpec
    """The cluster the plan was made for."""
    roles: dict[str, RolePlacement]
    """Placement per role name, in config order."""
    device_groups: tuple[tuple[str, ...], ...]
    """Roles grouped by shared devices (connected through any shared id); every role is in exactly one group."""
    partial_overlaps: tuple[PartialOverlap, ...] = field(default=())
    """Role pairs that share some but not all devices (allowed; reported because it is often a mistake)."""

    @property
    def colocated_groups(self) -> tuple[tuple[str, ...], ...]:
        """Groups of two or more roles that share devices and so take turns on them (offload / reload)."""
        return tuple(group for group in self.device_groups if len(group) > 1)

    @property
    def separate_roles(self) -> tuple[str, ...]:
        """Roles that share no device with any other role."""
        return tuple(group[0] for group in self.device_groups if len(group) == 1)

    @property
    def unused_device_ids(self) -> tuple[int, ...]:
        """Cluster devices that no role uses (allowed; a sign the cluster is larger than the config needs)."""
        used = set().union(*(role.device_ids for role in self.roles.values()))
        return tuple(i for i in range(self.cluster.num_devices) if i not in used)

    def is_colocated(self, role_a: str, role_b: str) -> bool:
        """True when the two roles share at least one device."""
        return bool(self.roles[role_a].device_ids & self.roles[role_b].device_ids)


def plan_placement(cluster: ClusterSpec, roles: Sequence[RoleResources]) -> PlacementPlan:
    """Validate every role against ``cluster`` and return where each worker runs.

    Checks, in order, per role: the mapping is a non-empty list of distinct non-negative ints; every id exists in
    the cluster (the check that replaces ROLL's late ``self.node2pg[node_rank] KeyError: 1``);
    ``num_gpus_per_worker`` is 1 for training roles and divides the mapping for inference roles; each worker's
    device group lies on one node. Raises ``PlacementError`` (or ``DeviceMappingError``), both ``ValueError``.
    """
    if not roles:
        raise PlacementError("no roles to place; configure at least one of actor_train, actor_infer, reference.")
    names = [role.name for role in roles]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise PlacementError(f"roles {repeated} are configured more than once; each role name must be unique.")
    placements = {role.name: _place_role(cluster, role) for role in roles}
    return PlacementPlan(
        cluster=cluster,
        roles=placements,
        device_groups=_device_groups(placements),
        partial_overlaps=_partial_overlaps(placements),
    )


def _place_role(cluster: ClusterSpec, role: RoleResources) -> RolePlacement:
    key = f"{role.name}.device_mapping"
    ids = parse_device_mapping(role.device_mapping, role=role.name)
    outside = sorted(i for i in ids if i >= cluster.num_devices)
    if outside:
        raise PlacementError(
            f"{key} uses device ids {outside} but the cluster has only {cluster.num_devices} devices "
            f"(num_nodes={cluster.num_nodes} × num_gpus_per_node={cluster.num_gpus_per_node}, valid ids "
            f"0..{cluster.num_devices - 1}). Fix: keep {key} within 0..{cluster.num_devices - 1}, or raise "
            f"num_nodes / num_gpus_per_node to cover id {outside[-1]}. "
            "(In ROLL this surfaces later as `self.node2pg[node_rank] KeyError`.)"
        )
    per_worker = _check_gpus_per_worker(role, len(ids))
    workers = []
    for rank in range(len(ids) // per_worker):
        group = tuple(ids[rank * per_worker : (rank + 1) * per_worker])
        nodes = sorted({i // cluster.num_gpus_per_node for i in group})
        if len(nodes) > 1:
            raise PlacementError(
                f"{key}: worker {rank} of {role.name} gets devices {list(group)}, which span nodes {nodes} "
                f"({cluster.num_gpus_per_node} devices per node); a multi-device worker must fit on one node. "
                f"Fix: order {key} so every consecutive group of {role.name}.num_gpus_per_worker={per_worker} "
                "ids lies on one node."
            )
        local = tuple(i % cluster.num_gpus_per_node for i in group)
        workers.append(WorkerPlacement(rank, nodes[0], group, local))
    return RolePlacement(role.name, per_worker, tuple(workers))


def _check_gpus_per_worker(role: RoleResources, num_ids: int) -> int:
    key = f"{role.name}.num_gpus_per_worker"
    per_worker = role.num_gpus_per_worker
    if isinstance(per_worker, bool) or not isinstance(per_worker, int) or per_worker < 1:
        raise PlacementError(f"{key} must be a positive integer, got {per_worker!r}.")
    if per_worker > 1 and not role.is_inference:
        raise PlacementError(
            f"{key}={per_worker}, but num_gpus_per_worker applies only to inference roles (e.g. actor_infer); "
            f"{role.name} trains with one device per worker. Fix: drop {key} and set model parallelism in "
            f"{role.name}.strategy_args.strategy_config (e.g. tensor_model_parallel_size)."
        )
    if num_ids % per_worker:
        raise PlacementError(
            f"{key}={per_worker} does not divide the {num_ids} devices of {role.name}.device_mapping; "
            f"Fix: use a multiple of {per_worker} devices or a num_gpus_per_worker that divides {num_ids}."
        )
    return per_worker


def _device_groups(placements: dict[str, RolePlacement]) -> tuple[tuple[str, ...], ...]:
    """Connected components of the "shares a device" relation, in config order (union-find)."""
    names = list(placements)
    parent = {name: name for name in names}

    def root(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            if placements[first].device_ids & placements[second].device_ids:
                parent[root(second)] = root(first)
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(root(name), []).append(name)
    return tuple(tuple(group) for group in groups.values())


def _partial_overlaps(placements: dict[str, RolePlacement]) -> tuple[PartialOverlap, ...]:
    names = list(placements)
    found = []
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a, b = placements[first].device_ids, placements[second].device_ids
            if a & b and a != b:
                found.append(PartialOverlap((first, second), tuple(sorted(a & b))))
    return tuple(found)

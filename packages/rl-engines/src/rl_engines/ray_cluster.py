"""Start Ray and reserve the cluster's devices as one placement group per node.

A ``ResourcePool`` turns a ``ClusterSpec`` (``num_nodes × num_gpus_per_node``) into Ray placement groups: node rank
``r`` gets one ``STRICT_PACK`` group pinned to one Ray node, with one bundle per device, so bundle ``i`` of group
``r`` is local device ``i`` of node ``r`` (ROLL's ``node2pg``). Workers then take a small fraction of a bundle's
device resource, so roles that share devices (colocated roles) share bundles, as ROLL does with ``num_gpus=0.01``.

On a CPU-only machine the "devices" are worker slots: a custom Ray resource ``rl_device`` stands in for ``GPU``
(start Ray with ``resources=cpu_device_resources(cluster)``), and actors ask for no CPU, so a 2-core machine can
host as many actors as the plan needs.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_engines.placement import ClusterSpec, PlacementError, WorkerPlacement

CPU_DEVICE_RESOURCE = "rl_device"
"""Custom Ray resource that stands for one device slot on CPU-only machines."""
ACTOR_DEVICE_FRACTION = 0.01
"""Share of a bundle's device each actor asks for: up to 100 colocated actors can share one device."""
NODE_ID_LABEL = "ray.io/node-id"
"""Label every Ray node carries; placement groups are pinned to nodes through it."""
DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
"""Seconds a ``ResourcePool`` waits for its placement groups before it reports what Ray has."""

_BUNDLE_RESOURCE = re.compile(r"_group_(\d+_)?[0-9a-f]{16,}$")  # e.g. rl_device_group_0_<placement group id>
LOCAL_SYSTEM_CONFIG: dict[str, Any] = {"enable_metrics_collection": False, "prestart_worker_first_driver": False}
"""Ray settings of a local instance: no metrics collection or export (the dashboard agent's reporter and the
workers' metrics), and no default workers started ahead for the first driver (our actors start their own)."""

_started_temp_dir: str | None = None
_reaper: _Reaper | None = None


def default_temp_dir() -> str:
    """``<system temp>/rl_ray_<pid>``: short, because Ray puts Unix sockets under it (path limit ~107 chars)."""
    return os.path.join(tempfile.gettempdir(), f"rl_ray_{os.getpid()}")


def cpu_device_resources(cluster: ClusterSpec) -> dict[str, float]:
    """Ray resources one CPU-only node needs to host ``cluster.num_gpus_per_node`` device slots.

    Pass it as ``start_ray(resources=...)`` (or to each ``ray.cluster_utils.Cluster`` node, or
    ``ray start --resources``) so that ``ResourcePool(cluster, use_gpu=False)`` can place its bundles.
    """
    return {CPU_DEVICE_RESOURCE: float(cluster.num_gpus_per_node)}


def start_ray(
    *,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    temp_dir: str | None = None,
    address: str | None = None,
) -> bool:
    """Start a local Ray instance, or connect to ``address``; a no-op when Ray is already initialised.

    Returns True when this call started (or connected) Ray and False when Ray was running already: a caller that
    got False shares someone else's Ray (a test session's, a notebook's) and must not ``stop_ray`` it.

    Nothing is written to the home directory: the dashboard is off, token auth is disabled
    (``RAY_AUTH_MODE=disabled`` unless set already), usage stats are off, and session files go to ``temp_dir``
    (default ``default_temp_dir()``). ``num_cpus``, ``resources`` and ``temp_dir`` describe the node Ray starts, so
    they cannot be combined with ``address`` (the cluster's nodes were started with their own).

    A local instance starts lean (``LOCAL_SYSTEM_CONFIG``: no metrics exporter, no idle workers started ahead) and
    with a reaper process that kills its processes once this driver is gone, even by SIGKILL (see ``_Reaper``).
    """
    global _started_temp_dir, _reaper
    node_options = {"num_cpus": num_cpus, "resources": resources, "temp_dir": temp_dir}
    given = [name for name, value in node_options.items() if value is not None]
    if address is not None and given:
        raise ValueError(
            f"start_ray(address={address!r}) connects to a running cluster, so {given} cannot be set here; "
            "set them when starting the cluster's nodes (`ray start --num-cpus ... --resources ...`)."
        )
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    options: dict[str, Any] = {"include_dashboard": False, "ignore_reinit_error": True, "log_to_driver": True}
    if address is not None:
        ray.init(address=address, **options)
        return True
    _started_temp_dir = temp_dir or default_temp_dir()
    os.makedirs(_started_temp_dir, exist_ok=True)
    before = _descendants(os.getpid())
    ray.init(num_cpus=num_cpus, resources=resources, _temp_dir=_started_temp_dir,
             _system_config=dict(LOCAL_SYSTEM_CONFIG), **options)  # fmt: skip
    started = {pid: start for pid, start in _descendants(os.getpid()).items() if pid not in before}
    _reaper = _Reaper.start(_started_temp_dir, started)
    return True


def stop_ray(*, remove_temp_dir: bool = False) -> None:
    """Shut Ray down (idempotent); with ``remove_temp_dir``, also delete the session files ``start_ray`` wrote.

    Call it only where ``start_ray`` returned True: it stops Ray for everyone in this process.
    """
    global _started_temp_dir, _reaper
    ray.shutdown()
    if _reaper is not None:
        _reaper.finish()  # Ray's agents can outlive ray.shutdown() for a moment
        _reaper = None
    if remove_temp_dir and _started_temp_dir is not None:
        _remove_settled(_started_temp_dir)
    _started_temp_dir = None


def _remove_settled(path: str, attempts: int = 20, pause_s: float = 0.1) -> None:
    """Delete ``path``, again if Ray's exiting processes write into it after the first removal (they can for a
    moment after ``ray.shutdown()`` returns)."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        time.sleep(pause_s)
        if not os.path.exists(path):
            return


# The reaper's program (standard library only): read "pid start-time" lines until EOF, which comes when the driver
# closes the pipe (stop_ray) or dies, then SIGKILL each listed process that still runs (same start time: not a
# reused pid). argv[1] (the Ray temp dir) only names the reaper in process listings.
_REAPER_SOURCE = """
import os, signal, sys
def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()[19].decode()
processes = [line.split() for line in sys.stdin if line.strip()]
for pid, started in processes:
    if start_time(int(pid)) == started:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
"""


class _Reaper:
    """A process that kills a local Ray instance's processes once the driver that started them is gone.

    Ray ties its node processes (GCS, raylet, ...) to the driver (``PR_SET_PDEATHSIG``), but the raylet's dashboard
    agent and runtime-env agent are the raylet's children: after a SIGKILL of the driver they notice the raylet's
    death at once, then wait 60 s to report it to the dead GCS (``publish_error_to_driver``'s fixed timeout) before
    they exit. Ray 2.60 cannot start without them (its raylet aborts on an empty agent command), so the reaper ends
    them instead. Linux only (it reads ``/proc``); elsewhere nothing is started.
    """

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls, temp_dir: str, processes: dict[int, str]) -> _Reaper | None:
        """A reaper watching ``processes`` (pid -> start time), or None where ``/proc`` is missing."""
        if not processes:
            return None
        command = [sys.executable, "-c", _REAPER_SOURCE, f"rl-ray-reaper {temp_dir}"]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)  # no Ctrl-C from the tty
        assert process.stdin is not None
        process.stdin.write("".join(f"{pid} {start}\n" for pid, start in processes.items()).encode())
        process.stdin.flush()
        return cls(process)

    def finish(self, timeout_s: float = 10.0) -> None:
        """Close the pipe (the reaper kills what is still running) and wait for it."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid`` (children, their children, ...) -> its start time; empty without ``/proc``."""
    children: dict[int, list[int]] = {}
    start_times: dict[int, str] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = data[data.rindex(b")") + 2 :].split()  # after "(comm)": state, ppid, ..., starttime (22nd field)
        children.setdefault(int(fields[1]), []).append(int(name))
        start_times[int(name)] = fields[19].decode()
    found: dict[int, str] = {}
    stack = list(children.get(pid, ()))
    while stack:
        child = stack.pop()
        found[child] = start_times[child]
        stack.extend(children.get(child, ()))
    return found


class ResourcePool:
    """One ``STRICT_PACK`` placement group per node rank, ``num_gpus_per_node`` device bundles each.

    ``use_gpu=None`` means "GPU when the Ray cluster has GPUs" (asked of Ray when the pool is built, never at
    import). On CPU the bundles hold the ``rl_device`` resource. Node rank 0 is the driver's node when it
    qualifies; the other ranks follow in (ip, node id) order. Raises ``PlacementError`` naming
    ``num_nodes`` / ``num_gpus_per_node`` and what Ray has when the groups cannot be placed within ``timeout_s``.
    """

    def __init__(
        self, cluster: ClusterSpec, *, use_gpu: bool | None = None, timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("ResourcePool needs a running Ray; call rl_engines.ray_cluster.start_ray() first.")
        self.cluster = cluster
        self.use_gpu = bool(_ray_resources().get("GPU", 0)) if use_gpu is None else use_gpu
        self.device_resource = "GPU" if self.use_gpu else CPU_DEVICE_RESOURCE
        self.node_ids: tuple[str, ...] = _pick_nodes(cluster, self.device_resource)
        """Ray node id (hex) of each node rank."""
        self.placement_groups: tuple[PlacementGroup, ...] = self._create_groups(timeout_s)
        """Placement group of each node rank; bundle ``i`` is local device ``i``."""

    def _create_groups(self, timeout_s: float) -> tuple[PlacementGroup, ...]:
        per_node = self.cluster.num_gpus_per_node
        groups = tuple(
            placement_group(
                [{self.device_resource: 1.0}] * per_node,
                strategy="STRICT_PACK",
                bundle_label_selector=[{NODE_ID_LABEL: node_id}] * per_node,
            )
            for node_id in self.node_ids
        )
        ready, _ = ray.wait([group.ready() for group in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            for group in groups:
                remove_placement_group(group)
            raise PlacementError(
                f"could not reserve num_nodes={self.cluster.num_nodes} × num_gpus_per_node={per_node} "
                f"{self.device_resource!r} within {timeout_s:.0f}s ({len(ready)} of {len(groups)} nodes placed). "
                f"Ray has cluster_resources()={_brief(_ray_resources())}, "
                f"available_resources()={_brief(_ray_resources(available=True))}. Fix: free the devices held by "
                "other placement groups or jobs (an earlier ResourcePool not removed?), or lower num_gpus_per_node."
            )
        return groups

    def remove(self) -> None:
        """Free the placement groups (idempotent). Actors still placed on them are killed by Ray."""
        groups, self.placement_groups = self.placement_groups, ()
        for group in groups:
            remove_placement_group(group)

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"ResourcePool(num_nodes={self.cluster.num_nodes}, num_gpus_per_node={self.cluster.num_gpus_per_node}, "
            f"resource={self.device_resource!r}, live={bool(self.placement_groups)})"
        )


def _pick_nodes(cluster: ClusterSpec, resource: str) -> tuple[str, ...]:
    """Alive Ray nodes with enough ``resource``: the driver's node first, then by (ip, node id)."""
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = [node for node in _ray_nodes() if node["Alive"]]
    fitting = [node for node in nodes if node["Resources"].get(resource, 0) >= cluster.num_gpus_per_node]
    fitting.sort(key=lambda node: (node["NodeID"] != driver_node, node["NodeManagerAddress"], node["NodeID"]))
    if len(fitting) < cluster.num_nodes:
        seen = ", ".join(
            f"{node['NodeManagerAddress']}: {resource}={node['Resources'].get(resource, 0):g}" for node in nodes
        )
        fix = (
            "start Ray on each node with resources=cpu_device_resources(cluster) (see start_ray)"
            if resource == CPU_DEVICE_RESOURCE
            else "add GPU nodes to the Ray cluster"
        )
        raise PlacementError(
            f"num_nodes={cluster.num_nodes} × num_gpus_per_node={cluster.num_gpus_per_node} needs "
            f"{cluster.num_nodes} Ray node(s) with {cluster.num_gpus_per_node} {resource!r} each, but only "
            f"{len(fitting)} qualify (nodes: {seen or 'none'}; cluster_resources()="
            f"{_brief(_ray_resources())}). Fix: lower num_nodes / num_gpus_per_node to match, or {fix}."
        )
    return tuple(node["NodeID"] for node in fitting[: cluster.num_nodes])


def _ray_resources(*, available: bool = False) -> dict[str, float]:
    """``ray.cluster_resources()`` (or ``available_resources()``), typed (Ray leaves them unannotated)."""
    query = ray.available_resources if available else ray.cluster_resources
    return dict(query())  # type: ignore[no-untyped-call]


def _ray_nodes() -> list[dict[str, Any]]:
    """``ray.nodes()``, typed (Ray leaves it unannotated)."""
    return list(ray.nodes())  # type: ignore[no-untyped-call]


def _brief(resources: dict[str, float]) -> dict[str, float]:
    """Resources without memory sizes, ``node:<ip>`` markers and placement-group bundles, for readable errors."""
    skip = ("memory", "object_store_memory")
    return {
        key: value
        for key, value in sorted(resources.items())
        if key not in skip and not key.startswith("node:") and not _BUNDLE_RESOURCE.search(key)
    }


def scheduling_options(
    pool: ResourcePool, worker: WorkerPlacement, *, env_vars: dict[str, str] | None = None
) -> dict[str, Any]:
    """``ActorClass.options(**kwargs)`` that place ``worker`` on its node's group, at its first local device.

    The actor asks for no CPU and ``ACTOR_DEVICE_FRACTION`` of the bundle's device, so colocated roles share
    bundles. On GPU, ``CUDA_VISIBLE_DEVICES`` lists all of the worker's local devices (a tensor-parallel inference
    worker sees every GPU it owns) and ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` stops Ray from narrowing it
    to the one bundle's GPU. This assumes the pool owns whole nodes, so local device ``i`` is physical GPU ``i``.
    ``env_vars`` (e.g. ``system_envs``) go into the runtime env too, so they are set before the actor imports
    anything; the CUDA variables above take precedence over them.
    """
    if not pool.placement_groups:
        raise RuntimeError(f"{pool!r} was removed; create a new ResourcePool before placing workers.")
    per_node = pool.cluster.num_gpus_per_node
    if not 0 <= worker.node_rank < pool.cluster.num_nodes or any(i >= per_node for i in worker.local_device_ids):
        raise PlacementError(
            f"worker rank {worker.rank} is planned on node {worker.node_rank}, local devices "
            f"{list(worker.local_device_ids)}, outside this pool (num_nodes={pool.cluster.num_nodes}, "
            f"num_gpus_per_node={per_node}). Fix: plan the placement with the same ClusterSpec as the pool."
        )
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=pool.placement_groups[worker.node_rank],
        placement_group_bundle_index=worker.local_device_ids[0],
    )
    options: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": strategy}
    env = dict(env_vars or {})
    if pool.use_gpu:
        options["num_gpus"] = ACTOR_DEVICE_FRACTION
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in worker.local_device_ids)
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    else:
        options["resources"] = {pool.device_resource: ACTOR_DEVICE_FRACTION}
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


def node_ip() -> str:
    """IP address of the node this process runs on, as Ray sees it."""
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


# Ray's own listeners take 10002-19999 (worker ports) and a few fixed ports below; the kernel hands out outgoing
# connections' source ports from ip_local_port_range (32768-60999 on Linux by default). A rendezvous port between the
# two can be taken again between its pick and its bind only by another explicit bind, never by a connection.
_RENDEZVOUS_LOW = 20000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that is free on this node now, for a server another process binds a moment later.

    Picked at random below the kernel's ephemeral range (so that no outgoing connection, Ray's included, can take
    it before the server binds it: the EADDRINUSE a port picked by ``bind(0)`` met) and never the same one twice in
    a process; the OS picks when that range is too narrow or full.
    """
    high = _ephemeral_low()
    if high - _RENDEZVOUS_LOW >= 1024:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_RENDEZVOUS_LOW, high)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _node_ip_and_free_port() -> tuple[str, int]:
    return node_ip(), free_port()


def rendezvous_address(pool: ResourcePool, worker: WorkerPlacement, *, timeout_s: float) -> tuple[str, int]:
    """``(ip, free port)`` on ``worker``'s node, for ``MASTER_ADDR`` / ``MASTER_PORT`` of a group it leads.

    Found on the driver when the worker's node is the driver's, else by a tiny task placed like the worker.
    """
    if pool.node_ids[worker.node_rank] == ray.get_runtime_context().get_node_id():
        return _node_ip_and_free_port()
    probe = ray.remote(_node_ip_and_free_port).options(**scheduling_options(pool, worker)).remote()
    try:
        ip, port = ray.get(probe, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"no answer within {timeout_s}s from node {worker.node_rank} (Ray node {pool.node_ids[worker.node_rank]}) "
            "when picking the rendezvous address (MASTER_ADDR / MASTER_PORT) of its workers. Fix: check that the "
            "node is alive (`ray status`) and that its raylet log shows no errors, or raise start_timeout."
        ) from None
    return str(ip), int(port)

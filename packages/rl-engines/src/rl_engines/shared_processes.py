"""Roles that share worker processes: a rank of an inference role on exactly the devices of a rank of another role
runs inside that rank's Ray actor instead of a process of its own, as verl's fused workers do.

A process per rank costs an interpreter and the torch / transformers imports (seconds of CPU each) and, on a GPU, a
CUDA context per device. Colocated roles only ever take turns on their devices (generation ahead of training needs
devices of its own), so sharing serialises nothing that ran concurrently. It is planned only where the results are
those of separate processes:

- the guest's strategy needs no process group and no process-wide engine state (``shares_process = True`` on the
  strategy class: ``hf_infer``, whose ranks never talk to each other, so some may share while others run alone);
- the host is a training role, or a role whose strategy shares too, with a rank on the same devices (same node,
  same device ids) and the same ``system_envs``;
- ``actor_infer`` is hosted only by ``actor_train``: a weight sync loads a hosted rank in process, from its host
  rank (every train rank holds the full weights while a sync iterates them);
- a guest keeps its own random streams (torch CPU and CUDA, Python's, NumPy's) and rank variables (``RANK``,
  ``WORLD_SIZE``, ...): the host's are swapped out around every call of the guest, so neither sees the other's.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rl_engines.config import WorkerConfig
from rl_engines.placement import PlacementPlan, RolePlacement

SYNCED_GUEST_HOSTS = {"actor_infer": "actor_train"}
"""A guest that receives weight syncs -> the only role that may host it (the sync's sender)."""


def _strategy_class(config: WorkerConfig) -> Any:
    from rl_engines.strategies import STRATEGIES

    return STRATEGIES.get(config.strategy_args.strategy_name)


def shares_process(config: WorkerConfig) -> bool:
    """Whether the role's strategy can run as a guest in another role's process."""
    return bool(getattr(_strategy_class(config), "shares_process", False))


def _can_host(config: WorkerConfig) -> bool:
    return _strategy_class(config).kind == "train" or shares_process(config)


@dataclass(frozen=True)
class Guest:
    """Where a guest role's shared ranks run: in ``host``'s processes, guest rank -> host rank (ranks missing from
    ``ranks`` have processes of their own)."""

    host: str
    ranks: dict[int, int]


@dataclass(frozen=True)
class HostedRole:
    """What a host's worker needs to run a guest role's rank: its config and world size, host rank -> guest rank."""

    config: WorkerConfig
    world_size: int
    ranks: dict[int, int]


def _shared_ranks(host: RolePlacement, guest: RolePlacement) -> dict[int, int]:
    """Guest rank -> the host rank on the very same devices."""
    if host.num_gpus_per_worker != guest.num_gpus_per_worker:
        return {}
    by_devices = {(w.node_rank, w.global_device_ids): w.rank for w in host.workers}
    found = {w.rank: by_devices.get((w.node_rank, w.global_device_ids)) for w in guest.workers}
    return {rank: host_rank for rank, host_rank in found.items() if host_rank is not None}


def plan_sharing(
    plan: PlacementPlan, configs: Mapping[str, WorkerConfig], envs: Mapping[str, Mapping[str, str]]
) -> dict[str, Guest]:
    """Guest role -> where its shared ranks run (see the module's rules). Training roles are considered as hosts
    first, then the others in config order; ``envs`` are each role's ``system_envs`` as its workers get them."""
    hosts: list[str] = []
    guests: dict[str, Guest] = {}
    for name in sorted(configs, key=lambda n: _strategy_class(configs[n]).kind != "train"):
        if shares_process(configs[name]):
            fits = [Guest(h, ranks) for h in hosts if SYNCED_GUEST_HOSTS.get(name, h) == h and envs[h] == envs[name]
                    and (ranks := _shared_ranks(plan.roles[h], plan.roles[name]))]  # fmt: skip
            if fits:
                guests[name] = fits[0]
                continue
        if _can_host(configs[name]):
            hosts.append(name)
    return guests


def hosted_roles(guests: Mapping[str, Guest], host: str, plan: PlacementPlan,
                 configs: Mapping[str, WorkerConfig]) -> dict[str, HostedRole]:  # fmt: skip
    """The guests whose ranks run in ``host``'s workers, as those workers are told."""
    return {name: HostedRole(configs[name], plan.roles[name].world_size, {h: g for g, h in guest.ranks.items()})
            for name, guest in guests.items() if guest.host == host}  # fmt: skip


@dataclass
class _Streams:
    torch_cpu: Any
    torch_cuda: list[Any] | None
    python: Any
    numpy: Any


def _capture() -> _Streams:
    import numpy as np
    import torch

    started = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if started else None
    return _Streams(torch.get_rng_state(), cuda, random.getstate(), np.random.get_state())  # noqa: NPY002 (global)


def _restore(streams: _Streams) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(streams.torch_cpu)
    if streams.torch_cuda is not None:
        torch.cuda.set_rng_state_all(streams.torch_cuda)
    random.setstate(streams.python)
    np.random.set_state(streams.numpy)  # noqa: NPY002 (the process's global stream is what is swapped)


class GuestContext:
    """A guest rank's random streams and rank variables, made the process's for each of its calls (``active()``).

    ``variables``: the environment variables that differ between the guest and its host (``RANK``, ...)."""

    def __init__(self, variables: Mapping[str, str]) -> None:
        self._streams = _capture()
        self._variables = dict(variables)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The guest's streams and variables in, the host's saved; on the way out the reverse."""
        outer_streams, outer_env = _capture(), {name: os.environ.get(name) for name in self._variables}
        _restore(self._streams)
        os.environ.update(self._variables)
        try:
            yield
        finally:
            self._streams = _capture()
            _restore(outer_streams)
            for name, value in outer_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

"""Reward sections on Ray: ``world_size`` CPU actors for every ``rewards.<name>`` section that sets it (ROLL's
reward workers), each holding the section's reward function and ``RewardSpec``.

``RewardWorkers.score_async`` splits a section's samples into contiguous chunks over its actors and returns an
``rl_engines.worker_group.GroupFuture``, so timeouts, dead actors and exceptions raise the project's worker errors
naming ``rewards.<name>``, the rank and the remote traceback. The function object itself is sent to the actors
(Ray cloudpickles it), so functions registered in a user's script work there too.
"""

from __future__ import annotations

from typing import Any

import ray

from apps.rlvr.config import RewardConfig, RewardSpec
from apps.rlvr.rewards import Grade, RewardFn, graded_rows, worker_counts
from rl_engines.worker_group import GroupFuture, WorkerError

SCORE_METHOD = "score"
"""The actor method ``score_async`` calls (named in worker errors)."""


class RewardActor:
    """One actor of a reward section (a plain class; ``RewardWorkers`` wraps it with ``ray.remote(num_cpus=0)``)."""

    def __init__(self, name: str, rank: int, function: RewardFn, spec: RewardSpec) -> None:
        self.name, self.rank, self.function, self.spec = name, rank, function, spec

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with its repr: "(rewards.math_rule_rank1 pid=...)".
        return f"rewards.{self.name}_rank{self.rank}"

    def ping(self) -> int:
        """Answer with this actor's rank (start-up and liveness check)."""
        return self.rank

    def score(self, texts: list[str], records: list[dict[str, Any]], lengths: list[int]) -> list[Grade]:
        """The grade of every response (its reward less the length penalty); ``lengths`` are response tokens."""
        return graded_rows(self.function, texts, records, self.spec, lengths)


def chunk_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of contiguous, non-empty chunks of ``count`` items over at most ``parts`` chunks.

    Sizes differ by at most one, larger chunks first: ``chunk_bounds(5, 2) == [(0, 3), (3, 5)]``.
    """
    used = min(count, parts)
    bounds: list[tuple[int, int]] = []
    start = 0
    for index in range(used):
        end = start + count // used + (1 if index < count % used else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _concat(chunks: list[list[Grade]]) -> list[Grade]:
    return [grade for chunk in chunks for grade in chunk]


class RewardWorkers:
    """``worker.world_size`` Ray actors for every section that sets it; needs a running Ray.

    ``system_envs`` reach the actors as runtime-env variables (set before they import anything); every call,
    start-up included, may take ``rpc_timeout`` seconds.
    """

    def __init__(
        self,
        sections: dict[str, RewardConfig],
        functions: dict[str, RewardFn],
        *,
        rpc_timeout: float,
        system_envs: dict[str, str],
    ) -> None:
        self._world_sizes = worker_counts(sections)
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)) or rpc_timeout <= 0:
            raise ValueError(f"rewards: rpc_timeout must be a positive number of seconds, got {rpc_timeout!r}.")
        if self._world_sizes and not ray.is_initialized():
            raise RuntimeError("reward workers need a running Ray; call rl_engines.ray_cluster.start_ray() first.")
        self._rpc_timeout = float(rpc_timeout)
        options: dict[str, Any] = {"runtime_env": {"env_vars": dict(system_envs)}} if system_envs else {}
        actor_cls = ray.remote(num_cpus=0)(RewardActor).options(**options)
        self._actors: dict[str, list[Any]] = {
            name: [actor_cls.remote(name, rank, functions[name], sections[name].spec) for rank in range(size)]
            for name, size in self._world_sizes.items()
        }
        self._wait_started()

    def _wait_started(self) -> None:
        """Ping every actor at once; on any failure kill them all and raise the worker error."""
        try:
            futures = [
                GroupFuture(
                    [actor.ping.remote() for actor in actors],
                    list(range(len(actors))),
                    list,
                    f"rewards.{name}",
                    "__init__ (worker start-up)",
                    self._rpc_timeout,
                )
                for name, actors in self._actors.items()
            ]
            for future in futures:
                future.get()
        except BaseException:
            self.shutdown()
            raise

    @property
    def world_sizes(self) -> dict[str, int]:
        """Actors per worker-backed section, by section name."""
        return dict(self._world_sizes)

    @property
    def actors(self) -> dict[str, tuple[Any, ...]]:
        """Ray actor handles in rank order, by section name (empty after ``shutdown``)."""
        return {name: tuple(actors) for name, actors in self._actors.items()}

    def __contains__(self, section_name: object) -> bool:
        """True when ``section_name`` is scored by live actors."""
        return section_name in self._actors

    def score_async(
        self, section_name: str, texts: list[str], records: list[dict[str, Any]], lengths: list[int]
    ) -> GroupFuture:
        """Start scoring on the section's actors, contiguous chunks in rank order; ``get()`` gives the grades."""
        role = f"rewards.{section_name}"
        if section_name not in self._world_sizes:
            raise ValueError(
                f"{role} has no Ray workers (world_size is unset, or no such section); "
                f"sections with workers: {sorted(self._world_sizes)}."
            )
        if section_name not in self._actors:
            message = f"{role}: the reward workers are shut down; create new RewardWorkers to call `{SCORE_METHOD}`."
            raise WorkerError(message, role, SCORE_METHOD, [])
        if not len(texts) == len(records) == len(lengths):
            raise ValueError(
                f"{role}: one record and one length per text needed, got {len(texts)} texts, "
                f"{len(records)} records and {len(lengths)} lengths."
            )
        actors = self._actors[section_name]
        bounds = chunk_bounds(len(texts), len(actors))
        refs = [
            actors[rank].score.remote(texts[start:end], records[start:end], lengths[start:end])
            for rank, (start, end) in enumerate(bounds)
        ]
        return GroupFuture(refs, list(range(len(bounds))), _concat, role, SCORE_METHOD, self._rpc_timeout)

    def shutdown(self) -> None:
        """Kill every actor (idempotent). Later ``score_async`` calls raise ``WorkerError``."""
        actors, self._actors = self._actors, {}
        if not ray.is_initialized():
            return
        for section in actors.values():
            for actor in section:
                ray.kill(actor, no_restart=True)

    def __repr__(self) -> str:
        return f"RewardWorkers({self._world_sizes}, live={bool(self._actors)})"

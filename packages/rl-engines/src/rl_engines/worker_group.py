"""A role's Ray actors, one per rank, and the driver's calls on all of them at once.

``group.call(method, *args, dispatch=...)`` calls a ``WorkerBase`` method; the dispatch mode (registry
``DISPATCH_MODES``) picks the ranks, splits the arguments and combines the results. Every call honours
``rpc_timeout`` (ROLL's key, seconds) and waits on all ranks with ``ray.wait``, never ``ray.get`` in rank order,
so a dead rank 1 fails the call at once even while rank 0 hangs in a collective waiting for it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from rl_core.registry import Registry
from rl_engines.placement import RolePlacement
from rl_engines.ray_cluster import ResourcePool, free_port, node_ip, rendezvous_address, scheduling_options
from rl_engines.shared_processes import GuestContext

DEFAULT_START_TIMEOUT_S = 300.0
"""Seconds a group may take to start its workers (process start, imports, ``__init__``) unless told otherwise."""


class WorkerError(RuntimeError):
    """A worker call failed; ``role``, ``method`` and ``ranks`` say where."""

    def __init__(self, message: str, role: str, method: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.role, self.method, self.ranks = role, method, ranks


class WorkerTimeoutError(WorkerError):
    """Some ranks did not answer within ``rpc_timeout``; the calls may still be running on them."""


class WorkerDiedError(WorkerError):
    """A worker process died (or Ray lost it) during the call; ``__cause__`` is Ray's exception."""


class WorkerCallError(WorkerError):
    """The worker method raised; ``remote_traceback`` holds the worker-side traceback text.

    ``follows_another_rank``: the rank raised only because another rank of the same collective failed (a save
    abandoned on every rank); the group reports the failing rank's error before such ones.
    """

    def __init__(self, message: str, role: str, method: str, ranks: list[int], remote_traceback: str) -> None:
        super().__init__(message, role, method, ranks)
        self.remote_traceback = remote_traceback
        self.follows_another_rank = False


def rank_variables(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment variables that place a worker in its role's ``torch.distributed`` world."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port)}  # fmt: skip


class WorkerBase:
    """Base of the actor classes a ``WorkerGroup`` starts (a plain class; the group wraps it with ``ray.remote``).

    ``env`` (the config's ``system_envs``) is applied to ``os.environ`` first; then ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set for ``torch.distributed``. ``LOCAL_RANK`` is 0
    because each worker sees only its own devices (``CUDA_VISIBLE_DEVICES``), so its first device is index 0.
    Subclasses take extra arguments after these six and add the methods the group calls.
    """

    def __init__(
        self, role: str, rank: int, world_size: int, master_addr: str, master_port: int, env: dict[str, str]
    ) -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        self.master_addr, self.master_port = master_addr, master_port
        os.environ.update(env)  # first, so that a stray RANK in system_envs cannot override the group's own
        os.environ.update(rank_variables(rank, world_size, master_addr, master_port))
        self.guests: dict[str, tuple[WorkerBase, GuestContext]] = {}
        """Ranks of other roles hosted in this process (:mod:`rl_engines.shared_processes`), by role."""

    def call_guest(self, role: str, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the guest ``role``'s rank hosted in this process, under its random streams and rank
        variables."""
        guest, streams = self.guests[role]
        with streams.active():
            return getattr(guest, method)(*args, **kwargs)

    def pid(self) -> int:
        """This worker's process id (roles sharing processes answer alike)."""
        return os.getpid()

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with its repr: "(actor_train_rank1 pid=...)".
        return f"{self.role}_rank{self.rank}"

    def init_process_group(self, backend: str | None = None, timeout_s: float | None = None) -> None:
        """Join the role's ``torch.distributed`` group (gloo on CPU, nccl on GPU unless ``backend`` is given).

        ``timeout_s`` bounds every collective of the group (torch's default when None: 10 min nccl, 30 min gloo).
        """
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
        )

    def destroy_process_group(self) -> None:
        """Leave the ``torch.distributed`` group (no-op when not in one)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def get_env(self, name: str) -> str | None:
        """The worker's environment variable ``name`` (None when unset)."""
        return os.environ.get(name)

    def ping(self) -> int:
        """Answer with this worker's rank (liveness check)."""
        return self.rank

    def node_ip(self) -> str:
        """IP address of the node this worker runs on."""
        return node_ip()

    def node_id(self) -> str:
        """Ray node id (hex) of the node this worker runs on; tells simulated nodes of one host apart."""
        return str(ray.get_runtime_context().get_node_id())

    @staticmethod
    def free_port() -> int:
        """A TCP port that is free on this node right now (the OS picks it)."""
        return free_port()


Call = tuple[int, tuple[Any, ...], dict[str, Any]]
"""One remote call: (rank, positional args, keyword args)."""


@dataclass(frozen=True)
class DispatchMode:
    """How one group call reaches the ranks and how their results come back."""

    scatter: Callable[[int, tuple[Any, ...], dict[str, Any]], list[Call]]
    """``(world_size, args, kwargs) -> calls``; raises ``TypeError`` / ``ValueError`` on arguments it cannot split."""
    gather: Callable[[list[Any]], Any]
    """Results of the calls, in call order -> the value ``WorkerGroup.call`` returns."""


DISPATCH_MODES: Registry[DispatchMode] = Registry("dispatch mode", "dispatch")
"""Dispatch modes by name; register new ones with ``DISPATCH_MODES.register(name)(DispatchMode(...))``."""


def _share(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Put values that every rank receives into the object store once, instead of serialising them per rank."""

    def put(value: Any) -> Any:
        return value if value is None or isinstance(value, (bool, int, float, str, ray.ObjectRef)) else ray.put(value)

    return tuple(put(value) for value in args), {key: put(value) for key, value in kwargs.items()}


def _scatter_one_to_all(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call]:
    if world_size > 1:
        args, kwargs = _share(args, kwargs)
    return [(rank, args, kwargs) for rank in range(world_size)]


def _scatter_rank_zero(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call]:
    return [(0, args, kwargs)]


# rl_core.batch (torch) is imported where used, so worker processes that never touch a batch skip loading torch.
def _scatter_dp_split(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call]:
    from rl_core.batch import RolloutBatch

    if not args or not isinstance(args[0], RolloutBatch):
        got = type(args[0]).__name__ if args else "no positional argument"
        raise TypeError(f"needs a RolloutBatch as the first positional argument (split across ranks), got {got}")
    chunks = args[0].chunk(world_size)
    rest, kwargs = _share(args[1:], kwargs)
    return [(rank, (chunk, *rest), kwargs) for rank, chunk in enumerate(chunks)]


def _gather_dp_split(results: list[Any]) -> Any:
    from rl_core.batch import RolloutBatch

    if results and all(isinstance(result, RolloutBatch) for result in results):
        return RolloutBatch.concat(results)
    return results


def _scatter_all_ranks_list(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call]:
    named = {**{f"positional argument {i}": value for i, value in enumerate(args)}, **kwargs}
    for name, value in named.items():
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            length = f" of length {len(value)}" if isinstance(value, (list, tuple)) else ""
            shown = f"a {type(value).__name__}{length}"
            raise ValueError(f"every argument must be a list of one element per rank ({world_size}); {name} is {shown}")
    return [
        (rank, tuple(value[rank] for value in args), {key: value[rank] for key, value in kwargs.items()})
        for rank in range(world_size)
    ]


DISPATCH_MODES.register("one_to_all")(DispatchMode(_scatter_one_to_all, list))
DISPATCH_MODES.register("rank_zero")(DispatchMode(_scatter_rank_zero, lambda results: results[0]))
DISPATCH_MODES.register("dp_split")(DispatchMode(_scatter_dp_split, _gather_dp_split))
DISPATCH_MODES.register("all_ranks_list")(DispatchMode(_scatter_all_ranks_list, list))


_ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the task name in its error text
PEER_GRACE_S = 10.0
"""Seconds a call whose only errors so far follow another rank's failure waits for that rank's own error."""


def _cause_line(exc: RayError, text: str) -> str:
    """``Type: message`` of the exception the worker raised (Ray's ``cause``), else the last line of its text."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def _fetch_error(ref: ray.ObjectRef[Any], rank: int, role: str, method: str) -> WorkerError | None:
    """The error of a finished call as a ``WorkerError`` whose ``__cause__`` is Ray's (None when it succeeded)."""
    try:
        ray.get(ref)
    except RayError as exc:
        error: WorkerError
        # Ray reports an exception raised in __init__ as a dead actor whose init failed: still the worker's own error.
        if isinstance(exc, RayTaskError) or (isinstance(exc, RayActorError) and exc.actor_init_failed):
            # The cause first and once: the worker's traceback prints above this error (its __cause__), not in it.
            text = _ANSI_COLOR.sub("", str(exc))
            message = (
                f"{role}: rank {rank} raised in `{method}`: {_cause_line(exc, text)}\n"
                "(the worker's traceback is printed above, and kept in .remote_traceback)"
            )
            error = WorkerCallError(message, role, method, [rank], text)
            error.follows_another_rank = bool(getattr(getattr(exc, "cause", None), "follows_another_rank", False))
        else:
            what = "died" if isinstance(exc, RayActorError) else f"was lost by Ray ({type(exc).__name__})"
            message = (
                f"{role}: rank {rank} {what} during `{method}`: {exc}\nFix: check the worker log for the crash "
                "(OOM kill, segfault, os._exit); the group cannot continue, shut it down and start a new one."
            )
            error = WorkerDiedError(message, role, method, [rank])
        error.__cause__ = exc
        return error
    return None


def _timeout_error(future: GroupFuture, late: list[int], answered: list[int]) -> WorkerError:
    role, method, key = future.role, future.method, future.timeout_key
    message = (
        f"{role}: rank(s) {late} did not answer `{method}` within {key}={future.rpc_timeout}s "
        f"(rank(s) {answered} answered); the call may still be running there (a slow step, a deadlock, or a "
        f"collective waiting for a rank that never joined). Fix: raise {key} if the step is legitimately "
        "slow, or check the worker log of those ranks for a hang; shut the group down before reusing its devices."
    )
    return WorkerTimeoutError(message, role, method, late)


@dataclass
class GroupFuture:
    """Pending results of one group call; ``get()`` waits for what is left of ``rpc_timeout``.

    ``refs[i]`` is the call made on rank ``ranks[i]``; ``gather`` (the dispatch mode's) combines their results;
    ``role`` and ``method`` name the call in errors; the ``rpc_timeout`` seconds count from the future's creation;
    ``timeout_key`` is the config key that set it (named in the timeout error).
    """

    refs: list[ray.ObjectRef[Any]]
    ranks: list[int]
    gather: Callable[[list[Any]], Any]
    role: str
    method: str
    rpc_timeout: float
    timeout_key: str = "rpc_timeout"
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.rpc_timeout

    def done(self) -> bool:
        """True when every rank has answered (successfully or not); never blocks."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def get(self) -> Any:
        """The gathered result; raises ``WorkerTimeoutError``, ``WorkerDiedError`` or ``WorkerCallError``.

        Waits on all ranks at once and raises for the first failing rank (a dead rank before ranks whose calls
        raised, since a death usually breaks its peers' collectives) without waiting for the others; only when
        every error so far merely follows another rank's failure does it wait (up to ``PEER_GRACE_S``) for that
        rank's own error, so that the cause is what the driver shows.
        """
        rank_of = {ref: rank for ref, rank in zip(self.refs, self.ranks)}
        pending = list(self.refs)
        errors: list[WorkerError] = []
        while pending:
            deadline = self.deadline if not errors else min(self.deadline, time.monotonic() + PEER_GRACE_S)
            first, _ = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not first and errors:
                break
            if not first:
                late = sorted(rank_of[ref] for ref in pending)
                answered = sorted(set(self.ranks) - set(late))
                raise _timeout_error(self, late, answered)
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            errors += [error for ref in ready if (error := _fetch_error(ref, rank_of[ref], self.role, self.method))]
            if errors and not all(getattr(error, "follows_another_rank", False) for error in errors):
                break
        if errors:
            raise min(errors, key=_error_order)
        return self.gather(list(ray.get(self.refs)))


def _error_order(error: WorkerError) -> tuple[bool, bool, list[int]]:
    """Which of a call's errors the driver raises: a dead rank, then a rank's own error, then the lowest rank."""
    return not isinstance(error, WorkerDiedError), getattr(error, "follows_another_rank", False), error.ranks


def _check_group_args(
    role: str, worker_cls: object, timeouts: dict[str, float], envs: dict[str, str] | None
) -> dict[str, str]:
    """Validate the group's arguments before any actor starts; returns ``system_envs`` as a dict."""
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, WorkerBase)):
        raise TypeError(f"{role}: worker_cls must be a WorkerBase subclass (a plain class), got {worker_cls!r}.")
    for key, seconds in timeouts.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(f"{role}: {key} must be a positive number of seconds, got {seconds!r}.")
    checked = dict(envs or {})
    for name, value in checked.items():
        if not (isinstance(name, str) and isinstance(value, str)):
            raise TypeError(
                f"{role}.system_envs[{name!r}] = {value!r}: environment variables must be strings. "
                "Fix: quote the value in the config (e.g. '1' instead of 1)."
            )
    return checked


class WorkerGroup:
    """``placement.world_size`` actors of ``worker_cls`` for one role, started in rank order on ``pool``.

    ``system_envs`` reach every worker twice: in the actor's runtime env (so variables read at import time see
    them) and through ``WorkerBase.__init__``. Starting (processes, imports, ``__init__``) may take
    ``start_timeout`` seconds; every later call ``rpc_timeout`` seconds. With ``wait=False`` the constructor returns
    once the actors are requested, so that several groups start at once; ``wait_started()`` then waits for them.
    ``hosted`` (rank -> a running actor of another role that was given this rank as a guest, see
    :mod:`rl_engines.shared_processes`): those ranks start no process; their calls go to the host's ``call_guest``.
    """

    def __init__(
        self,
        role: str,
        worker_cls: type[WorkerBase],
        placement: RolePlacement,
        pool: ResourcePool,
        *,
        rpc_timeout: float,
        system_envs: dict[str, str] | None = None,
        init_args: tuple[Any, ...] = (),
        init_kwargs: dict[str, Any] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        wait: bool = True,
        hosted: dict[int, Any] | None = None,
    ) -> None:
        timeouts = {"rpc_timeout": rpc_timeout, "start_timeout": start_timeout}
        envs = _check_group_args(role, worker_cls, timeouts, system_envs)
        self._role, self._worker_cls, self._rpc_timeout = role, worker_cls, float(rpc_timeout)
        self._world_size = placement.world_size
        self._actors: list[Any] = []
        self._starting: GroupFuture | None = None
        self._routes: list[tuple[Any, bool]] = []  # per rank: (actor, whether the rank is a guest in it)
        try:
            addr, port = rendezvous_address(pool, placement.workers[0], timeout_s=start_timeout)
            actor_cls = ray.remote(worker_cls)
            for worker in placement.workers:
                if worker.rank in (hosted or {}):  # a guest in another role's actor, which already runs
                    self._routes.append(((hosted or {})[worker.rank], True))
                    continue
                args = (role, worker.rank, placement.world_size, addr, port, envs, *init_args)
                options = scheduling_options(pool, worker, env_vars=envs)
                self._actors.append(actor_cls.options(**options).remote(*args, **(init_kwargs or {})))
                self._routes.append((self._actors[-1], False))
            own = [rank for rank, (_, hosted) in enumerate(self._routes) if not hosted]
            pings = [self._routes[rank][0].ping.remote() for rank in own]
            label = "__init__ (worker start-up)"
            self._starting = GroupFuture(pings, own, list, role, label, start_timeout, "start_timeout")
            if wait:
                self.wait_started()
        except BaseException:
            self.shutdown()
            raise

    def wait_started(self) -> None:
        """Wait until every worker started (imports and ``__init__`` done); raises as a call would, naming
        ``start_timeout``. A no-op once they have."""
        starting, self._starting = self._starting, None
        if starting is not None:
            starting.get()

    @property
    def role(self) -> str:
        """Role name, as in error messages."""
        return self._role

    @property
    def rpc_timeout(self) -> float:
        """Seconds every call may take (ROLL ``rpc_timeout``)."""
        return self._rpc_timeout

    @property
    def world_size(self) -> int:
        """Number of workers (ranks)."""
        return self._world_size

    @property
    def actors(self) -> tuple[Any, ...]:
        """Ray actor handles in rank order, a hosted rank's being its host's (empty after ``shutdown``)."""
        return tuple(actor for actor, _ in self._routes)

    @property
    def hosted_ranks(self) -> frozenset[int]:
        """Ranks running in another role's actors (``hosted``; see :mod:`rl_engines.shared_processes`)."""
        return frozenset(rank for rank, (_, hosted) in enumerate(self._routes) if hosted)

    def call(self, method: str, /, *args: Any, dispatch: str = "one_to_all", **kwargs: Any) -> Any:
        """Call ``method`` on the ranks chosen by ``dispatch`` and block for the gathered result."""
        return self.call_async(method, *args, dispatch=dispatch, **kwargs).get()

    def call_async(self, method: str, /, *args: Any, dispatch: str = "one_to_all", **kwargs: Any) -> GroupFuture:
        """Start ``method`` on the ranks chosen by ``dispatch`` (a ``DISPATCH_MODES`` name) and return at once."""
        if not self._routes:
            message = f"{self._role}: the worker group is shut down; create a new WorkerGroup to call `{method}`."
            raise WorkerError(message, self._role, method, [])
        if not callable(getattr(self._worker_cls, method, None)):
            raise AttributeError(f"{self._role}: {self._worker_cls.__name__} has no method `{method}` to call.")
        mode = DISPATCH_MODES.get(dispatch)
        try:
            calls = mode.scatter(self.world_size, args, kwargs)
        except (TypeError, ValueError) as exc:  # same kind of error (BatchSizeError stays one), naming the call
            from rl_core.batch import BatchSizeError

            kind = next(k for k in (BatchSizeError, TypeError, ValueError) if isinstance(exc, k))
            raise kind(f"{self._role}.{method} (dispatch='{dispatch}'): {exc}") from exc
        refs = [self.remote(rank, method, *a, **kw) for rank, a, kw in calls]
        return GroupFuture(refs, [rank for rank, _, _ in calls], mode.gather, self._role, method, self._rpc_timeout)

    def remote(self, rank: int, method: str, /, *args: Any, **kwargs: Any) -> ray.ObjectRef[Any]:
        """Start ``method`` on one rank; the reference to its result (no timeout, no error translation)."""
        actor, hosted = self._routes[rank]
        if not hosted:
            return getattr(actor, method).remote(*args, **kwargs)  # type: ignore[no-any-return]
        return actor.call_guest.remote(self._role, method, *args, **kwargs)  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        """Kill every worker (idempotent; hosted ranks go with their host's). Calls made afterwards raise
        ``WorkerError``."""
        actors, self._actors, self._routes = self._actors, [], []
        if not ray.is_initialized():
            return
        for actor in actors:
            ray.kill(actor, no_restart=True)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self._role!r}, {self._worker_cls.__name__}, world_size={self.world_size})"

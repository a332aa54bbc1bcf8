"""Test-harness fork server for Ray's Python workers. Never imported by product code.

Why: every Ray worker process of the test session imports ray, torch and transformers before it does any work (about
4 s of CPU on a 2-core machine), and the session starts a few hundred of them: most of the README test command's time
went to these imports, paid again in each process.

How: the harness's ``sitecustomize`` (this folder) calls :func:`intercept` at the start-up of every Python process of
the session. In a process that Ray started as a worker (``argv[0]`` is Ray's ``default_worker.py``) it connects to the
zygote of its exact start-up state: one process per (interpreter, flags, working directory, environment) that has
imported ``PRELOAD`` once, and that forks a child which runs ``default_worker.py`` as the worker would have. The first
worker of a state starts its zygote and waits for it. A worker whose state has no zygote yet, or whose zygote refuses
or fails, starts as usual: the zygote is an optimisation, never a requirement. ``RL_TEST_WORKER_ZYGOTE=0`` turns it off
(``tests/conftest.py`` sets ``1`` unless set).

The process Ray started stays as the worker's stand-in: it hands its stdin / stdout / stderr to the child, forwards
SIGTERM / SIGINT / SIGHUP / SIGQUIT / SIGUSR1 / SIGUSR2 to it and exits as the child exits (with its status, or by
its signal). The child joins the stand-in's process group (a signal to the group reaches both, as Ray's group signals
reach a worker) and kills itself when the stand-in dies (SIGKILL cannot be forwarded). Ray registers a worker by the
pid the worker reports, so Ray's own kills reach the child. A zygote exits with its raylet (``RAY_RAYLET_PID``) or
after ``IDLE_EXIT_S`` without children or requests.

What a forked worker shares with its zygote, unlike a fresh process: the modules imported before the fork (the same
code, run with the same environment) and Python's string-hash seed (every worker of one zygote iterates a set of
strings in the same order, where fresh processes differ). Python's and NumPy's global random streams are reseeded in
each child; torch's default generator starts from its fixed default seed in any process.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import signal
import socket
import sys
from typing import Any

SWITCH = "RL_TEST_WORKER_ZYGOTE"
"""``1``: Ray's workers start through a zygote; anything else: as usual."""
WORKER_SCRIPT = os.path.join("ray", "_private", "workers", "default_worker.py")
PRELOAD = (
    "ray._private.workers.default_worker",
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.qwen2.modeling_qwen2",
)
"""What every worker of the suite imports (a missing one is skipped: the vLLM venv, a partial install)."""
IDLE_EXIT_S = 120.0
CONNECT_WAIT_S = 10.0
"""How long a worker waits for the zygote it started to listen."""
FORK_WAIT_S = 60.0
"""How long a worker waits for its zygote's answer (the zygote's imports included) before it starts as usual."""
THREADS_VARIABLE = "OMP_NUM_THREADS"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MESSAGE_BYTES = 1 << 20


def intercept() -> None:
    """In a Ray worker's process, become a stand-in for a forked worker (never returns); elsewhere, return."""
    if os.environ.get(SWITCH) != "1" or not sys.argv or not sys.argv[0].endswith(WORKER_SCRIPT):
        return
    request = {"argv": list(sys.argv), "path": list(sys.path), "cwd": os.getcwd(), "env": dict(os.environ),
               "pgid": os.getpgid(0)}  # fmt: skip
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        _connect(connection, _address(request))
        connection.settimeout(FORK_WAIT_S)
        socket.send_fds(connection, [pickle.dumps(request)], [0, 1, 2])
        kind, value = pickle.loads(connection.recv(MESSAGE_BYTES))
    except (OSError, EOFError, pickle.UnpicklingError, ValueError) as error:
        _note(f"starting as usual: {error!r}")
        connection.close()  # a zygote that answers late finds it closed and forks nothing
        return
    if kind != "pid":
        _note(f"starting as usual: {value}")
        connection.close()
        return
    connection.settimeout(None)
    _stand_in(connection, int(value))


def _address(request: dict[str, Any]) -> bytes:
    """The zygote's abstract socket name for this start-up state (no file to clean up)."""
    flags = _interpreter_flags()
    state = repr((sys.executable, flags, request["cwd"], request["path"], sorted(request["env"].items())))
    return b"\0rl-worker-zygote-" + hashlib.sha256(state.encode()).hexdigest()[:32].encode()


def _interpreter_flags() -> list[str]:
    import subprocess

    return list(subprocess._args_from_interpreter_flags())  # type: ignore[attr-defined]


def _connect(connection: socket.socket, address: bytes) -> None:
    """Connect to the zygote at ``address``, started first if none listens."""
    import time

    try:
        connection.connect(address)
        return
    except ConnectionRefusedError:
        pass
    _start_zygote(address)
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        try:
            connection.connect(address)
            return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _start_zygote(address: bytes) -> None:
    import subprocess

    # The worker's own arguments follow: they name the zygote in process listings, and the title a forked worker
    # sets (setproctitle writes into argv's memory, SPT_NOENV) has as much room as the worker's own command line.
    command = [sys.executable, *_interpreter_flags(), __file__, address[1:].decode(), *sys.argv]
    subprocess.Popen(command, stdin=subprocess.DEVNULL, close_fds=True)


def _note(text: str) -> None:
    print(f"[worker_zygote pid={os.getpid()}] {text}", file=sys.stderr, flush=True)


def _stand_in(connection: socket.socket, child: int) -> None:
    """Wait for the forked worker ``child``, passing signals on; exit as it exited."""
    for number in FORWARDED:
        signal.signal(number, lambda number, frame: _forward(child, number))
    while True:
        data = connection.recv(MESSAGE_BYTES)
        if not data:  # the zygote is gone: wait for the child itself
            _wait_for(child)
            os._exit(0)
        kind, status = pickle.loads(data)
        if kind == "exit":
            _exit_as(status)


def _forward(child: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, number)


def _wait_for(pid: int) -> None:
    import select

    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    select.select([handle], [], [])
    os.close(handle)


def _exit_as(status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


class Job:
    """A forked child's work: become the worker that asked for it."""

    def __init__(self, request: dict[str, Any], fds: list[int], connection: socket.socket, script_dir: str) -> None:
        self.request, self.fds, self.connection, self.script_dir = request, fds, connection, script_dir

    def run(self) -> None:
        import runpy

        with contextlib.suppress(OSError):  # the stand-in's group is gone (it died): the watch below ends this process
            os.setpgid(0, self.request["pgid"])
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(self.request["cwd"])
        sys.argv[:] = self.request["argv"]
        # Where Python put the zygote's folder (what the imports added stays around it), the worker's goes
        slot = sys.path.index(self.script_dir) if self.script_dir in sys.path else 0
        sys.path[slot : slot + 1] = [os.path.dirname(os.path.realpath(sys.argv[0]))]
        _reseed()
        _follow_thread_count()
        _watch(self.connection)
        runpy.run_path(sys.argv[0], run_name="__main__")


def _reseed() -> None:
    """Fresh global random streams, as a fresh process has (Python's reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _follow_thread_count() -> None:
    """Where Ray gives a worker's task more than the one thread torch was loaded with, give torch as many."""
    utils = sys.modules.get("ray._private.utils")
    if utils is None:
        return
    original = utils.set_omp_num_threads_if_unset

    def set_omp_num_threads_if_unset() -> bool:
        changed = bool(original())
        torch = sys.modules.get("torch")
        count = os.environ.get(THREADS_VARIABLE, "1")
        if changed and torch is not None and count.isdigit() and int(count) != torch.get_num_threads():
            torch.set_num_threads(int(count))
        return changed

    utils.set_omp_num_threads_if_unset = set_omp_num_threads_if_unset


def _watch(connection: socket.socket) -> None:
    """Kill this process when its stand-in dies (the stand-in never writes: a read returns only at its end)."""
    import threading

    def watch() -> None:
        try:
            while connection.recv(64):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="worker-zygote-watch", daemon=True).start()


class Zygote:
    """The fork server of one start-up state; :meth:`serve` returns a :class:`Job` in each forked child."""

    def __init__(self, address: bytes) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(address)  # OSError when a zygote of this state runs already
        self.listener.listen(128)
        self.script_dir = sys.path[0]
        self.state = (list(sys.path[1:]), dict(os.environ), os.getcwd())
        self.children: dict[int, socket.socket] = {}
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        signal.signal(signal.SIGCHLD, lambda number, frame: None)
        signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)
        raylet = os.environ.get("RAY_RAYLET_PID", "")
        self.raylet = os.pidfd_open(int(raylet)) if raylet.isdigit() else None
        self.watched = [self.wake_read, *([self.raylet] if self.raylet is not None else [])]
        """What :meth:`serve` waits on beside the listener: a child's exit, the raylet's."""

    def preload(self) -> None:
        import gc
        import importlib

        # Ray sets OMP_NUM_THREADS (when unset) as a worker's first task starts, before the task imports torch:
        # 1 for a worker without CPUs, as every worker here. libgomp, OpenBLAS and torch read it as they load, so
        # they load under it; the children's environment is the worker's, without it (see _follow_thread_count).
        unset = THREADS_VARIABLE not in os.environ
        if unset:
            os.environ[THREADS_VARIABLE] = "1"
        for name in PRELOAD:
            with contextlib.suppress(Exception):  # a module this environment lacks: its workers import what they can
                importlib.import_module(name)
        if unset:
            del os.environ[THREADS_VARIABLE]
        gc.collect()
        gc.freeze()  # what is loaded now stays shared with the children (no writes by the collector's passes)
        sys.stdout.flush()
        sys.stderr.flush()

    def serve(self) -> Job | None:
        import select
        import time

        idle_since = time.monotonic()
        while True:
            ready, _, _ = select.select([self.listener, *self.watched], [], [], 1.0)
            if self.wake_read in ready:
                os.read(self.wake_read, 4096)
            self._reap()
            if self.raylet in ready:
                return None  # the raylet is gone, and its workers with it
            if self.listener in ready:
                job = self._fork_for(self.listener.accept()[0])
                if job is not None:
                    return job
            if self.children:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > IDLE_EXIT_S:
                return None

    def _fork_for(self, connection: socket.socket) -> Job | None:
        try:
            data, fds, _, _ = socket.recv_fds(connection, MESSAGE_BYTES, 3)
            request = pickle.loads(data)
        except (OSError, EOFError, pickle.UnpicklingError):
            connection.close()
            return None
        refusal = self._refusal(request, fds, connection)
        if refusal is not None:
            for fd in fds:
                os.close(fd)
            self._send(connection, ("refused", refusal))
            connection.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._become_child()
            return Job(request, fds, connection, self.script_dir)
        for fd in fds:
            os.close(fd)
        self.children[pid] = connection
        self._send(connection, ("pid", pid))
        return None

    def _refusal(self, request: dict[str, Any], fds: list[int], connection: socket.socket) -> str | None:
        if len(fds) != 3:
            return f"expected the worker's stdin / stdout / stderr, got {len(fds)} descriptors"
        if (request["path"], request["env"], request["cwd"]) != self.state:
            return "its start-up state differs from the zygote's"
        try:  # a worker that stopped waiting (FORK_WAIT_S) has started as usual: no second one for it
            if connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                return "the worker stopped waiting"
        except BlockingIOError:
            pass
        except OSError:
            return "the worker stopped waiting"
        return None

    def _become_child(self) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for handle in (*self.watched, self.wake_write):
            os.close(handle)
        self.listener.close()
        for other in self.children.values():
            other.close()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is not None:
                self._send(connection, ("exit", status))
                connection.close()

    @staticmethod
    def _send(connection: socket.socket, message: tuple[str, Any]) -> None:
        with contextlib.suppress(OSError):  # its stand-in is gone
            connection.send(pickle.dumps(message))


def main(address: str) -> None:
    try:
        zygote = Zygote(b"\0" + address.encode())
    except OSError:  # another zygote serves this state
        return
    os.setpgid(0, 0)  # out of the first worker's group: a signal to that group is not for the zygote
    zygote.preload()
    job = zygote.serve()
    if job is not None:
        job.run()  # the worker runs here, in the child; its exit is the process's


if __name__ == "__main__":
    main(sys.argv[1])

"""Run untrusted Python in isolated processes: the code sandbox behind ROLL's ``CodeSandboxRewardWorker``.

Each run gets a fresh temporary work dir (removed after), an empty environment, and a process that isolates itself
before the program's first line (``boot.py``): CPU-time, address-space, file-size and open-file limits; Landlock
(read-only access to the interpreter's files, the work dir and nothing else; TCP refused from Landlock ABI 4);
no capabilities; seccomp (no sockets or io_uring, no new processes, no exec, no signals or scheduling changes to
other processes, no metadata changes or truncation by path: the full list is in ``boot.py``). The parent enforces
the wall-clock limit and a disk quota for the work dir by killing the process group, and reads the output through
the files it opened (whatever the program does to their names). A timeout, a crash or a limit hit is a
``RunResult``, never a hang or an exception; only a sandbox that could not isolate itself raises ``SandboxError``
(then nothing ran). ``Sandbox.run_many`` grades a batch on a pool of ``workers`` processes at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BOOT = Path(__file__).with_name("boot.py")
SYSTEM_READABLE = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/share/zoneinfo", "/dev/null", "/dev/urandom")
"""Read-only besides the interpreter's own prefix: shared libraries of extension modules, time zones, devices."""


class SandboxError(RuntimeError):
    """The sandbox could not isolate a process (nothing ran); the message says which layer and why."""


SECCOMP_MACHINES = ("x86_64", "aarch64")


def missing_isolation() -> list[str]:
    """What this machine lacks for the sandbox's isolation (empty when every layer is available): probed in this
    process without changing it (Landlock's ABI version, seccomp mode, the machine's syscall table)."""
    import ctypes
    import platform

    missing = []
    if sys.platform != "linux":
        return [f"Linux (this is {sys.platform})"]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(444, None, 0, 1) < 1:  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
        missing.append("Landlock (Linux 5.13+ with Landlock enabled in the kernel's LSM list)")
    if libc.prctl(21, 0, 0, 0, 0) < 0:  # PR_GET_SECCOMP
        missing.append("seccomp")
    if platform.machine() not in SECCOMP_MACHINES:
        missing.append(f"a seccomp table for {platform.machine()!r} (x86_64 and aarch64 have one)")
    return missing


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    cpu_seconds: int = 10
    wall_seconds: float = 20.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    """Largest file it may write, stdout and stderr included (beyond: SIGXFSZ)."""
    open_files: int = 64
    output_bytes: int = 1 << 20
    """stdout / stderr read back at most."""
    disk_bytes: int = 64 << 20
    """All the work dir may hold (checked every ``poll_seconds``; past it, the run is killed)."""
    poll_seconds: float = 0.05


@dataclass(frozen=True)
class RunResult:
    """How a run ended: ``exit_code`` (negative: killed by that signal), ``timed_out`` (wall clock), output."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        """Exited 0 within the time."""
        return self.exit_code == 0 and not self.timed_out


class Sandbox:
    """A pool of ``workers`` concurrent sandboxed runs under ``limits``; ``python`` runs them (this interpreter)."""

    def __init__(self, limits: Limits | None = None, workers: int = 4, python: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"a sandbox needs at least one worker, got {workers}")
        self.limits = limits or Limits()
        self.workers = workers
        self.python = python or sys.executable
        self.readable = sorted({sys.base_prefix, sys.base_exec_prefix, *SYSTEM_READABLE})
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sandbox")

    def run(self, source: str, stdin: str = "") -> RunResult:
        """Run ``source`` as ``__main__`` with ``stdin``; returns how it ended."""
        workdir = Path(tempfile.mkdtemp(prefix="rl_sandbox_"))
        try:
            return self._run_in(workdir, source, stdin)
        finally:
            _remove(workdir)

    def run_many(self, jobs: list[tuple[str, str]]) -> list[RunResult]:
        """``run`` every ``(source, stdin)`` on the pool; results in order."""
        return list(self._pool.map(lambda job: self.run(*job), jobs))

    def close(self) -> None:
        """Stop the pool (runs in progress finish)."""
        self._pool.shutdown(wait=True)

    def _run_in(self, workdir: Path, source: str, stdin: str) -> RunResult:
        program = workdir / "solution.py"
        program.write_text(source)
        (workdir / "stdin.txt").write_text(stdin)
        ready_read, ready_write = os.pipe()
        spec = {"program": str(program), "readable": self.readable, "limits": asdict(self.limits),
                "ready_fd": ready_write}  # fmt: skip
        (workdir / "spec.json").write_text(json.dumps(spec))
        start = time.monotonic()
        with (
            open(workdir / "stdin.txt", "rb") as stdin_file,
            open(workdir / "stdout.txt", "w+b") as stdout_file,
            open(workdir / "stderr.txt", "w+b") as stderr_file,
        ):
            try:
                process = subprocess.Popen(
                    [self.python, "-I", "-S", str(BOOT), str(workdir / "spec.json")],
                    stdin=stdin_file, stdout=stdout_file, stderr=stderr_file, cwd=workdir,
                    env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True, pass_fds=(ready_write,),
                )  # fmt: skip
            finally:
                os.close(ready_write)
            timed_out = _wait(process, workdir, self.limits)
            stdout, stderr = _read(stdout_file, self.limits), _read(stderr_file, self.limits)
        with os.fdopen(ready_read, "rb") as ready:
            isolated = ready.read() == b"ready\n"
        if not isolated and not timed_out:
            raise SandboxError(f"the sandbox could not isolate the process, so nothing ran: {stderr.strip()[-2000:]}")
        return RunResult(process.returncode, stdout, stderr, timed_out, time.monotonic() - start)


def _wait(process: subprocess.Popen[bytes], workdir: Path, limits: Limits) -> bool:
    """Wait up to ``limits.wall_seconds``, killing the process group past it or once the work dir holds more than
    ``limits.disk_bytes``. Returns whether it was killed for time."""
    deadline = time.monotonic() + limits.wall_seconds
    while True:
        try:
            process.wait(timeout=limits.poll_seconds)
            return False
        except subprocess.TimeoutExpired:
            pass
        late = time.monotonic() > deadline
        if late or _tree_bytes(workdir) > limits.disk_bytes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return late


def _tree_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder`` (links not followed; unreadable entries skipped)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _read(file: Any, limits: Limits) -> str:
    """What the program wrote to a file the parent opened (its name in the work dir may have changed)."""
    file.seek(0)
    return str(file.read(limits.output_bytes).decode("utf-8", errors="replace"))


def _remove(workdir: Path) -> None:
    """Remove the work dir, whatever modes the program left inside it (its parent is never touched)."""
    with contextlib.suppress(OSError):
        os.chmod(workdir, 0o700)
    for root, dirs, _ in os.walk(workdir):
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
    shutil.rmtree(workdir, ignore_errors=True)

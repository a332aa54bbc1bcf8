"""The processes of a local Ray that ``start_ray`` starts, and none left once its driver is SIGKILLed.

Ray 2.60's raylet cannot run without its dashboard agent and runtime-env agent (it aborts on an empty agent
command), and after a SIGKILL of the driver both outlived it by a minute (they wait 60 s to report the raylet's
death to the dead GCS). ``start_ray`` leaves out what it can (idle workers started ahead, metrics collection) and
starts a reaper that ends the rest. The driver here is a subprocess, so its Ray is not the session's shared one.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc (Linux)")

DRIVER = """
import json, os, sys, time
from rl_engines.ray_cluster import start_ray
start_ray(num_cpus=1, temp_dir=sys.argv[1])
parents = {}
for name in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{name}/stat", "rb").read()
        command = open(f"/proc/{name}/cmdline", "rb").read().replace(b"\\0", b" ").decode().strip()
    except OSError:
        continue
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] == b"Z":  # a helper that has exited and awaits reaping (no command line): not a live process
        continue
    parents[int(name)] = (int(fields[1]), command)
mine, found = {os.getpid()}, True
while found:
    found = [pid for pid, (ppid, _) in parents.items() if ppid in mine and pid not in mine]
    mine.update(found)
print(json.dumps({pid: parents[pid][1] for pid in mine - {os.getpid()}}), flush=True)  # one line: Ray is up
time.sleep(600)
"""
# What each of those processes is, by a piece of its command line (agents and workers rename themselves ray::*).
KINDS = (
    "gcs_server", "raylet/raylet", "autoscaler/_private/monitor.py", "dashboard/dashboard.py",
    "_private/log_monitor.py", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "rl-ray-reaper", "ray::IDLE",
)  # fmt: skip


def _kind(command: str) -> str:
    return next((kind for kind in KINDS if kind in command), command)


def _read_until_ready(driver: subprocess.Popen[str], timeout_s: float) -> dict[int, str]:
    """pid -> kind of every process the driver lists once its Ray is up (one JSON line)."""
    assert driver.stdout is not None
    if not select.select([driver.stdout], [], [], timeout_s)[0]:
        raise AssertionError(f"the driver did not start Ray within {timeout_s:.0f}s")
    line = driver.stdout.readline()
    assert line, f"the driver exited with {driver.wait()} before starting Ray"
    return {int(pid): _kind(command) for pid, command in json.loads(line).items()}


def _start_time(pid: int) -> bytes | None:
    """The start time of process ``pid`` (None once it is gone; a reused pid has another)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    if stat[stat.rindex(b")") + 2 :].split()[0] == b"Z":  # exited, not yet reaped by its parent
        return None
    return stat[stat.rindex(b")") + 2 :].split()[19]


def test_a_sigkilled_driver_leaves_no_ray_process_and_ray_starts_no_idle_workers():
    temp_dir = tempfile.mkdtemp(prefix="rl_ray_")  # short: Ray's sockets live under it
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, temp_dir], stdout=subprocess.PIPE, text=True)
    try:
        listed = _read_until_ready(driver, timeout_s=120)
        assert sorted(listed.values()) == sorted(KINDS[:-1])  # no idle workers; agents Ray cannot do without
        started = {pid: _start_time(pid) for pid in listed}
        os.kill(driver.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15  # the agents took 60 s without the reaper
        while (alive := [listed[pid] for pid in listed if _start_time(pid) == started[pid]]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert not alive
    finally:
        driver.kill()
        driver.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)

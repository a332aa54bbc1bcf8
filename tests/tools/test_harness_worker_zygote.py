"""The harness's fork server for Ray's workers (tests/harness_site/worker_zygote.py): the session's workers fork from
a zygote, start as a fresh worker would, end with their stand-ins, and no zygote outlives its raylet."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import ray
from ray import cloudpickle

from tests.conftest import RAY_WORKER_PATHS

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import this module by name

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc (Linux)")

FRESH = {"runtime_env": {"env_vars": {"RL_TEST_WORKER_ZYGOTE": "0"}}}
"""Options of an actor whose worker starts as usual (the switch off in its environment)."""


def _command(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return True
        if stat[stat.rindex(b")") + 2 :].split()[0] == b"Z":
            return True
        time.sleep(0.1)
    return False


@ray.remote(num_cpus=0, resources={"rl_device": 0.01})
class Probe:
    def facts(self) -> dict:
        import random

        import numpy
        import torch

        return {
            "pid": os.getpid(), "parent": _command(os.getppid()), "group": os.getpgid(0), "path": sys.path,
            "cwd": os.getcwd(), "threads": torch.get_num_threads(), "random": random.random(),
            "numpy": float(numpy.random.rand()),  # noqa: NPY002 - the global stream itself
        }  # fmt: skip


@pytest.fixture(scope="module")
def probes(ray_session):
    actors = {"a": Probe.remote(), "b": Probe.remote(), "fresh": Probe.options(**FRESH).remote()}
    yield actors, {name: ray.get(actor.facts.remote(), timeout=120) for name, actor in actors.items()}
    for actor in actors.values():
        ray.kill(actor)


def test_workers_fork_from_a_zygote_and_start_as_a_fresh_worker_does(probes):
    _, facts = probes
    a, b, fresh = facts["a"], facts["b"], facts["fresh"]
    assert "worker_zygote.py" in a["parent"] and "worker_zygote.py" in b["parent"]
    assert "raylet" in fresh["parent"]  # the switch turns it off
    # The process Ray started stands in for the worker, in whose process group the worker runs
    assert a["group"] != a["pid"] and "default_worker.py" in _command(a["group"])
    for name in ("path", "cwd", "threads"):
        assert a[name] == fresh[name], name
    assert a["random"] != b["random"] and a["numpy"] != b["numpy"]  # random streams of their own, as fresh processes


def test_a_worker_and_its_stand_in_end_together(probes):
    actors, facts = probes
    os.kill(facts["a"]["group"], signal.SIGKILL)  # the stand-in: its worker follows
    assert _gone(facts["a"]["pid"], timeout_s=10)
    ray.kill(actors["b"])  # Ray kills the worker it registered: its stand-in follows
    assert _gone(facts["b"]["group"], timeout_s=10)


def test_a_worker_whose_zygote_fails_starts_as_usual(tmp_path):
    """A zygote that dies while it imports (here at ``import torch``): the worker runs its own script instead."""
    worker = tmp_path / "ray" / "_private" / "workers" / "default_worker.py"
    worker.parent.mkdir(parents=True)
    worker.write_text("print('the worker ran', flush=True)\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "torch.py").write_text("import os\nos._exit(3)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["PYTHONPATH"], str(broken)])}
    env["RL_TEST_WORKER_ZYGOTE"] = "1"
    out = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "the worker ran\n", out.stderr
    assert "starting as usual" in out.stderr


DRIVER = """
import json, os, sys
from rl_engines.ray_cluster import start_ray, stop_ray
import ray
start_ray(num_cpus=1, temp_dir=sys.argv[1])
@ray.remote(num_cpus=0)
def parent():
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return os.getppid(), f.read().replace(b"\\0", b" ").decode()
print(json.dumps(ray.get(parent.remote())), flush=True)
stop_ray(remove_temp_dir=True)
"""


def test_a_zygote_ends_with_its_raylet():
    temp_dir = tempfile.mkdtemp(prefix="rl_ray_")  # short: Ray's sockets live under it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, RAY_WORKER_PATHS), os.environ["PYTHONPATH"]])}
    try:
        out = subprocess.run([sys.executable, "-c", DRIVER, temp_dir], env=env, capture_output=True, text=True,
                             timeout=180, check=True)  # fmt: skip
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    zygote, command = json.loads(out.stdout.splitlines()[-1])
    assert "worker_zygote.py" in command
    assert _gone(zygote, timeout_s=10)

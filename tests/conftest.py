"""Session-wide test plumbing: GPU tests skip without CUDA; one Ray instance serves every test that needs Ray.

Starting Ray costs 5-15 s of a 2-core machine, so the tests share one local instance (``ray_session``), started by
the first module that asks for it and stopped at the end of the session. A pipeline run on it finds Ray running and
leaves it running (``start_ray`` returns False to it), after removing its own actors and placement groups. A module
that needs a cluster of its own (``ray.cluster_utils.Cluster``) asks for ``no_shared_ray`` first; the next module
that asks for ``ray_session`` starts the shared instance again.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAY_DEVICE_SLOTS = 4
"""``rl_device`` slots of the shared Ray node: the largest ``num_gpus_per_node`` a CPU test plans on one node."""
RAY_WORKER_PATHS = (REPO, REPO / "tests" / "rl_engines", REPO / "tests" / "apps")
"""On the PYTHONPATH of Ray's workers: ``apps`` and the test modules whose worker classes actors import by name."""
HARNESS_SITE = REPO / "tests" / "harness_site"
"""Its ``sitecustomize.py`` runs at the start of every Python process of the session (tests/import_hooks.py: the
cache of transformers' import-structure scan)."""


def _harness_start_up() -> None:
    """Run the harness's start-up hook here and put its folder first on the PYTHONPATH every child inherits (Ray's
    workers, subprocesses)."""
    import runpy

    os.environ.setdefault("RL_TEST_WORKER_ZYGOTE", "1")  # Ray workers fork from zygotes: harness_site/worker_zygote.py
    runpy.run_path(str(HARNESS_SITE / "sitecustomize.py"))
    paths = [str(HARNESS_SITE), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


_harness_start_up()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


class SharedRay:
    """The session's local Ray: ``num_cpus=2``, ``RAY_DEVICE_SLOTS`` device slots, no dashboard or metrics, its
    files (workers' temp files included) in ``<system temp>/rl_ray_*``, removed when it stops."""

    def __init__(self) -> None:
        self.started = False

    def start(self) -> None:
        """Start it unless Ray runs already (it did, or a module's own start_ray did and will stop it)."""
        import ray

        from rl_engines.placement import ClusterSpec
        from rl_engines.ray_cluster import cpu_device_resources, start_ray

        if ray.is_initialized():
            return
        temp_dir = tempfile.mkdtemp(prefix="rl_ray_")
        worker_temp = os.path.join(temp_dir, "tmp")
        os.makedirs(worker_temp)
        paths = [*map(str, RAY_WORKER_PATHS), os.environ.get("PYTHONPATH", "")]
        with pytest.MonkeyPatch.context() as env:  # Ray's processes inherit these; this process keeps its own
            env.setenv("PYTHONPATH", os.pathsep.join(path for path in paths if path))
            # What workers leave in temp goes with the session: a killed actor never runs its exit handlers
            # (megatron.core imports wandb, whose staging folders are removed only at a normal exit).
            env.setenv("TMPDIR", worker_temp)
            resources = cpu_device_resources(ClusterSpec(num_nodes=1, num_gpus_per_node=RAY_DEVICE_SLOTS))
            self.started = start_ray(num_cpus=2, resources=resources, temp_dir=temp_dir)

    def stop(self) -> None:
        """Stop it, files included, if this session started it."""
        from rl_engines.ray_cluster import stop_ray

        if self.started:
            stop_ray(remove_temp_dir=True)
            self.started = False


@pytest.fixture(scope="session")
def _shared_ray() -> Iterator[SharedRay]:
    shared = SharedRay()
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def ray_session(_shared_ray: SharedRay) -> SharedRay:
    """The session's Ray instance, running for this module's tests (see the module docstring)."""
    _shared_ray.start()
    return _shared_ray


@pytest.fixture(scope="module")
def no_shared_ray(_shared_ray: SharedRay) -> None:
    """For a module that starts a Ray cluster of its own: stops the shared instance first."""
    _shared_ray.stop()

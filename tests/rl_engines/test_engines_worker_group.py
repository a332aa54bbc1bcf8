"""WorkerGroup on one local Ray node: dispatch modes, system_envs, gloo, rpc_timeout, fail-fast, errors, shutdown.

The session's shared Ray instance serves the module (tests/conftest.py: ``ray_session``).
"""

import os
import subprocess
import sys
import time

import pytest
import ray
import torch
import torch.distributed as dist

from rl_core.batch import BatchSizeError, RolloutBatch
from rl_engines import ClusterSpec, RolePlacement, RoleResources, plan_placement
from rl_engines.ray_cluster import ResourcePool
from rl_engines.worker_group import (
    DISPATCH_MODES,
    WorkerBase,
    WorkerCallError,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
)

CLUSTER = ClusterSpec(num_nodes=1, num_gpus_per_node=4)
# Read when a worker imports this module: set there only if system_envs reach the process before imports run.
FLAG_AT_IMPORT = os.environ.get("RL_TEST_FLAG")


class EchoWorker(WorkerBase):
    """Test worker: reports what it received and misbehaves on request."""

    def __init__(self, role, rank, world_size, master_addr, master_port, env, tag="untagged"):
        super().__init__(role, rank, world_size, master_addr, master_port, env)
        self.tag = tag

    def echo(self, *args, **kwargs):
        return {"rank": self.rank, "args": args, "kwargs": kwargs, "tag": self.tag}

    def flag_at_import(self):
        return FLAG_AT_IMPORT

    def scale(self, batch, factor):
        rank = torch.full((len(batch),), self.rank)
        return RolloutBatch.from_dict({"scaled": batch["x"] * factor, "rank": rank}, {"prompt": batch["prompt"]})

    def count(self, batch):
        return len(batch)

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def exit_on_rank(self, rank, then_sleep_s):
        if self.rank == rank:
            os._exit(1)
        time.sleep(then_sleep_s)  # the other ranks "hang in a collective" waiting for the dead one

    def fail_on_rank(self, rank, message):
        if self.rank == rank:
            raise ValueError(f"rank {self.rank}: {message}")
        return self.rank

    def all_reduce_rank(self):
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return value.item()


class GatedInitWorker(WorkerBase):
    """``__init__`` waits (at most 60 s) until the file ``gate`` exists."""

    def __init__(self, role, rank, world_size, master_addr, master_port, env, gate):
        super().__init__(role, rank, world_size, master_addr, master_port, env)
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.opened = os.path.exists(gate)


class BrokenInitWorker(WorkerBase):
    def __init__(self, role, rank, world_size, master_addr, master_port, env):
        super().__init__(role, rank, world_size, master_addr, master_port, env)
        raise RuntimeError(f"cannot load the model on rank {rank}")


def _dies_within(actor, seconds: float) -> bool:
    """True once a call on ``actor`` fails as dead (``ray.kill`` is asynchronous: a call may still slip in)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=seconds)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


def _placement(role: str, mapping: list[int]) -> RolePlacement:
    return plan_placement(CLUSTER, [RoleResources(role, mapping)]).roles[role]


@pytest.fixture(scope="module")
def pool(ray_session):
    # Ray workers import the actor classes of this module by name: tests/rl_engines is on their PYTHONPATH.
    with ResourcePool(CLUSTER) as pool:
        yield pool


@pytest.fixture(scope="module")
def group(pool):
    with WorkerGroup(
        "actor_train",
        EchoWorker,
        _placement("actor_train", [0, 1]),
        pool,
        rpc_timeout=60.0,
        system_envs={"RL_TEST_FLAG": "on", "RANK": "99"},
        init_kwargs={"tag": "t1"},
    ) as group:
        yield group


def test_worker_module_does_not_load_torch_until_a_batch_is_dispatched():
    code = "import sys, rl_engines.worker_group; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # actor processes that never see a RolloutBatch skip ~1.5 s of torch import


def test_group_identity_and_init_args(group):
    assert (group.role, group.world_size, len(group.actors)) == ("actor_train", 2, 2)
    assert [reply["tag"] for reply in group.call("echo")] == ["t1", "t1"]
    assert group.call("ping") == [0, 1]


def test_one_to_all_sends_the_same_arguments_to_every_rank(group):
    tensor = torch.arange(6.0).reshape(2, 3)
    replies = group.call("echo", tensor, 7, key="v")
    assert [reply["rank"] for reply in replies] == [0, 1]
    for reply in replies:
        assert torch.equal(reply["args"][0], tensor)
        assert reply["args"][1:] == (7,)
        assert reply["kwargs"] == {"key": "v"}


def test_rank_zero_calls_only_rank_zero(group):
    reply = group.call("echo", 1, dispatch="rank_zero")
    assert reply["rank"] == 0
    assert reply["args"] == (1,)


def test_all_ranks_list_gives_rank_i_element_i(group):
    replies = group.call("echo", ["a", "b"], key=[10, 11], dispatch="all_ranks_list")
    assert [(r["rank"], r["args"], r["kwargs"]) for r in replies] == [
        (0, ("a",), {"key": 10}),
        (1, ("b",), {"key": 11}),
    ]
    with pytest.raises(ValueError, match=r"actor_train\.echo \(dispatch='all_ranks_list'\).*key is a list of length 3"):
        group.call("echo", key=[1, 2, 3], dispatch="all_ranks_list")
    with pytest.raises(ValueError, match="positional argument 0 is a str"):
        group.call("echo", "ab", dispatch="all_ranks_list")


def test_dp_split_chunks_the_batch_and_concatenates_results(group):
    batch = RolloutBatch.from_dict({"x": torch.arange(4.0)}, {"prompt": ["p0", "p1", "p2", "p3"]})
    result = group.call("scale", batch, 10.0, dispatch="dp_split")
    assert isinstance(result, RolloutBatch)
    assert torch.equal(result["scaled"], torch.tensor([0.0, 10.0, 20.0, 30.0]))
    assert result["rank"].tolist() == [0, 0, 1, 1]
    assert result["prompt"].tolist() == ["p0", "p1", "p2", "p3"]
    assert group.call("count", batch, dispatch="dp_split") == [2, 2]  # non-batch results come back as a list


def test_dp_split_errors_name_role_and_method(group):
    with pytest.raises(TypeError, match=r"actor_train\.count \(dispatch='dp_split'\).*RolloutBatch.*got list"):
        group.call("count", [1, 2], dispatch="dp_split")
    odd = RolloutBatch.from_dict({"x": torch.arange(3.0)})
    with pytest.raises(BatchSizeError, match=r"actor_train\.count.*batch_size 3 is not divisible by chunks 2"):
        group.call("count", odd, dispatch="dp_split")


def test_unknown_dispatch_mode_and_method_are_rejected(group):
    assert {"one_to_all", "rank_zero", "dp_split", "all_ranks_list"} <= set(DISPATCH_MODES.names())
    with pytest.raises(ValueError, match=r"unknown dispatch mode 'scatter_gather' .*config key 'dispatch'.*dp_split"):
        group.call("echo", dispatch="scatter_gather")
    with pytest.raises(AttributeError, match="actor_train: EchoWorker has no method `train_stepp`"):
        group.call("train_stepp")


def test_system_envs_reach_every_worker_before_imports(group):
    assert group.call("get_env", "RL_TEST_FLAG") == ["on", "on"]
    assert group.call("flag_at_import") == ["on", "on"]
    assert FLAG_AT_IMPORT is None  # the driver never had it
    # the group's own variables win over a stray RANK in system_envs
    assert group.call("get_env", "RANK") == ["0", "1"]
    assert group.call("get_env", "WORLD_SIZE") == ["2", "2"]
    assert group.call("get_env", "LOCAL_RANK") == ["0", "0"]
    masters = group.call("get_env", "MASTER_ADDR")
    assert masters[0] == masters[1] == group.call("node_ip", dispatch="rank_zero")
    assert len(set(group.call("get_env", "MASTER_PORT"))) == 1


def test_gloo_all_reduce_across_the_group(group):
    group.call("init_process_group", timeout_s=60.0)
    try:
        assert group.call("all_reduce_rank") == [3.0, 3.0]  # (0 + 1) + (1 + 1)
    finally:
        group.call("destroy_process_group")


def test_call_async_returns_a_future(group):
    future = group.call_async("sleep", 0.5)
    assert not future.done()
    assert future.get() == [0, 1]
    assert future.done()


def test_exception_in_a_worker_is_a_call_error_with_the_original_message(group):
    with pytest.raises(WorkerCallError) as info:
        group.call("fail_on_rank", 1, "reward model returned NaN")
    error = info.value
    assert (error.role, error.method, error.ranks) == ("actor_train", "fail_on_rank", [1])
    assert "actor_train: rank 1 raised in `fail_on_rank`" in str(error)
    assert "ValueError: rank 1: reward model returned NaN" in str(error)
    assert ", in fail_on_rank\n" in error.remote_traceback  # the worker-side frame
    assert isinstance(error.__cause__, ray.exceptions.RayTaskError)
    assert group.call("ping") == [0, 1]  # a raising method leaves the workers usable


def test_exception_in_worker_init_is_a_call_error(pool):
    with pytest.raises(WorkerCallError, match=r"critic: rank \d raised in `__init__ \(worker start-up\)`") as info:
        WorkerGroup("critic", BrokenInitWorker, _placement("critic", [2, 3]), pool, rpc_timeout=60.0)
    assert "cannot load the model on rank" in str(info.value)


def test_groups_started_without_waiting_start_side_by_side(pool, tmp_path):
    """wait=False returns while the workers are still in __init__ (Roles starts every role so); wait_started waits,
    and a failed start surfaces there, naming start_timeout."""
    gate = tmp_path / "gate"
    with WorkerGroup("critic", GatedInitWorker, _placement("critic", [2, 3]), pool, rpc_timeout=60.0,
                     init_args=(str(gate),), start_timeout=30.0, wait=False) as group:  # fmt: skip
        gate.touch()  # only now can the workers' __init__ finish: a blocking constructor would have timed out
        group.wait_started()
        assert group.call("ping") == [0, 1]
        opened = ray.get([actor.__ray_call__.remote(lambda worker: worker.opened) for actor in group.actors])
        assert opened == [True, True]
    late = WorkerGroup("critic", GatedInitWorker, _placement("critic", [2, 3]), pool, rpc_timeout=60.0,
                       init_args=(str(tmp_path / "never"),), start_timeout=1.0, wait=False)  # fmt: skip
    with pytest.raises(WorkerTimeoutError, match="start_timeout"):
        late.wait_started()
    late.shutdown()


def test_rpc_timeout_names_role_ranks_method_and_fix_and_shutdown_kills_hung_workers(pool):
    group = WorkerGroup("reference", EchoWorker, _placement("reference", [2, 3]), pool, rpc_timeout=2.0)
    with pytest.raises(WorkerTimeoutError) as info:
        group.call("sleep", [0.0, 60.0], dispatch="all_ranks_list")
    message = str(info.value)
    assert "reference: rank(s) [1] did not answer `sleep` within rpc_timeout=2.0s" in message
    assert "rank(s) [0] answered" in message
    assert "raise rpc_timeout" in message
    assert "worker log" in message
    assert info.value.ranks == [1]

    handles = group.actors
    group.shutdown()
    group.shutdown()  # idempotent
    assert group.actors == ()
    for handle in handles:  # rank 1 was still sleeping: killed all the same
        assert _dies_within(handle, seconds=30)
    with pytest.raises(WorkerError, match="reference: the worker group is shut down"):
        group.call("ping")


def test_a_dead_rank_fails_the_call_at_once_while_another_rank_hangs(pool):
    # Rank 0 hangs for longer than rpc_timeout: waiting in rank order would end in WorkerTimeoutError.
    with WorkerGroup("actor_infer", EchoWorker, _placement("actor_infer", [2, 3]), pool, rpc_timeout=30.0) as group:
        with pytest.raises(WorkerDiedError) as info:
            group.call("exit_on_rank", 1, 120.0)
        # rank 0 is still busy, yet the next call fails at once on the dead rank too
        with pytest.raises(WorkerDiedError, match="actor_infer: rank 1 died during `ping`"):
            group.call("ping")
    error = info.value
    assert (error.role, error.method, error.ranks) == ("actor_infer", "exit_on_rank", [1])
    assert "actor_infer: rank 1 died during `exit_on_rank`" in str(error)
    assert isinstance(error.__cause__, ray.exceptions.ActorDiedError)


def test_group_arguments_are_validated(pool):
    placement = _placement("critic", [2])
    with pytest.raises(ValueError, match="critic: rpc_timeout must be a positive number"):
        WorkerGroup("critic", EchoWorker, placement, pool, rpc_timeout=0)
    with pytest.raises(ValueError, match="critic: start_timeout must be a positive number of seconds, got -1"):
        WorkerGroup("critic", EchoWorker, placement, pool, rpc_timeout=5.0, start_timeout=-1)
    with pytest.raises(TypeError, match="critic: worker_cls must be a WorkerBase subclass"):
        WorkerGroup("critic", object, placement, pool, rpc_timeout=5.0)
    with pytest.raises(TypeError, match=r"critic\.system_envs\['OMP_NUM_THREADS'\] = 1.*quote the value"):
        WorkerGroup("critic", EchoWorker, placement, pool, rpc_timeout=5.0, system_envs={"OMP_NUM_THREADS": 1})


class FollowsPeerError(RuntimeError):
    """What a rank raises when only another rank failed (as rl_engines' PeerRankError after an abandoned save)."""

    follows_another_rank = True


class SaveWorker(WorkerBase):
    def save(self, failing_rank, delay_s):
        if self.rank != failing_rank:
            raise FollowsPeerError(f"rank {self.rank}: rank {failing_rank} failed; see its error")
        time.sleep(delay_s)  # the rank that only followed answers first
        raise OSError(28, f"rank {self.rank}: No space left on device")


def test_the_failing_rank_is_reported_once_before_a_rank_that_only_followed_it(pool):
    group = WorkerGroup("actor_train", SaveWorker, _placement("actor_train", [2, 3]), pool, rpc_timeout=30.0)
    with group, pytest.raises(WorkerCallError) as info:
        group.call("save", 1, 1.0)
    error = info.value
    assert (error.ranks, error.follows_another_rank) == ([1], False)
    lines = str(error).splitlines()
    assert lines[0] == "actor_train: rank 1 raised in `save`: OSError: [Errno 28] rank 1: No space left on device"
    assert "Traceback" not in str(error) and ", in save\n" in error.remote_traceback  # the traceback: __cause__

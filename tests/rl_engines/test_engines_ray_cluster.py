"""ResourcePool and scheduling on a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``, 2 slots a node).

One cluster serves the module; its files live in a short directory under the system temp dir, removed at the end.
"""

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
import ray
from engine_fixtures import tiny_model_dir
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_engines import ClusterSpec, PlacementError, RoleResources, WorkerPlacement, plan_placement
from rl_engines.ray_cluster import (
    ACTOR_DEVICE_FRACTION,
    CPU_DEVICE_RESOURCE,
    ResourcePool,
    cpu_device_resources,
    free_port,
    rendezvous_address,
    scheduling_options,
    start_ray,
    stop_ray,
)
from rl_engines.worker_group import WorkerBase, WorkerGroup

__all__ = ["tiny_model_dir"]

CLUSTER = ClusterSpec(num_nodes=2, num_gpus_per_node=2)


class NodeWorker(WorkerBase):
    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    def placement_group_id(self):
        return ray.get_runtime_context().get_placement_group_id()


@pytest.fixture(scope="module")
def cluster(no_shared_ray):
    temp_dir = tempfile.mkdtemp(prefix="rl_ray_")
    os.makedirs(os.path.join(temp_dir, "ray"))  # Cluster writes its address file to $RAY_TMPDIR/ray
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", temp_dir)  # kept until shutdown, which removes that address file again
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Ray workers import this module's actor classes by name; they inherit PYTHONPATH from their raylet.
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent), os.getenv("PYTHONPATH")])))
        node = {"num_cpus": 1, "resources": cpu_device_resources(CLUSTER)}
        cluster = Cluster(
            initialize_head=True, head_node_args={**node, "include_dashboard": False, "temp_dir": temp_dir}
        )
        try:
            cluster.add_node(**node)
            start_ray(address=cluster.address)
            yield cluster
        finally:
            stop_ray()
            cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def _roles(*roles):
    return plan_placement(CLUSTER, list(roles)).roles


def test_free_port_is_below_the_ephemeral_range_bindable_and_never_repeated():
    # A port from the kernel's ephemeral range can be taken by any outgoing connection between its pick and the
    # TCPStore's bind (the EADDRINUSE CI met); one below it can only be taken by another explicit bind.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    if ephemeral_low - 20000 < 1024:
        pytest.skip(f"ip_local_port_range starts at {ephemeral_low}: too little room below it, the OS picks")
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(20000 <= port < ephemeral_low for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", ports[-1]))


def test_cpu_device_resources_are_per_node():
    assert cpu_device_resources(CLUSTER) == {CPU_DEVICE_RESOURCE: 2.0}


def test_start_ray_is_idempotent_and_rejects_node_options_with_an_address(cluster):
    start_ray()  # already connected: a no-op
    assert ray.is_initialized()
    with pytest.raises(ValueError, match=r"connects to a running cluster, so \['num_cpus', 'temp_dir'\] cannot"):
        start_ray(address=cluster.address, num_cpus=2, temp_dir="/tmp/x")


def test_single_node_pool_lands_on_the_driver_node(cluster):
    with ResourcePool(ClusterSpec(num_nodes=1, num_gpus_per_node=2)) as pool:
        assert (pool.use_gpu, pool.device_resource) == (False, CPU_DEVICE_RESOURCE)
        assert pool.node_ids == (ray.get_runtime_context().get_node_id(),)
        assert len(pool.placement_groups) == 1
        assert pool.placement_groups[0].bundle_specs == [{CPU_DEVICE_RESOURCE: 1.0}] * 2
    assert pool.placement_groups == ()
    pool.remove()  # idempotent


def test_two_node_pool_places_each_worker_on_its_node_and_colocated_roles_share_bundles(cluster):
    roles = _roles(
        RoleResources("actor_train", list(range(4))),
        RoleResources("reference", [1, 2]),  # shares devices 1 and 2 with actor_train
        RoleResources("actor_infer", [2, 3], num_gpus_per_worker=2, is_inference=True),  # one worker on node 1
    )
    with ResourcePool(CLUSTER) as pool:
        assert len(set(pool.node_ids)) == 2
        assert pool.node_ids[0] == ray.get_runtime_context().get_node_id()
        groups = {name: WorkerGroup(name, NodeWorker, roles[name], pool, rpc_timeout=60.0) for name in roles}
        try:
            for name, group in groups.items():
                expected = [pool.node_ids[worker.node_rank] for worker in roles[name].workers]
                assert group.call("node_id") == expected, name
                pg_ids = [pool.placement_groups[worker.node_rank].id.hex() for worker in roles[name].workers]
                assert group.call("placement_group_id") == pg_ids, name
            # actor_infer's rank 0 runs on node 1, so its rendezvous address was probed there
            infer = groups["actor_infer"]
            assert infer.call("get_env", "MASTER_ADDR") == infer.call("node_ip")
            # actors per bundle (node rank, local device): train 1 each, reference on devices 1-2, infer on 2-3
            expected = {(0, 0): 1, (0, 1): 2, (1, 0): 3, (1, 1): 1}
            assert _wait_for_bundle_use(pool, expected) == expected
        finally:
            for group in groups.values():
                group.shutdown()


def _wait_for_bundle_use(pool, expected, timeout_s=10.0):
    """Actors per bundle, read from the bundle resources Ray reports free (its view lags actor start briefly)."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources()
        use = {
            (node_rank, i): round(
                (1.0 - free.get(f"{CPU_DEVICE_RESOURCE}_group_{i}_{group.id.hex()}", 0.0)) / ACTOR_DEVICE_FRACTION
            )
            for node_rank, group in enumerate(pool.placement_groups)
            for i in range(CLUSTER.num_gpus_per_node)
        }
        if use == expected or time.monotonic() > deadline:
            return use
        time.sleep(0.1)


def test_rendezvous_address_probes_a_remote_node(cluster):
    with ResourcePool(CLUSTER) as pool:
        worker_on_node_1 = WorkerPlacement(rank=0, node_rank=1, global_device_ids=(2,), local_device_ids=(0,))
        ip, port = rendezvous_address(pool, worker_on_node_1, timeout_s=60.0)
        assert ip == next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == pool.node_ids[1])
        assert 0 < port < 65536


def test_scheduling_options_on_cpu(cluster):
    worker = WorkerPlacement(rank=3, node_rank=1, global_device_ids=(3,), local_device_ids=(1,))
    with ResourcePool(CLUSTER) as pool:
        options = scheduling_options(pool, worker)
        strategy = options.pop("scheduling_strategy")
        assert options == {"num_cpus": 0, "resources": {CPU_DEVICE_RESOURCE: ACTOR_DEVICE_FRACTION}}
        assert isinstance(strategy, PlacementGroupSchedulingStrategy)
        assert strategy.placement_group is pool.placement_groups[1]
        assert strategy.placement_group_bundle_index == 1
        with_env = scheduling_options(pool, worker, env_vars={"NCCL_DEBUG": "INFO"})
        assert with_env["runtime_env"] == {"env_vars": {"NCCL_DEBUG": "INFO"}}
        outside = WorkerPlacement(rank=0, node_rank=2, global_device_ids=(4,), local_device_ids=(0,))
        with pytest.raises(PlacementError, match=r"node 2.*outside this pool \(num_nodes=2.*same ClusterSpec"):
            scheduling_options(pool, outside)
    with pytest.raises(RuntimeError, match="was removed; create a new ResourcePool"):
        scheduling_options(pool, worker)


def test_scheduling_options_on_gpu_expose_all_of_a_workers_devices(cluster):
    worker = WorkerPlacement(rank=0, node_rank=1, global_device_ids=(2, 3), local_device_ids=(0, 1))
    with ResourcePool(CLUSTER) as pool:
        pool.use_gpu = True  # only the options are built here; nothing is scheduled on a GPU
        options = scheduling_options(pool, worker, env_vars={"CUDA_VISIBLE_DEVICES": "7", "NCCL_DEBUG": "INFO"})
    assert options["num_gpus"] == ACTOR_DEVICE_FRACTION
    assert options["num_cpus"] == 0
    assert "resources" not in options
    assert options["scheduling_strategy"].placement_group_bundle_index == 0
    assert options["runtime_env"]["env_vars"] == {
        "CUDA_VISIBLE_DEVICES": "0,1",  # the placement wins over system_envs
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "NCCL_DEBUG": "INFO",
    }


def test_pool_larger_than_the_cluster_names_the_keys_and_what_ray_has(cluster):
    with pytest.raises(PlacementError) as info:
        ResourcePool(ClusterSpec(num_nodes=3, num_gpus_per_node=2))
    message = str(info.value)
    assert (
        "num_nodes=3 × num_gpus_per_node=2 needs 3 Ray node(s) with 2 'rl_device' each, but only 2 qualify" in message
    )
    assert "cluster_resources()={'CPU': 2.0, 'rl_device': 4.0}" in message
    assert "cpu_device_resources" in message
    with pytest.raises(PlacementError, match=r"needs 1 Ray node.*3 'rl_device' each, but only 0 qualify"):
        ResourcePool(ClusterSpec(num_nodes=1, num_gpus_per_node=3))
    with pytest.raises(PlacementError, match=r"with 1 'GPU' each, but only 0 qualify.*add GPU nodes"):
        ResourcePool(ClusterSpec(num_nodes=1, num_gpus_per_node=1), use_gpu=True)


def test_pool_times_out_when_devices_are_held_and_frees_what_it_reserved(cluster):
    with ResourcePool(CLUSTER), pytest.raises(PlacementError) as info:
        ResourcePool(ClusterSpec(num_nodes=1, num_gpus_per_node=2), timeout_s=1.0)
    message = str(info.value)
    assert "could not reserve num_nodes=1 × num_gpus_per_node=2 'rl_device' within 1s" in message
    assert "available_resources()=" in message
    assert "an earlier ResourcePool not removed?" in message
    with ResourcePool(CLUSTER) as pool:  # the failed pool released its pending groups
        assert len(pool.placement_groups) == 2


def test_roles_across_two_nodes_generate_train_and_sync(cluster, tiny_model_dir):
    """actor_train on node 0, actor_infer on node 1 (separate): the broadcast group crosses the nodes."""
    import torch
    from engine_fixtures import prompt_batch, worker_config

    from rl_engines.objectives import ActorObjective
    from rl_engines.roles import Roles

    configs = {
        "actor_train": worker_config(tiny_model_dir, "actor_train", device_mapping=[0, 1],
                                     training_args={"learning_rate": 1e-2, "per_device_train_batch_size": 2}),
        "actor_infer": worker_config(tiny_model_dir, "actor_infer", device_mapping="list(range(2,4))",
                                     strategy_args={"strategy_name": "hf_infer"},
                                     generating_args={"max_new_tokens": 5, "num_return_sequences": 2, "seed": 1}),
    }  # fmt: skip
    with Roles(CLUSTER, configs, rpc_timeout=120) as roles:
        train_nodes = set(roles["actor_train"].call("node_id"))
        infer_nodes = set(roles["actor_infer"].call("node_id"))
        assert len(train_nodes) == len(infer_nodes) == 1 and train_nodes != infer_nodes
        rollout = roles["actor_infer"].call("generate", prompt_batch(tiny_model_dir, ["1+1=", "2+3="]),
                                            dispatch="dp_split")  # fmt: skip
        rollout.batch["old_log_probs"] = rollout.batch["rollout_log_probs"]
        rollout.batch["advantages"] = torch.linspace(-1, 1, rollout.batch["response_mask"].numel()).view(4, -1)
        roles["actor_train"].call("train_step", rollout, ActorObjective(), dispatch="dp_split")
        roles.model_updater().sync()
        mask = rollout.batch["response_mask"]
        trained = roles["actor_train"].call("compute_log_probs", rollout, dispatch="dp_split").batch["log_probs"]
        served = roles["actor_infer"].call("compute_log_probs", rollout, dispatch="dp_split").batch["log_probs"]
        torch.testing.assert_close(served[mask], trained[mask], atol=1e-6, rtol=0)
        assert float((trained - rollout.batch["rollout_log_probs"])[mask].abs().max()) > 1e-3

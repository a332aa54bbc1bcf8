"""plan_placement: hand-checked plans for the ROLL FAQ layouts, multi-node workers, and every error message."""

import pytest

from rl_engines import (
    ClusterSpec,
    DeviceMappingError,
    PartialOverlap,
    PlacementError,
    RoleResources,
    WorkerPlacement,
    parse_device_mapping,
    plan_placement,
)


def _role(name, mapping, per_worker=1, inference=False):
    return RoleResources(name, parse_device_mapping(mapping, role=name), per_worker, inference)


def test_faq_colocate_three_roles_on_one_node():
    roles = [
        _role("actor_train", "list(range(0,8))"),
        _role("actor_infer", "list(range(0,8))", inference=True),
        _role("reference", "list(range(0,8))"),
    ]
    plan = plan_placement(ClusterSpec(num_nodes=1, num_gpus_per_node=8), roles)
    assert list(plan.roles) == ["actor_train", "actor_infer", "reference"]
    for role in plan.roles.values():
        assert role.world_size == 8
        assert role.node_ranks == (0,)
        assert [w.local_device_ids for w in role.workers] == [(i,) for i in range(8)]
    assert plan.device_groups == (("actor_train", "actor_infer", "reference"),)
    assert plan.colocated_groups == plan.device_groups
    assert plan.separate_roles == ()
    assert plan.partial_overlaps == ()
    assert plan.unused_device_ids == ()
    assert plan.is_colocated("actor_train", "reference")


def test_faq_separate_three_roles_on_three_nodes():
    roles = [
        _role("actor_train", "list(range(0,8))"),
        _role("actor_infer", "list(range(8,16))", inference=True),
        _role("reference", "list(range(16,24))"),
    ]
    plan = plan_placement(ClusterSpec(num_nodes=3, num_gpus_per_node=8), roles)
    assert plan.device_groups == (("actor_train",), ("actor_infer",), ("reference",))
    assert plan.colocated_groups == ()
    assert plan.separate_roles == ("actor_train", "actor_infer", "reference")
    assert not plan.is_colocated("actor_train", "actor_infer")
    infer = plan.roles["actor_infer"]
    assert infer.node_ranks == (1,)
    assert infer.workers[0] == WorkerPlacement(rank=0, node_rank=1, global_device_ids=(8,), local_device_ids=(0,))
    assert infer.workers[7] == WorkerPlacement(rank=7, node_rank=1, global_device_ids=(15,), local_device_ids=(7,))
    ref = plan.roles["reference"]
    assert [w.node_rank for w in ref.workers] == [2] * 8
    assert [w.local_device_ids for w in ref.workers] == [(i,) for i in range(8)]


def test_multi_node_multi_gpu_inference_workers():
    # 2 nodes × 4 devices; actor_infer with tensor parallel 2 over all 8 devices -> 4 workers, 2 per node.
    cluster = ClusterSpec(num_nodes=2, num_gpus_per_node=4)
    plan = plan_placement(
        cluster,
        [_role("actor_train", "list(range(0,8))"), _role("actor_infer", "list(range(0,8))", 2, inference=True)],
    )
    train, infer = plan.roles["actor_train"], plan.roles["actor_infer"]
    assert train.world_size == 8
    assert [(w.node_rank, w.local_device_ids) for w in train.workers] == [
        (0, (0,)), (0, (1,)), (0, (2,)), (0, (3,)), (1, (0,)), (1, (1,)), (1, (2,)), (1, (3,)),
    ]  # fmt: skip
    assert infer.world_size == 4
    assert infer.num_gpus_per_worker == 2
    assert [(w.rank, w.node_rank, w.global_device_ids, w.local_device_ids) for w in infer.workers] == [
        (0, 0, (0, 1), (0, 1)), (1, 0, (2, 3), (2, 3)), (2, 1, (4, 5), (0, 1)), (3, 1, (6, 7), (2, 3)),
    ]  # fmt: skip
    assert infer.node_ranks == (0, 1)
    assert plan.colocated_groups == (("actor_train", "actor_infer"),)


def test_roll_separate_example_interleaved_nodes():
    # From rlvr_qwen2.5_7B_seperate.yaml: train / reference on half of each node, two infer roles on the rest.
    roles = [
        _role("actor_train", "list([0,1,2,3,8,9,10,11])"),
        _role("actor_infer", "list([4,5,12,13])", inference=True),
        _role("reward", "list([6,7,14,15])", 2, inference=True),
        _role("reference", "list([0,1,2,3,8,9,10,11])"),
    ]
    plan = plan_placement(ClusterSpec(2, 8), roles)
    assert plan.device_groups == (("actor_train", "reference"), ("actor_infer",), ("reward",))
    reward = plan.roles["reward"]
    assert [(w.node_rank, w.local_device_ids) for w in reward.workers] == [(0, (6, 7)), (1, (6, 7))]
    assert plan.unused_device_ids == ()


def test_partial_overlap_allowed_and_reported():
    roles = [
        _role("actor_train", "list(range(0,8))"),
        _role("reference", "list(range(0,4))"),
        _role("critic", "list(range(6,10))"),
        _role("actor_infer", "list(range(12,16))", inference=True),
    ]
    plan = plan_placement(ClusterSpec(2, 8), roles)
    assert plan.device_groups == (("actor_train", "reference", "critic"), ("actor_infer",))
    assert plan.partial_overlaps == (
        PartialOverlap(("actor_train", "reference"), (0, 1, 2, 3)),
        PartialOverlap(("actor_train", "critic"), (6, 7)),
    )
    assert not plan.is_colocated("reference", "critic")  # same group through actor_train, no shared device
    assert plan.unused_device_ids == (10, 11)


def test_transitive_group_in_config_order():
    roles = [_role("a", [0]), _role("b", [5]), _role("c", [1]), _role("d", [0, 1, 5])]
    plan = plan_placement(ClusterSpec(1, 8), roles)
    assert plan.device_groups == (("a", "b", "c", "d"),)


def test_cpu_slots_plan_like_gpus():
    # On a CPU-only machine the ids are CPU worker slots: 1 "node" with 4 slots, two colocated roles.
    plan = plan_placement(ClusterSpec(1, 4), [_role("actor_train", "range(4)"), _role("actor_infer", [0, 1], 2, True)])
    assert plan.roles["actor_infer"].workers == (WorkerPlacement(0, 0, (0, 1), (0, 1)),)
    assert plan.unused_device_ids == ()


def test_ids_beyond_cluster_replace_node2pg_keyerror():
    roles = [_role("actor_train", "list(range(0,8))"), _role("actor_infer", "list(range(8,16))", inference=True)]
    with pytest.raises(PlacementError) as info:
        plan_placement(ClusterSpec(num_nodes=1, num_gpus_per_node=8), roles)
    message = str(info.value)
    assert message.startswith("actor_infer.device_mapping uses device ids [8, 9, 10, 11, 12, 13, 14, 15]")
    assert "cluster has only 8 devices (num_nodes=1 × num_gpus_per_node=8, valid ids 0..7)" in message
    assert "Fix: keep actor_infer.device_mapping within 0..7, or raise num_nodes / num_gpus_per_node" in message
    assert "cover id 15" in message
    assert "node2pg" in message


def test_only_the_bad_ids_are_named():
    with pytest.raises(PlacementError, match=r"^reference\.device_mapping uses device ids \[16, 23\] but"):
        plan_placement(ClusterSpec(2, 8), [_role("reference", [0, 16, 3, 23])])


def test_gpus_per_worker_must_divide_mapping():
    with pytest.raises(PlacementError) as info:
        plan_placement(ClusterSpec(1, 8), [_role("actor_infer", "list(range(0,6))", 4, inference=True)])
    assert str(info.value).startswith(
        "actor_infer.num_gpus_per_worker=4 does not divide the 6 devices of actor_infer.device_mapping"
    )


def test_gpus_per_worker_only_for_inference_roles():
    with pytest.raises(PlacementError) as info:
        plan_placement(ClusterSpec(1, 8), [_role("actor_train", "list(range(0,8))", 2)])
    message = str(info.value)
    assert message.startswith("actor_train.num_gpus_per_worker=2, but num_gpus_per_worker applies only to inference")
    assert "tensor_model_parallel_size" in message


@pytest.mark.parametrize("bad", [0, -1, True, 1.0])
def test_gpus_per_worker_positive_int(bad):
    with pytest.raises(PlacementError, match=r"^actor_infer\.num_gpus_per_worker must be a positive integer"):
        plan_placement(ClusterSpec(1, 8), [RoleResources("actor_infer", [0, 1], bad, True)])


def test_worker_spanning_two_nodes():
    with pytest.raises(PlacementError) as info:
        plan_placement(ClusterSpec(2, 8), [_role("actor_infer", "list(range(2,14))", 4, inference=True)])
    message = str(info.value)
    # groups [2..5], [6..9] -> the second one spans node 0 (6, 7) and node 1 (8, 9)
    assert message.startswith("actor_infer.device_mapping: worker 1 of actor_infer gets devices [6, 7, 8, 9]")
    assert "span nodes [0, 1] (8 devices per node)" in message
    assert "a multi-device worker must fit on one node" in message
    assert "actor_infer.num_gpus_per_worker=4" in message


def test_mapping_is_validated_again_in_the_plan():
    with pytest.raises(DeviceMappingError, match=r"^critic\.device_mapping lists device ids \[1\] more than once"):
        plan_placement(ClusterSpec(1, 8), [RoleResources("critic", [0, 1, 1])])
    with pytest.raises(DeviceMappingError, match=r"^critic\.device_mapping is empty"):
        plan_placement(ClusterSpec(1, 8), [RoleResources("critic", [])])


def test_no_roles_and_duplicate_roles():
    with pytest.raises(PlacementError, match="no roles to place"):
        plan_placement(ClusterSpec(1, 8), [])
    with pytest.raises(PlacementError, match=r"roles \['critic'\] are configured more than once"):
        plan_placement(ClusterSpec(1, 8), [_role("critic", [0]), _role("critic", [1])])


@pytest.mark.parametrize(("nodes", "per_node"), [(0, 8), (1, 0), (-1, 8), (1.5, 8), (True, 8)])
def test_cluster_spec_validation(nodes, per_node):
    with pytest.raises(PlacementError, match="must be a positive integer"):
        ClusterSpec(nodes, per_node)


def test_import_pulls_no_heavy_package():
    import subprocess
    import sys

    code = (
        "import sys, rl_engines; "
        "heavy = [m for m in ('ray', 'torch', 'transformers', 'vllm', 'sglang', 'deepspeed', 'megatron') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"

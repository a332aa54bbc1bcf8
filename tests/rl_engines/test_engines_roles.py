"""End to end on Ray (CPU device slots): actor_train + actor_infer + reference, actor_infer in actor_train's
processes, partly in them (the rest colocated in processes of its own), and on devices of its own.

Each mode generates, scores with all three roles, trains one step with an rl-core loss on two data-parallel
ranks, syncs weights into the inference role and checks the new scores match the trained model. The two-rank
update is compared with a one-rank strategy in this process, and a two-rank checkpoint is resumed on one rank.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import prompt_batch, tiny_model_dir, worker_config

from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec, PlacementError
from rl_engines.roles import Roles
from rl_engines.shared_processes import Guest
from rl_engines.strategies import create_strategy
from rl_engines.weight_sync import SHM_DIR

__all__ = ["tiny_model_dir"]

CLUSTER = ClusterSpec(num_nodes=1, num_gpus_per_node=4)
TRAIN_ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
QUESTIONS = ["1+2=", "10+12=", "3+3=", "4+5="]


def role_configs(model_dir, infer_devices):
    return {
        "actor_train": worker_config(model_dir, "actor_train", device_mapping="list(range(0,2))",
                                     training_args=TRAIN_ARGS, infer_batch_size=4),
        "actor_infer": worker_config(model_dir, "actor_infer", device_mapping=infer_devices,
                                     strategy_args={"strategy_name": "hf_infer"}, infer_batch_size=4,
                                     generating_args={"max_new_tokens": 6, "num_return_sequences": 2, "seed": 0}),
        "reference": worker_config(model_dir, "reference", device_mapping=[0],  # one rank: one fewer process
                                   strategy_args={"strategy_name": "hf_infer"}, infer_batch_size=4,
                                   system_envs={"RL_ROLE_FLAG": "reference only"}),
    }  # fmt: skip


INFER_DEVICES = {"shared_processes": [0, 1], "partly_shared": [1, 2], "separate": [2, 3]}
"""actor_infer's devices (actor_train: 0, 1): both ranks run in actor_train's processes (hf_infer's default on the
same devices) and sync in process; rank 0 in train rank 1's process, rank 1 in its own (synced through shared
memory by train rank 0); on devices of their own (broadcast)."""


@pytest.fixture(scope="module", params=list(INFER_DEVICES))
def roles(request, ray_session, tiny_model_dir):
    before = _slots()  # other runs on this machine may hold slots of their own
    with Roles(CLUSTER, role_configs(tiny_model_dir, INFER_DEVICES[request.param]), rpc_timeout=120,
               system_envs={"RL_TEST_FLAG": request.param}) as started:  # fmt: skip
        yield started
    assert not _slots() - before, "colocated sync left shared-memory slots behind"


def _slots() -> set[str]:
    return {path.name for path in SHM_DIR.glob("rl_sync_*")}


ROLLOUTS: dict[str, object] = {}
"""The first mode's rollout, which the other modes must reproduce."""


def _mode(roles) -> str:
    devices = sorted(roles.plan.roles["actor_infer"].device_ids)
    return next(mode for mode, mapping in INFER_DEVICES.items() if mapping == devices)


def test_generate_score_train_sync_and_rescore(roles, tiny_model_dir, tmp_path):
    mode = _mode(roles)
    colocated = roles.plan.is_colocated("actor_train", "actor_infer")
    assert colocated == (mode != "separate")
    hosted = {"shared_processes": {0: 0, 1: 1}, "partly_shared": {0: 1}, "separate": None}[mode]
    assert roles.shared == ({"actor_infer": Guest("actor_train", hosted)} if hosted else {})  # reference: own envs
    train_pids, infer_pids = roles["actor_train"].call("pid"), roles["actor_infer"].call("pid")
    assert [pid in train_pids for pid in infer_pids] == [rank in (hosted or {}) for rank in range(2)]
    assert all(infer_pids[rank] == train_pids[host] for rank, host in (hosted or {}).items())
    assert not set(roles["reference"].call("pid")) & {*train_pids, *infer_pids}
    rollout = roles["actor_infer"].call("generate", prompt_batch(tiny_model_dir, QUESTIONS), dispatch="dp_split")
    mask = rollout.batch["response_mask"]
    assert len(rollout) == 8
    first = ROLLOUTS.setdefault("first", rollout)  # every mode samples the same tokens, bit for bit
    for key in ("responses", "rollout_log_probs"):
        assert torch.equal(rollout.batch[key], first.batch[key]), key
    old = roles["actor_train"].call("compute_log_probs", rollout, dispatch="dp_split").batch["log_probs"]
    ref = roles["reference"].call("compute_log_probs", rollout, dispatch="dp_split").batch["log_probs"]
    torch.testing.assert_close(old[mask], rollout.batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ref[mask], old[mask], atol=1e-6, rtol=0)

    rollout.batch["old_log_probs"] = old
    rollout.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    roles.activate("actor_train")
    metrics = roles["actor_train"].call("train_step", rollout, ActorObjective(), dispatch="dp_split")
    assert metrics[0] == metrics[1]  # reduced over ranks
    assert {"actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/pg_clipfrac"} <= set(metrics[0])

    roles.activate("actor_infer")
    slots_before = _slots()
    sync = roles.model_updater(bucket_bytes=100_000).sync()
    assert sync["model_update/tensors"] == 26  # 27 HF names; the tied lm_head travels once
    assert sync["model_update/buckets"] >= 3 and sync["time/model_update"] > 0
    assert len(_slots() - slots_before) == (2 if mode == "partly_shared" else 0)  # train rank 0's two slots
    new_train = roles["actor_train"].call("compute_log_probs", rollout, dispatch="dp_split").batch["log_probs"]
    new_infer = roles["actor_infer"].call("compute_log_probs", rollout, dispatch="dp_split").batch["log_probs"]
    torch.testing.assert_close(new_infer[mask], new_train[mask], atol=1e-6, rtol=0)
    assert float((new_train - old)[mask].abs().max()) > 1e-2  # the step really changed the policy
    unchanged_ref = roles["reference"].call("compute_log_probs", rollout, dispatch="dp_split").batch["log_probs"]
    assert torch.equal(unchanged_ref, ref)

    # The same update on one rank in this process: identical within float tolerance.
    single = create_strategy(
        worker_config(tiny_model_dir, "actor_train", training_args={**TRAIN_ARGS, "per_device_train_batch_size": 4},
                      infer_batch_size=4), "actor_train")  # fmt: skip
    single.initialize()
    single_metrics = single.train_step(rollout, ActorObjective())
    assert single_metrics["pg_loss"] == pytest.approx(metrics[0]["actor/pg_loss"], abs=1e-6)
    assert single_metrics["grad_norm"] == pytest.approx(metrics[0]["actor/grad_norm"], rel=1e-5)
    torch.testing.assert_close(single.compute_log_probs(rollout).batch["log_probs"][mask], new_train[mask],
                               atol=1e-5, rtol=0)  # fmt: skip

    # A two-rank checkpoint resumes on one rank (sharded state is re-split on load).
    roles["actor_train"].call("save_checkpoint", str(tmp_path / "ckpt"))
    resumed = create_strategy(single.config, "actor_train")
    resumed.initialize()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(resumed.compute_log_probs(rollout).batch["log_probs"], new_train, atol=0, rtol=0)


def test_system_envs_reach_every_worker_of_every_role(roles):
    expected = _mode(roles)
    for role in ("actor_train", "actor_infer", "reference"):
        assert roles[role].call("get_env", "RL_TEST_FLAG") == [expected] * roles[role].world_size
    # a hosted rank sees its own rank variables, its host its own
    assert roles["actor_infer"].call("get_env", "RANK") == ["0", "1"]
    assert roles["actor_train"].call("get_env", "RANK") == ["0", "1"]
    # a role's own system_envs (ROLL's per-worker key) reach that role's workers, and only them
    assert roles["reference"].call("get_env", "RL_ROLE_FLAG") == ["reference only"]
    assert roles["actor_train"].call("get_env", "RL_ROLE_FLAG") == [None, None]


def test_a_bad_device_mapping_fails_before_any_worker_starts(ray_session, tiny_model_dir):
    configs = role_configs(tiny_model_dir, [3, 4])
    with pytest.raises(PlacementError, match=r"actor_infer\.device_mapping uses device ids \[4\]"):
        Roles(CLUSTER, configs, rpc_timeout=60)


def test_an_unknown_or_misplaced_strategy_fails_naming_the_key(ray_session, tiny_model_dir):
    configs = role_configs(tiny_model_dir, [2, 3])
    configs["reference"].strategy_args.strategy_name = "megatron_inference"
    with pytest.raises(ValueError, match=r"reference\.strategy_args\.strategy_name='megatron_inference' is not"):
        Roles(CLUSTER, configs, rpc_timeout=60)
    configs["reference"].strategy_args.strategy_name = "hf_infer"
    configs["actor_train"].strategy_args.strategy_name = "hf_infer"
    with pytest.raises(
        ValueError, match=r"actor_train\.strategy_args\.strategy_name=.hf_infer. is an inference strategy"
    ):
        Roles(CLUSTER, configs, rpc_timeout=60)

"""Which roles share worker processes (rl_engines.shared_processes), and a guest's own random streams.

The Ray end of it (a shared actor_infer generates, syncs in process and scores as trained, in the same pids as
actor_train) is ``test_engines_roles.py``'s ``shared_processes`` mode.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from engine_fixtures import worker_config

from rl_engines.placement import ClusterSpec
from rl_engines.roles import plan_roles
from rl_engines.shared_processes import Guest, GuestContext, plan_sharing

CLUSTER = ClusterSpec(num_nodes=1, num_gpus_per_node=4)
MODEL = "/nonexistent/tiny"  # configs only: no model is loaded


def _role(role, mapping, strategy, **extra):
    return worker_config(MODEL, role, device_mapping=mapping, strategy_args={"strategy_name": strategy}, **extra)


def _sharing(configs, envs=None):
    envs = envs or {}
    return plan_sharing(plan_roles(CLUSTER, configs), configs, {name: envs.get(name, {}) for name in configs})


def test_an_hf_infer_rank_on_the_devices_of_a_train_rank_runs_in_its_process():
    configs = {"actor_infer": _role("actor_infer", [1, 0, 3], "hf_infer"),  # listed before its host
               "actor_train": _role("actor_train", [0, 1], "fsdp2_train"),
               "reference": _role("reference", [1], "hf_infer"),
               "rewards.judge": _role("rewards.judge", [2], "hf_infer"),
               "critic": _role("critic", [2], "fsdp2_train")}  # fmt: skip
    assert _sharing(configs) == {
        "actor_infer": Guest("actor_train", {0: 1, 1: 0}),  # rank 2 (device 3) in a process of its own
        "reference": Guest("actor_train", {0: 1}),
        "rewards.judge": Guest("critic", {0: 0}),
    }


@pytest.mark.parametrize(
    ("infer", "envs", "why"),
    [
        (_role("actor_infer", [2, 3], "hf_infer"), {}, "other devices"),
        (_role("actor_infer", [0, 1], "hf_infer", num_gpus_per_worker=2), {}, "two devices per rank"),
        (_role("actor_infer", [0, 1], "hf_infer"), {"actor_infer": {"FLAG": "1"}}, "system_envs of its own"),
        (_role("actor_infer", [0, 1], "fsdp2_infer"), {}, "a strategy with a process group"),
    ],
    ids=["devices", "devices_per_rank", "system_envs", "strategy"],
)
def test_a_role_keeps_processes_of_its_own_unless_results_cannot_differ(infer, envs, why):
    configs = {"actor_train": _role("actor_train", [0, 1], "fsdp2_train"), "actor_infer": infer}
    assert _sharing(configs, envs) == {}, why


def test_actor_infer_is_hosted_only_by_the_role_that_syncs_weights_into_it():
    configs = {"reference": _role("reference", [0, 1], "hf_infer"),
               "actor_infer": _role("actor_infer", [0, 1], "hf_infer"),
               "actor_train": _role("actor_train", [2, 3], "fsdp2_train")}  # fmt: skip
    assert _sharing(configs) == {}  # actor_infer keeps its own, and no host is left for reference
    configs["reference"] = _role("reference", [2, 3], "hf_infer")
    assert _sharing(configs) == {"reference": Guest("actor_train", {0: 0, 1: 1})}


def _draws():
    return torch.rand(3), random.random(), float(np.random.rand())  # noqa: NPY002 (the global streams)


def test_a_guest_and_its_host_each_draw_their_own_streams_and_see_their_own_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)  # noqa: NPY002
    host_alone = [_draws(), _draws()]
    torch.manual_seed(2)
    random.seed(2)
    np.random.seed(2)  # noqa: NPY002
    guest_alone = [_draws(), _draws()]

    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)  # noqa: NPY002
    guest = GuestContext({"RANK": "5"})
    interleaved_host, interleaved_guest = [], []
    with guest.active():  # the guest seeds itself in its first call, as a role's initialize does
        assert os.environ["RANK"] == "5"
        torch.manual_seed(2)
        random.seed(2)
        np.random.seed(2)  # noqa: NPY002
        interleaved_guest.append(_draws())
    interleaved_host.append(_draws())
    with guest.active():
        interleaved_guest.append(_draws())
    interleaved_host.append(_draws())
    assert os.environ["RANK"] == "1"
    for got, want in ((interleaved_host, host_alone), (interleaved_guest, guest_alone)):
        for (t, p, n), (t0, p0, n0) in zip(got, want):
            assert torch.equal(t, t0) and p == p0 and n == n0

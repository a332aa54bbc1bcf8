"""Expert parallelism in fsdp2_train / fsdp2_infer (ROLL's strategy_config ep_size / efsdp_size, its
qwen3-30BA3B-rlvr_fsdp2/rlvr_config_ep.yaml): on two Ray ranks at ep_size 2 each rank holds half of every MoE layer's
experts and the tokens of both ranks reach them. Expected values come from fsdp2_train on one rank in this process
(the same 4 samples per optimizer step, router loss on): scores, the update, the export, a weight sync into hf_infer,
and a resumed checkpoint against the uninterrupted run."""

from __future__ import annotations

import json

import pytest
import ray
import torch
from engine_fixtures import CORPUS, assert_actor_step_equals, rollout_batch, worker_config

from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_moe_lm, build_tiny_tokenizer

ROUTER = {"moe_aux_loss_coef": 0.5}
"""The router load-balancing loss, large so that a wrong or missing router gradient shows."""
ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "adam_epsilon": 1e-4}
EP2 = {"ep_size": 2, "moe_use_grouped_mm": False, "wrap_policy": {"moe_experts": ["Qwen2MoeExperts"]}}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Qwen2-MoE: 4 experts per layer, a shared expert behind a sigmoid gate (dense, not split)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("qwen2_moe_ep")
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    build_tiny_moe_lm(path, model_type="qwen2_moe", vocab_size=len(AutoTokenizer.from_pretrained(str(path))))
    return path


def local_experts(worker):
    """(ep rank, global shape of layer 0's stacked gate/up experts) on a worker: its own experts only."""
    strategy = worker.strategy
    experts = strategy.model.model.layers[0].mlp.experts.gate_up_proj
    return strategy.expert_mesh.ep_rank, tuple(experts.shape)


def single(moe_dir):
    config = worker_config(moe_dir, training_args={**ARGS, "gradient_accumulation_steps": 2}, model_args=ROUTER)
    strategy = create_strategy(config, "actor_train")
    strategy.initialize()
    return strategy


def test_expert_parallel_ranks_score_train_sync_and_resume_as_one_model(moe_dir, ray_session, tmp_path):
    configs = {
        "actor_train": worker_config(moe_dir, "actor_train", device_mapping=[0, 1], training_args=ARGS,
                                     infer_batch_size=4, model_args=ROUTER,
                                     strategy_args={"strategy_name": "fsdp2_train", "strategy_config": EP2}),
        "reference": worker_config(moe_dir, "reference", device_mapping=[0, 1], infer_batch_size=4,
                                   strategy_args={"strategy_name": "fsdp2_infer", "strategy_config": EP2}),
        "actor_infer": worker_config(moe_dir, "actor_infer", device_mapping=[0], infer_batch_size=4,
                                     strategy_args={"strategy_name": "hf_infer"}),
    }  # fmt: skip
    one = single(moe_dir)
    batch, later = rollout_batch(batch_size=8, seed=7), rollout_batch(batch_size=8, seed=8)
    mask = batch.batch["response_mask"].bool()
    spread = batch.reorder([0, 1, 4, 5, 2, 3, 6, 7])  # rank 0: samples 0-3, rank 1: 4-7; one step takes 2 + 2
    with Roles(ClusterSpec(1, 2), configs, rpc_timeout=120) as roles:
        train = roles["actor_train"]
        held = ray.get([actor.__ray_call__.remote(local_experts) for actor in train.actors])
        assert [rank for rank, _ in held] == [0, 1] and all(shape[0] == 2 for _, shape in held)  # 2 of 4 each
        expected = one.compute_log_probs(batch).batch["log_probs"]
        for role in ("actor_train", "reference"):
            scored = roles[role].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
            torch.testing.assert_close(scored[mask], expected[mask], atol=1e-6, rtol=0, msg=role)
        batch.batch["old_log_probs"] = expected
        spread.batch["old_log_probs"] = expected[[0, 1, 4, 5, 2, 3, 6, 7]]
        ours = train.call("train_step", spread, ActorObjective(), dispatch="dp_split")
        theirs = one.train_step(batch, ActorObjective())
        assert_actor_step_equals(ours, theirs, router=True)

        train.call("save_hf", str(tmp_path / "hf"))
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
        for name, value in one.named_weights():  # every expert of both ranks, in expert order
            torch.testing.assert_close(exported[name], value, atol=2e-6, rtol=0, msg=name)
        roles.model_updater().sync()
        trained = one.compute_log_probs(batch).batch["log_probs"]
        synced = roles["actor_infer"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        torch.testing.assert_close(synced[mask], trained[mask], atol=2e-6, rtol=0)
        roles.model_updater("actor_train", "reference").sync()  # each reference rank keeps its half of the experts
        synced = roles["reference"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        torch.testing.assert_close(synced[mask], trained[mask], atol=2e-6, rtol=0)

        later.batch["old_log_probs"] = train.call("compute_log_probs", later, dispatch="dp_split").batch["log_probs"]
        train.call("save_checkpoint", str(tmp_path / "ckpt"))
        uninterrupted = train.call("train_step", later, ActorObjective(), dispatch="dp_split")
        train.call("load_checkpoint", str(tmp_path / "ckpt"))
        assert train.call("train_step", later, ActorObjective(), dispatch="dp_split") == uninterrupted
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["ep_size"] == 2


def test_expert_parallelism_under_ulysses_trains_as_one_rank(moe_dir, ray_session):
    """ROLL's file runs ep_size with ulysses_size: on 2 ranks both at 2, the Ulysses group pools its ranks' samples
    and splits every packed row; the experts see both ranks' slices. Scores and the update equal one rank's."""
    model_args = {**ROUTER, "ulysses_size": 2}
    args = {**ARGS, "gradient_accumulation_steps": 2}  # pooled 8 samples: two steps of 4, as on one rank
    configs = {
        "actor_train": worker_config(
            moe_dir,
            "actor_train",
            device_mapping=[0, 1],
            training_args=args,
            infer_batch_size=4,
            model_args=model_args,
            strategy_args={"strategy_name": "fsdp2_train", "strategy_config": EP2},
        )
    }
    one = single(moe_dir)
    batch = rollout_batch(batch_size=8, seed=9)
    mask = batch.batch["response_mask"].bool()
    with Roles(ClusterSpec(1, 2), configs, rpc_timeout=120) as roles:
        train = roles["actor_train"]
        expected = one.compute_log_probs(batch).batch["log_probs"]
        scored = train.call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        torch.testing.assert_close(scored[mask], expected[mask], atol=1e-6, rtol=0)
        batch.batch["old_log_probs"] = expected
        ours = train.call("train_step", batch, ActorObjective(), dispatch="dp_split")[0]
    theirs = one.train_step(batch, ActorObjective())
    for key in ("pg_loss", "grad_norm", "load_balancing_loss"):
        assert ours[f"actor/{key}" if key != "load_balancing_loss" else f"actor_train/{key}"] == pytest.approx(
            theirs[key], rel=1e-5, abs=1e-6), key  # fmt: skip


@pytest.mark.parametrize(
    ("options", "model_args", "message"),
    [
        (
            {"ep_size": 3},
            {},
            r"strategy_config\.efsdp_size=1 x actor_train\.strategy_args\.strategy_config\.ep_size=3 "
            r"= 3 must divide the role's world size 2",
        ),
        ({"ep_size": 2}, {"lora_target": "all-linear"}, r"ep_size with actor_train\.model_args\.lora_target"),
        ({"ep_size": "2"}, {}, r"strategy_config\.ep_size must be int, got str '2'"),
    ],
)
def test_expert_parallel_keys_are_checked_naming_them(moe_dir, options, model_args, message):
    config = worker_config(moe_dir, device_mapping=[0, 1], model_args=model_args,
                           strategy_args={"strategy_name": "fsdp2_train", "strategy_config": options})  # fmt: skip
    with pytest.raises(ValueError, match=message):
        create_strategy(config, "actor_train")


def _ep_layer_worker(rank: int, port: int) -> None:
    """One rank of :func:`test_an_expert_parallel_layer_equals_the_whole_layer_with_unequal_token_counts`."""
    import copy
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from rl_engines.strategies.fsdp2_experts import ExpertMesh, split_experts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))  # a hang fails
    try:
        torch.manual_seed(0)  # the same layer and tokens on both ranks
        config = AutoConfig.for_model("qwen3_moe", hidden_size=16, moe_intermediate_size=8, num_experts=4,
                                      num_experts_per_tok=2)  # fmt: skip
        whole = Qwen3MoeExperts(config)
        for param in whole.parameters():
            nn.init.normal_(param, std=0.3)
        split = nn.ModuleDict({"experts": copy.deepcopy(whole)})
        hidden = torch.randn(8, 16, requires_grad=True)
        index = torch.stack([torch.randperm(4)[:2] for _ in range(8)])
        weights = torch.rand(8, 2, requires_grad=True)
        probe = torch.randn(8, 16)
        (whole(hidden, index, weights) * probe).sum().backward()

        mesh = ExpertMesh(ep=2, efsdp=1, eddp=1, ep_rank=rank, ep_group=dist.group.WORLD, shard_mesh=None)
        split_experts(split, mesh, "test")
        rows = slice(0, 5) if rank == 0 else slice(5, 8)  # 5 and 3 tokens: the shorter rank is padded
        mine, mine_weights = hidden.detach()[rows].requires_grad_(), weights.detach()[rows].requires_grad_()
        out = split["experts"](mine, index[rows], mine_weights)
        (out * probe[rows]).sum().backward()
        expected = whole(hidden, index, weights)[rows]
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(mine.grad, hidden.grad[rows], atol=1e-6, rtol=0)
        torch.testing.assert_close(mine_weights.grad, weights.grad[rows], atol=1e-6, rtol=0)
        experts = slice(2 * rank, 2 * rank + 2)  # this rank's experts get every rank's tokens' gradients
        for name in ("gate_up_proj", "down_proj"):
            got = getattr(split["experts"], name).grad
            torch.testing.assert_close(got, getattr(whole, name).grad[experts], atol=1e-6, rtol=0, msg=name)

        # Activation checkpointing (non-reentrant, early stop on) with every token routed to rank 0's experts: rank 1
        # must still recompute through the layer's collectives, or both ranks wait on each other.
        from torch.utils.checkpoint import checkpoint

        first_two = torch.stack([torch.randperm(2) for _ in range(8)])  # experts 0 and 1: rank 0's
        mine = hidden.detach()[rows].requires_grad_()
        out = checkpoint(lambda h, w: split["experts"](h, first_two[rows], w), mine, weights.detach()[rows],
                         use_reentrant=False)  # fmt: skip
        (out * probe[rows]).sum().backward()
        whole_hidden = hidden.detach().requires_grad_()
        (whole(whole_hidden, first_two, weights.detach()) * probe).sum().backward()
        torch.testing.assert_close(mine.grad, whole_hidden.grad[rows], atol=1e-6, rtol=0)
    finally:
        dist.destroy_process_group()


def test_an_expert_parallel_layer_equals_the_whole_layer_with_unequal_token_counts():
    """Two gloo processes, 5 and 3 tokens: each rank's outputs and gradients (tokens, routing weights) equal the
    whole layer's on its tokens, and each rank's experts get the gradient of every token routed to them."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_ep_layer_worker, args=(port,), nprocs=2, join=True)

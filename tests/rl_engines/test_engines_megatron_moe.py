"""megatron_train / megatron_infer on a mixture-of-experts model (a tiny Qwen3-MoE; the first test also Qwen2-MoE
with its gated shared expert): Megatron's MoE layers score as the HF model, train as fsdp2_train does (router
load-balancing loss on both), export, sync and checkpoint, and the MoE keys are checked against the model.
In-process, a world of one, and expert parallelism at 2 on two Ray ranks (the last test). The harness's megatron
shims stand in for Transformer Engine's names (megatron_shims)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from engine_fixtures import (
    CORPUS,
    assert_actor_step_equals,
    reference_log_probs,
    require_engine,
    rollout_batch,
    worker_config,
)

from rl_ckpt.hf_io import HFCheckpoint
from rl_ckpt.verify import fused_experts
from rl_engines.config import WorkerConfigError
from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_moe_lm, build_tiny_tokenizer

pytest.importorskip("megatron.core")
ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "adam_epsilon": 1e-4}
ROUTER = {"moe_aux_loss_coef": 0.5}
"""The router load-balancing loss on both engines (ROLL's key), large so that a loss left out or wrong shows."""


def _moe_model(tmp_path_factory, model_type):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp(model_type)
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    build_tiny_moe_lm(
        path, model_type=model_type, vocab_size=len(AutoTokenizer.from_pretrained(str(path))), num_key_value_heads=2
    )  # TP = 2 splits the two KV heads
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _moe_model(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    """Qwen2-MoE: q, k, v biases, routing weights not renormalised, a shared expert behind a sigmoid gate."""
    return _moe_model(tmp_path_factory, "qwen2_moe")


def make(model_dir, name="megatron_train", role="actor_train", options=None, model_args=None, **training_args):
    strategy_args = {"strategy_name": require_engine(name), "strategy_config": options or {}}
    config = worker_config(model_dir, role, training_args={**ARGS, **training_args}, infer_batch_size=3,
                           model_args=model_args or {}, strategy_args=strategy_args)  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


@pytest.mark.parametrize("model", ["moe_dir", "qwen2_moe_dir"], ids=["qwen3_moe", "qwen2_moe"])
def test_moe_layers_score_train_and_export_as_the_hf_model_does(model, request, tmp_path):
    from transformers import AutoModelForCausalLM

    from rl_engines.strategies.model_io import forward_log_probs

    moe_dir = request.getfixturevalue(model)

    megatron, fsdp2 = make(moe_dir, model_args=ROUTER), make(moe_dir, "fsdp2_train", model_args=ROUTER)
    batch = rollout_batch(batch_size=4, seed=2)
    mask = batch.batch["response_mask"].bool()
    scored = megatron.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(scored[mask].double(), reference_log_probs(moe_dir, batch)[mask], atol=2e-5, rtol=0)
    batch.batch["old_log_probs"] = scored
    for _ in range(2):  # the router picks the same experts, the experts learn the same (fp32)
        ours, theirs = megatron.train_step(batch, ActorObjective()), fsdp2.train_step(batch, ActorObjective())
        for key in ("pg_loss", "grad_norm", "load_balancing_loss"):  # the router loss over real tokens, as fsdp2's
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    expected = dict(fsdp2.named_weights())  # transformers 5's fused expert tensors; Megatron exports per expert
    exported = fused_experts(dict(megatron.named_weights()), set(expected))
    assert exported.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(exported[name], value, atol=1e-5, rtol=0, msg=name)

    megatron.save_hf(str(tmp_path / "hf"))  # HF's per-expert checkpoint layout, which transformers loads
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        loaded = forward_log_probs(model, batch, torch.device("cpu"))[0]
    trained = megatron.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(loaded[mask], trained[mask], atol=2e-5, rtol=0)

    reference = make(tmp_path / "hf", "megatron_infer", role="reference")  # loads the export, scores alike
    torch.testing.assert_close(reference.compute_log_probs(batch).batch["log_probs"][mask], trained[mask], atol=2e-5,
                               rtol=0)  # fmt: skip


def test_a_moe_checkpoint_resumes_like_the_uninterrupted_run(moe_dir, tmp_path):
    batches = [rollout_batch(batch_size=4, seed=s) for s in (5, 6)]
    first = make(moe_dir)
    batches[0].batch["old_log_probs"] = first.compute_log_probs(batches[0]).batch["log_probs"]
    first.train_step(batches[0], ActorObjective())
    first.save_checkpoint(str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["expert_model_parallel_size"] == 1
    batches[1].batch["old_log_probs"] = first.compute_log_probs(batches[1]).batch["log_probs"]
    expected = first.train_step(batches[1], ActorObjective())
    resumed = make(moe_dir)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.train_step(batches[1], ActorObjective()) == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"expert_model_parallel_size": 3}, r"expert_model_parallel_size=3 does not divide the model's 4 experts"),
        (
            {"expert_tensor_parallel_size": 2},
            r"expert_tensor_parallel_size=2: experts split over the TP ranks as the "
            r"dense layers are \(Megatron's default, tensor_model_parallel_size=1\)",
        ),
        ({"moe_token_dispatcher_type": "flex"}, r"moe_token_dispatcher_type='flex': use one of"),
        ({"moe_aux_loss_coeff": -1.0}, r"strategy_config\.moe_aux_loss_coeff must be a finite number >= 0, got -1"),
    ],
)
def test_moe_keys_are_checked_against_the_model(moe_dir, options, message):
    with pytest.raises(ValueError, match=message):
        make(moe_dir, options=options)


@pytest.mark.parametrize(
    ("options", "model_args", "coef"),
    [
        ({}, {}, 0.001),
        ({}, {"moe_aux_loss_coef": 0.1}, 0.1),
        ({"moe_aux_loss_coeff": 0}, {"moe_aux_loss_coef": 0.1}, 0),
    ],
    ids=["model_config", "model_args", "strategy_config"],
)
def test_the_router_loss_coefficient_is_picked_as_roll_picks_it(moe_dir, options, model_args, coef):
    """Megatron's key, else ROLL's model_args key, else the model config's router_aux_loss_coef (0.001 here)."""
    config = make(moe_dir, options=options, model_args=model_args).model.module.config
    assert config.moe_aux_loss_coeff == coef
    assert config.moe_router_load_balancing_type == ("aux_loss" if coef else "none")


def test_moe_layer_recompute_recomputes_the_moe_layers_with_the_same_update(moe_dir):
    """ROLL's moe_layer_recompute, and recompute_modules naming moe (its Qwen3-VL-30B-A3B / Qwen3.5 files: "moe,
    layernorm"), reach Megatron (selective recompute of the MoE layers, as megatron-core maps the deprecated switch)
    and change memory, not the update. The norms' recompute needs Transformer Engine: without it, it is left out and
    reported. With full recompute moe_layer_recompute is refused naming both keys."""
    from rl_engines.strategies.megatron_config import describe_unused_switches

    batch = rollout_batch(batch_size=4, seed=9)
    results = []
    rolls = {"recompute_granularity": "selective", "recompute_modules": "moe,layernorm"}
    for options in ({}, {"moe_layer_recompute": True}, rolls):
        strategy = make(moe_dir, options=options)
        config = strategy.model.module.config
        assert ("moe" in config.recompute_modules) == bool(options)
        assert config.recompute_granularity == ("selective" if options else None)
        if options is rolls and importlib.util.find_spec("transformer_engine") is None:
            assert "layernorm" not in config.recompute_modules
            assert "recompute_modules.layernorm: megatron-core's norm recompute" in describe_unused_switches(
                strategy.options, "actor_train")  # fmt: skip
        batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
        results.append(strategy.train_step(batch, ActorObjective()))
    assert results[0] == results[1] == results[2]
    with pytest.raises(ValueError, match=r"moe_layer_recompute=true with recompute_granularity: full"):
        make(moe_dir, options={"moe_layer_recompute": True, "recompute_granularity": "full"})


def test_moe_keys_on_a_dense_model_are_refused_naming_them(tmp_path):
    from rl_engines.tiny_model import build_tiny_causal_lm

    build_tiny_tokenizer(tmp_path, CORPUS, vocab_size=256)
    build_tiny_causal_lm(tmp_path, vocab_size=259)
    with pytest.raises(ValueError, match=r"strategy_config\.expert_model_parallel_size', .*moe_grouped_gemm'\] apply "
                                         r"to MoE models; actor_train's model is a dense qwen2"):  # fmt: skip
        make(tmp_path, options={"expert_model_parallel_size": 2, "moe_grouped_gemm": True})
    with pytest.raises(ValueError, match=r"strategy_config\.recompute_modules'\] apply to MoE models"):
        make(tmp_path, options={"recompute_granularity": "selective", "recompute_modules": "core_attn,moe"})
    with pytest.raises(WorkerConfigError, match=r"actor_train\.model_args\.moe_aux_loss_coef=0\.1 .* dense model"):
        make(tmp_path, model_args={"moe_aux_loss_coef": 0.1})


def test_the_alltoall_dispatcher_runs_as_allgather_without_cuda_and_says_so(moe_dir):
    from rl_engines.strategies.megatron_config import describe_unused_switches, parse_megatron_options

    options = parse_megatron_options({"moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True},
                                     "actor_train", train=True, dtype="fp32")  # fmt: skip
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the alltoall dispatcher runs")
    assert options.moe_token_dispatcher_type == "allgather"
    line = describe_unused_switches(options, "actor_train")
    assert "moe_token_dispatcher_type: the alltoall dispatcher" in line and "moe_grouped_gemm: Transformer" in line


def test_expert_parallel_ranks_train_sync_and_checkpoint_as_one_model(moe_dir, ray_session, tmp_path):
    """expert_model_parallel_size 2 on 2 Ray ranks (each holds 2 of the 4 experts of a layer, tokens exchanged by the
    allgather dispatcher): the update equals fsdp2_train's on the HF model (router loss on), a weight sync into a
    colocated hf_infer (HF's per-expert names, gathered over the ranks) scores as the trained model, a checkpoint holds
    each rank's experts in its own file and resuming equals the uninterrupted run. With ROLL's
    use_distributed_optimizer: the dense tensors' state is split over the two data-parallel ranks, each rank keeps
    its own experts' (no other rank holds them)."""

    from rl_engines.placement import ClusterSpec
    from rl_engines.roles import Roles

    train_args = {**ARGS, "per_device_train_batch_size": 2}  # 2 ranks x 2 samples: 4 per optimizer step
    options = {"expert_model_parallel_size": 2, "use_distributed_optimizer": True}
    configs = {
        "actor_train": worker_config(moe_dir, "actor_train", device_mapping=[0, 1], training_args=train_args,
                                     infer_batch_size=4, model_args=ROUTER,
                                     strategy_args={"strategy_name": "megatron_train", "strategy_config": options}),
        "actor_infer": worker_config(moe_dir, "actor_infer", device_mapping=[0], infer_batch_size=4,
                                     strategy_args={"strategy_name": "hf_infer"}),
    }  # fmt: skip
    single = make(
        moe_dir, "fsdp2_train", model_args=ROUTER, gradient_accumulation_steps=2
    )  # the same 4 samples per optimizer step
    batch, later = rollout_batch(batch_size=8, seed=7), rollout_batch(batch_size=8, seed=8)
    mask = batch.batch["response_mask"].bool()
    # rank 0 takes the first half, rank 1 the second: mini-batches {0, 1, 2, 3} and {4, 5, 6, 7} on both engines
    spread = batch.reorder([0, 1, 4, 5, 2, 3, 6, 7])
    with Roles(ClusterSpec(1, 2), configs, rpc_timeout=120) as roles:
        train = roles["actor_train"]
        batch.batch["old_log_probs"] = single.compute_log_probs(batch).batch["log_probs"]
        spread.batch["old_log_probs"] = batch.batch["old_log_probs"][[0, 1, 4, 5, 2, 3, 6, 7]]
        ours = train.call("train_step", spread, ActorObjective(), dispatch="dp_split")
        # the router loss of each rank's micro-batch, weighted 1 / 2 on both engines
        assert_actor_step_equals(ours, single.train_step(batch, ActorObjective()), router=True)
        roles.model_updater().sync()
        synced = roles["actor_infer"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        trained = single.compute_log_probs(batch).batch["log_probs"]
        torch.testing.assert_close(synced[mask], trained[mask], atol=2e-5, rtol=0)

        later.batch["old_log_probs"] = trained = train.call("compute_log_probs", later, dispatch="dp_split").batch[
            "log_probs"]  # fmt: skip
        train.call("save_checkpoint", str(tmp_path / "ckpt"))
        uninterrupted = train.call("train_step", later, ActorObjective(), dispatch="dp_split")
        train.call("save_hf", str(tmp_path / "hf_uninterrupted"))
        train.call("load_checkpoint", str(tmp_path / "ckpt"))
        assert train.call("train_step", later, ActorObjective(), dispatch="dp_split") == uninterrupted
        train.call("save_hf", str(tmp_path / "hf_resumed"))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("mp_rank_*.pt")) == [
        "mp_rank_00_000.pt",
        "mp_rank_00_001.pt",
    ]
    files = [torch.load(tmp_path / "ckpt" / f"mp_rank_00_00{r}.pt", weights_only=True)["model"] for r in (0, 1)]
    expert, router = (
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
        "decoder.layers.0.mlp.router.weight",
    )
    assert not torch.equal(files[0][expert], files[1][expert])  # local expert 0: global experts 0 and 2
    assert torch.equal(files[0][router], files[1][router])  # replicated
    states = [torch.load(tmp_path / "ckpt" / f"optim_mp_rank_00_00{r}_dp_rank_00{r}.pt", weights_only=True)["state"]
              for r in (0, 1)]  # fmt: skip
    dense = [{name for name in state if ".mlp.experts." not in name} for state in states]
    assert dense[0].isdisjoint(dense[1]) and dense[0] and dense[1] and router in dense[0] | dense[1]
    assert all(expert in state for state in states)  # each rank's own local expert 0
    from rl_ckpt.hf_io import HFCheckpoint

    a, b = HFCheckpoint(tmp_path / "hf_uninterrupted"), HFCheckpoint(tmp_path / "hf_resumed")
    assert sum(".mlp.experts." in name for name in a.weight_map) == 2 * 4 * 3  # 2 layers x 4 experts x 3 projections
    assert all(torch.equal(a.get(name), b.get(name)) for name in a.weight_map)


def test_experts_split_over_tensor_parallel_ranks_train_sync_and_checkpoint_as_one_model(qwen2_moe_dir, ray_session,
                                                                                          tmp_path):  # fmt: skip
    """tensor_model_parallel_size 2 with sequence parallelism (as megatron-core requires for MoE training at TP > 1)
    on Qwen2-MoE: each TP rank holds its half of every expert and of the shared expert (Megatron's expert tensor
    parallelism at its default size), tokens of both sequence halves reach the experts through the allgather
    dispatcher. Scores equal the HF model's, the update fsdp2_train's (router loss on: the router's and the shared
    expert gate's gradients summed over the sequence halves), the export HF's layout (experts gathered over TP), a
    weight sync into a colocated hf_infer scores as the trained model and resuming a checkpoint (a file per TP rank)
    equals the uninterrupted run; megatron_infer at TP 2 without sequence parallelism scores alike. A train role at
    TP 2 without sequence parallelism is refused naming the key."""
    from rl_engines.placement import ClusterSpec
    from rl_engines.roles import Roles

    model = qwen2_moe_dir
    options = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    configs = {
        "actor_train": worker_config(model, "actor_train", device_mapping=[0, 1], training_args=ARGS,
                                     infer_batch_size=4, model_args=ROUTER,
                                     strategy_args={"strategy_name": "megatron_train", "strategy_config": options}),
        "actor_infer": worker_config(model, "actor_infer", device_mapping=[0], infer_batch_size=4,
                                     strategy_args={"strategy_name": "hf_infer"}),
        "reference": worker_config(model, "reference", device_mapping=[0, 1], infer_batch_size=4,
                                   strategy_args={"strategy_name": "megatron_infer",
                                                  "strategy_config": {"tensor_model_parallel_size": 2}}),
    }  # fmt: skip
    single = make(model, "fsdp2_train", model_args=ROUTER)
    batch, later = rollout_batch(batch_size=4, seed=7), rollout_batch(batch_size=4, seed=8)
    mask = batch.batch["response_mask"].bool()
    with Roles(ClusterSpec(1, 2), configs, rpc_timeout=120) as roles:
        train = roles["actor_train"]
        scored = train.call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        torch.testing.assert_close(scored[mask].double(), reference_log_probs(model, batch)[mask], atol=2e-5, rtol=0)
        # megatron_infer at TP 2 without sequence parallelism (megatron-core's rule binds training only)
        frozen = roles["reference"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        torch.testing.assert_close(frozen[mask], scored[mask], atol=2e-6, rtol=0)
        batch.batch["old_log_probs"] = scored
        ours = train.call("train_step", batch, ActorObjective(), dispatch="dp_split")
        theirs = single.train_step(batch, ActorObjective())
        assert_actor_step_equals(ours, theirs, router=True)
        train.call("save_hf", str(tmp_path / "hf_step1"))
        saved = HFCheckpoint(tmp_path / "hf_step1")
        exported = {name: saved.get(name) for name in saved.weight_map}
        expected = dict(single.named_weights())
        exported = fused_experts(exported, set(expected))
        assert exported.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(exported[name], value, atol=1e-5, rtol=0, msg=name)
        roles.model_updater().sync()
        synced = roles["actor_infer"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        trained = single.compute_log_probs(batch).batch["log_probs"]
        torch.testing.assert_close(synced[mask], trained[mask], atol=2e-5, rtol=0)

        later.batch["old_log_probs"] = train.call("compute_log_probs", later, dispatch="dp_split").batch["log_probs"]
        train.call("save_checkpoint", str(tmp_path / "ckpt"))
        uninterrupted = train.call("train_step", later, ActorObjective(), dispatch="dp_split")
        train.call("load_checkpoint", str(tmp_path / "ckpt"))
        assert train.call("train_step", later, ActorObjective(), dispatch="dp_split") == uninterrupted
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("mp_rank_*.pt")) == ["mp_rank_00.pt", "mp_rank_01.pt"]
    refused = r"tensor_model_parallel_size=2 on a MoE model \(qwen2_moe\) without actor_train\.strategy_args\."
    with pytest.raises(ValueError, match=refused + r"strategy_config\.sequence_parallel"):
        make(model, options={"tensor_model_parallel_size": 2})


def test_pipeline_stages_add_their_layers_router_loss_as_one_model(moe_dir, ray_session, tmp_path):
    """pipeline_model_parallel_size 2 on 2 Ray ranks, one layer each: every stage's router loss reaches the update
    and the reported load_balancing_loss (the stages' layers together), as fsdp2_train's on one rank."""

    from rl_engines.placement import ClusterSpec
    from rl_engines.roles import Roles

    train_args = {**ARGS, "gradient_accumulation_steps": 2}  # one replica: 2 micro-batches of 2 per step
    options = {"pipeline_model_parallel_size": 2}
    configs = {"actor_train": worker_config(
        moe_dir, "actor_train", device_mapping=[0, 1], training_args=train_args, infer_batch_size=4, model_args=ROUTER,
        strategy_args={"strategy_name": "megatron_train", "strategy_config": options})}  # fmt: skip
    single = make(moe_dir, "fsdp2_train", model_args=ROUTER, gradient_accumulation_steps=2)
    batch = rollout_batch(batch_size=4, seed=7)
    batch.batch["old_log_probs"] = single.compute_log_probs(batch).batch["log_probs"]
    with Roles(ClusterSpec(1, 2), configs, rpc_timeout=120) as roles:
        ours = roles["actor_train"].call("train_step", batch, ActorObjective(), dispatch="dp_split")[0]  # pooled
    theirs = single.train_step(batch, ActorObjective())
    assert ours["actor/pg_loss"] == pytest.approx(theirs["pg_loss"], abs=1e-6)
    assert ours["actor/grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert ours["actor_train/load_balancing_loss"] == pytest.approx(theirs["load_balancing_loss"], rel=1e-5)


def test_lora_on_a_moe_model_is_refused_naming_the_key(moe_dir):
    with pytest.raises(ValueError, match=r"actor_train\.model_args\.lora_target is set on a mixture-of-experts model"):
        make(moe_dir, model_args={"lora_target": "all-linear"})

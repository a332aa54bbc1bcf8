"""megatron_train / megatron_infer with pipeline_model_parallel_size=2 on Ray ranks (CPU, gloo, real megatron-core).

PP=2 on two ranks (one data-parallel replica; the actor and the reference with a virtual pipeline of 2 chunks per
stage, Megatron's interleaved schedule), and TP=2 x PP=2 on four. Expected values are independent: the HF
model's log-probs (one un-padded forward per token, engine_fixtures), fsdp2_train doing the same update on one rank
in this process, megatron_train at PP=1 in this process (weight export, the critic), and an uninterrupted run for
checkpoint resume. The workers apply the test-harness shims (megatron_shims) through the session's start-up
hook; the test reads strategy internals on a worker through Ray's ``__ray_call__``.
"""

from __future__ import annotations

import pytest
import ray
import torch
from engine_fixtures import (
    CORPUS,
    assert_critic_matches,
    prompt_batch,
    reference_log_probs,
    require_engine,
    rollout_batch,
    worker_config,
)
from pipeline_schedule_stages import chain, micro_batches, micro_loss, run_chain

from rl_engines.config import GeneratingArgs
from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

pytest.importorskip("megatron.core")

PP2 = {"pipeline_model_parallel_size": 2}
VPP2 = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
TP2_PP2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
# As test_engines_megatron: 2 optimizer steps of 4 samples per 8-sample batch; adam_epsilon 1e-4 so that rounding
# noise of near-zero gradients is not amplified into visible steps.
TRAIN_ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
              "adam_epsilon": 1e-4, "lr_scheduler_type": "linear", "max_steps": 10}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny tied-embedding Qwen2 with 4 layers (2 per stage, so stage 1 numbers its layers from an offset) and
    4 query heads in 2 KV groups (TP=2 splits whole KV groups)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_pp")
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    vocab = len(AutoTokenizer.from_pretrained(str(path)))
    build_tiny_causal_lm(path, vocab_size=vocab, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         seed=3)  # fmt: skip
    return path


def megatron(name, strategy_config, **sections):
    return {"strategy_args": {"strategy_name": name, "strategy_config": strategy_config}, **sections}


def start_roles(cluster, configs, tmp_path_factory):
    """The roles on the session's shared Ray (each class's fixture asks for ``ray_session``)."""
    with Roles(cluster, configs, rpc_timeout=180) as started:
        yield started


# ---- run on a worker (worker = the RoleWorker instance) ---------------------------------------------------------
def on_ranks(group, fn, *args):
    """``fn(worker, *args)`` on every rank at once (the strategies run collectives)."""
    return ray.get([actor.__ray_call__.remote(fn, *args) for actor in group.actors])


def exported(worker):
    return [(name, value.clone()) for name, value in worker.strategy.named_weights()]


def parameter_names(worker):
    return sorted(name for name, _ in worker.strategy.model.module.named_parameters())


# ---- references in this process ---------------------------------------------------------------------------------
def hf_state(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()


def fsdp2(model_dir):
    strategy = create_strategy(worker_config(model_dir, training_args=TRAIN_ARGS, infer_batch_size=4), "actor_train")
    strategy.initialize()
    return strategy


def megatron_pp1(model_dir, role="actor_train", strategy_config=None):
    """megatron_train at TP = PP = 1 in this process (a world of one)."""
    require_engine("megatron_train")
    config = worker_config(model_dir, role, training_args=TRAIN_ARGS, infer_batch_size=4,
                           **megatron("megatron_train", strategy_config or {}))  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


def with_old_log_probs(group, batch):
    batch.batch["old_log_probs"] = group.call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    return batch


def schedule_chain(worker, chunks):
    return run_chain(worker.strategy.model.stage, chunks)


# ---- PP = 2 on two ranks ----------------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def pp2_roles(ray_session, tiny_model_dir, tmp_path_factory):
    common = {"device_mapping": [0, 1], "infer_batch_size": 4}
    configs = {
        "actor_train": worker_config(tiny_model_dir, "actor_train", training_args=TRAIN_ARGS, **common,
                                     **megatron("megatron_train", VPP2)),
        "reference": worker_config(tiny_model_dir, "reference", **common, **megatron("megatron_infer", VPP2)),
        "critic": worker_config(tiny_model_dir, "critic", training_args=TRAIN_ARGS, **common,
                                **megatron("megatron_train", PP2)),
    }  # fmt: skip
    yield from start_roles(ClusterSpec(num_nodes=1, num_gpus_per_node=2), configs, tmp_path_factory)


class TestPipelineTwoStages:
    def test_each_stage_holds_its_layers_and_export_equals_pp1(self, pp2_roles, tiny_model_dir):
        first, last = on_ranks(pp2_roles["actor_train"], parameter_names)
        assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
        assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
        assert "output_layer.weight" in last  # the last stage's copy of the tied embedding
        for names in (first, last):  # two of the four layers each, numbered locally
            assert {n.split(".")[2] for n in names if n.startswith("decoder.layers.")} == {"0", "1"}
        # two chunks of one layer per stage: layer k is virtual stage k, on stage k % 2
        assert on_ranks(pp2_roles["actor_train"], lambda w: w.strategy.model.layout.local_layers) == [(0, 2), (1, 3)]
        assert on_ranks(pp2_roles["actor_train"], lambda w: w.strategy.model.stage.grad_group is not None) == [True] * 2
        expected = list(megatron_pp1(tiny_model_dir).named_weights())
        assert [name for name, _ in expected][:2] == ["model.embed_tokens.weight", "lm_head.weight"]
        for group in (pp2_roles["actor_train"], pp2_roles["reference"]):
            for got in on_ranks(group, exported):  # every stage receives every tensor, in PP=1's order
                assert [name for name, _ in got] == [name for name, _ in expected]
                assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))

    def test_pp2_scores_equal_the_hf_model(self, pp2_roles, tiny_model_dir):
        batch = rollout_batch(batch_size=8, seed=1)
        mask = batch.batch["response_mask"]
        expected = reference_log_probs(tiny_model_dir, batch)
        train = pp2_roles["actor_train"].call("compute_log_probs", batch, with_entropy=True, dispatch="dp_split")
        ref = pp2_roles["reference"].call("compute_log_probs", batch, dispatch="dp_split")
        # measured 4.0e-7 (entropy 4.8e-7): fp32, the same sums as at PP=1
        torch.testing.assert_close(train.batch["log_probs"][mask].double(), expected[mask], atol=2e-6, rtol=0)
        torch.testing.assert_close(ref.batch["log_probs"], train.batch["log_probs"], atol=0, rtol=0)
        hf_entropy = fsdp2(tiny_model_dir).compute_log_probs(batch, with_entropy=True).batch["entropy"]
        torch.testing.assert_close(train.batch["entropy"][mask], hf_entropy[mask], atol=2e-6, rtol=0)

    def test_pp2_greedy_generation_follows_hf(self, pp2_roles, tiny_model_dir):
        prompts = prompt_batch(tiny_model_dir, ["1+2=", "10+12=", "3+3=", "4+5="])
        args = {"max_new_tokens": 6, "temperature": 0.0}
        hf = create_strategy(worker_config(tiny_model_dir, "actor_infer", generating_args=args,
                                           strategy_args={"strategy_name": "hf_infer"}), "actor_infer")  # fmt: skip
        hf.initialize()
        expected = hf.generate(prompts)
        got = pp2_roles["reference"].call("generate", prompts, GeneratingArgs(**args), dispatch="dp_split")
        assert torch.equal(got.batch["responses"], expected.batch["responses"])
        assert list(got.non_tensor_batch["finish_reasons"]) == list(expected.non_tensor_batch["finish_reasons"])

    def test_pp2_update_equals_fsdp2_sync_and_resume(self, pp2_roles, tiny_model_dir, tmp_path):
        actor = pp2_roles["actor_train"]
        batch = with_old_log_probs(actor, rollout_batch(batch_size=8, seed=2))
        mask = batch.batch["response_mask"]
        objective = ActorObjective()
        metrics = actor.call("train_step", batch, objective, dispatch="dp_split")
        assert metrics[0] == metrics[1]  # the last stage's metrics, on both stages

        single = fsdp2(tiny_model_dir)
        single_metrics = single.train_step(batch, objective)  # the same 2 optimizer steps of 4 samples each
        # ratio_min / ratio_max: the first stage adds neutral values (a 0 would have been the min)
        for key in ("pg_loss", "total_loss", "ppo_kl", "ratio_mean", "ratio_min", "ratio_max", "approxkl"):
            assert metrics[0][f"actor/{key}"] == pytest.approx(single_metrics[key], abs=1e-6), key
        assert metrics[0]["actor/grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
        actor.call("save_hf", str(tmp_path / "hf_step1"))
        saved, expected = hf_state(tmp_path / "hf_step1"), dict(single.named_weights())
        assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in expected.items()}
        for name, value in expected.items():  # measured max |diff| 9.3e-7 after two lr=1e-2 AdamW steps
            torch.testing.assert_close(saved[name], value, atol=2e-6, rtol=0, msg=name)
        stage_0, stage_1 = on_ranks(actor, exported)  # the tied copies stayed identical (same summed gradient)
        assert torch.equal(stage_0[0][1], stage_1[0][1]) and torch.equal(stage_0[1][1], stage_0[0][1])

        pp2_roles["reference"].call("offload")
        sync = pp2_roles.model_updater("actor_train", "reference", bucket_bytes=30_000).sync()
        assert sync["model_update/tensors"] == len(expected) - 1  # the tied lm_head travels as an alias
        synced = pp2_roles["reference"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        trained = actor.call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        torch.testing.assert_close(synced[mask], trained[mask], atol=0, rtol=0)

        next_batch = rollout_batch(batch_size=8, seed=3)
        next_batch.batch["old_log_probs"] = trained
        actor.call("save_checkpoint", str(tmp_path / "ckpt"))
        files = sorted(p.name for p in (tmp_path / "ckpt").glob("*_rank_*.pt"))
        assert files == ["mp_rank_00_000.pt", "mp_rank_00_001.pt", "optim_mp_rank_00_000_dp_rank_000.pt",
                         "optim_mp_rank_00_001_dp_rank_000.pt"]  # fmt: skip
        uninterrupted = actor.call("train_step", next_batch, objective, dispatch="dp_split")
        actor.call("save_hf", str(tmp_path / "hf_uninterrupted"))
        actor.call("load_checkpoint", str(tmp_path / "ckpt"))
        resumed = actor.call("train_step", next_batch, objective, dispatch="dp_split")
        actor.call("save_hf", str(tmp_path / "hf_resumed"))
        assert resumed == uninterrupted
        a, b = hf_state(tmp_path / "hf_uninterrupted"), hf_state(tmp_path / "hf_resumed")
        assert all(torch.equal(a[name], b[name]) for name in a)

    @pytest.mark.parametrize("chunks", [1, 3], ids=["1f1b", "interleaved"])
    def test_the_schedules_alone_give_the_sequential_gradients(self, pp2_roles, chunks):
        """2 stages of one layer (1F1B), and of 3 chunks of one layer (interleaved: layer k on stage k % 2), over the
        actor's gloo pipeline group; 5 micro-batches (not a multiple of the stages: the interleaved table takes groups
        of 3)."""
        stages = 2
        results = on_ranks(pp2_roles["actor_train"], schedule_chain, chunks)
        layers = chain(stages * chunks)
        expected_losses = {}
        for index, micro in enumerate(micro_batches()):  # the reference: the whole chain, one micro-batch at a time
            hidden = micro
            for layer in layers:
                hidden = torch.tanh(layer(hidden))
            loss = micro_loss(index, hidden)
            loss.backward()
            expected_losses[index] = loss.item()
        assert results[stages - 1][1] == pytest.approx(expected_losses, rel=1e-6)
        for rank in range(stages):
            expected = [p.grad for layer in layers[rank::stages] for p in layer.parameters()]
            for got, grad in zip(results[rank][0], expected, strict=True):
                torch.testing.assert_close(got, grad, atol=1e-6, rtol=1e-6)

    def test_pp2_critic_values_and_update_equal_pp1(self, pp2_roles, tiny_model_dir):
        single = megatron_pp1(tiny_model_dir, "critic")  # the same seeded value head
        # values before the update measured 0 (same sums); after it |values| ~ 1, measured 1.2e-6 on earlier
        # machines and 8.9e-6 on an AVX2-only AMD EPYC (the stages' sums round differently and Adam scales a
        # near-zero gradient's rounding by up to lr / adam_epsilon); a stage whose update went wrong moves the
        # values by ~lr = 1e-2
        assert_critic_matches(pp2_roles["critic"], single, rollout_batch(batch_size=8, seed=4), update_atol=2e-5)


# ---- TP = 2 x PP = 2 on four ranks ------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def tp2_pp2_roles(ray_session, tiny_model_dir, tmp_path_factory):
    configs = {
        "actor_train": worker_config(
            tiny_model_dir,
            "actor_train",
            device_mapping=[0, 1, 2, 3],
            training_args=TRAIN_ARGS,
            infer_batch_size=4,
            **megatron("megatron_train", TP2_PP2),
        )
    }
    yield from start_roles(ClusterSpec(num_nodes=1, num_gpus_per_node=4), configs, tmp_path_factory)


class TestTensorAndPipeline:
    def test_tp2_pp2_scores_and_update_equal_the_references(self, tp2_pp2_roles, tiny_model_dir, tmp_path):
        actor = tp2_pp2_roles["actor_train"]
        batch = rollout_batch(batch_size=8, seed=6)
        mask = batch.batch["response_mask"]
        scored = with_old_log_probs(actor, batch).batch["old_log_probs"]
        expected = reference_log_probs(tiny_model_dir, batch)
        torch.testing.assert_close(scored[mask].double(), expected[mask], atol=2e-6, rtol=0)  # measured 3.9e-7

        objective = ActorObjective()
        metrics = actor.call("train_step", batch, objective, dispatch="dp_split")
        assert all(m == metrics[0] for m in metrics)
        single = fsdp2(tiny_model_dir)
        single_metrics = single.train_step(batch, objective)
        assert metrics[0]["actor/pg_loss"] == pytest.approx(single_metrics["pg_loss"], abs=1e-6)
        assert metrics[0]["actor/grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
        actor.call("save_hf", str(tmp_path / "hf"))
        saved = hf_state(tmp_path / "hf")
        for name, value in single.named_weights():  # measured max |diff| 5.2e-7
            torch.testing.assert_close(saved[name], value, atol=2e-6, rtol=0, msg=name)


# ---- PP = 2 x DP = 2 on four ranks, with the distributed optimizer -----------------------------------------------
@pytest.fixture(scope="class")
def pp2_dp2_roles(ray_session, tiny_model_dir, tmp_path_factory):
    # actor_train alone: megatron_infer scores through the same MegatronModel.score as megatron_train (its PP=2
    # scores are checked above), and each Megatron rank is a process that imports megatron-core (~12 s of CPU).
    configs = {
        "actor_train": worker_config(tiny_model_dir, "actor_train", training_args=TRAIN_ARGS,
                                     device_mapping=[0, 1, 2, 3], infer_batch_size=4,
                                     **megatron("megatron_train", {**PP2, "use_distributed_optimizer": True})),
    }  # fmt: skip
    yield from start_roles(ClusterSpec(num_nodes=1, num_gpus_per_node=4), configs, tmp_path_factory)


class TestPipelineAndDataParallel:
    def test_pp2_dp2_scores_update_and_resume(self, pp2_dp2_roles, tiny_model_dir, tmp_path):
        actor = pp2_dp2_roles["actor_train"]
        batch = rollout_batch(batch_size=8, seed=7)
        mask = batch.batch["response_mask"]
        scored = with_old_log_probs(actor, batch).batch["old_log_probs"]
        expected = reference_log_probs(tiny_model_dir, batch)
        torch.testing.assert_close(scored[mask].double(), expected[mask], atol=2e-6, rtol=0)

        # each replica pools the chunks of its two stages' ranks (rows 0,1,4,5 and 2,3,6,7): one optimizer step of
        # 4 samples per replica, i.e. one step over all 8 on one rank (gradient_accumulation_steps 4)
        objective = ActorObjective()
        metrics = actor.call("train_step", batch, objective, dispatch="dp_split")
        assert all(m == metrics[0] for m in metrics)
        single = create_strategy(worker_config(tiny_model_dir, infer_batch_size=4,
                                               training_args={**TRAIN_ARGS, "gradient_accumulation_steps": 4}),
                                 "actor_train")  # fmt: skip
        single.initialize()
        single_metrics = single.train_step(batch.reorder([0, 1, 4, 5, 2, 3, 6, 7]), objective)
        assert metrics[0]["actor/pg_loss"] == pytest.approx(single_metrics["pg_loss"], abs=1e-6)
        assert metrics[0]["actor/grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
        weights = on_ranks(actor, exported)
        for name, value in single.named_weights():  # measured max |diff| 6.5e-7
            for got in weights:  # every rank: the ZeRO owners' broadcasts and the stages' exports reached it
                torch.testing.assert_close(dict(got)[name], value, atol=2e-6, rtol=0, msg=name)

        actor.call("save_checkpoint", str(tmp_path / "ckpt"))
        files = sorted(p.name for p in (tmp_path / "ckpt").glob("*_rank_*.pt"))
        assert files == ["mp_rank_00_000.pt", "mp_rank_00_001.pt",
                         "optim_mp_rank_00_000_dp_rank_000.pt", "optim_mp_rank_00_000_dp_rank_001.pt",
                         "optim_mp_rank_00_001_dp_rank_000.pt", "optim_mp_rank_00_001_dp_rank_001.pt"]  # fmt: skip
        next_batch = rollout_batch(batch_size=8, seed=8)
        next_batch.batch["old_log_probs"] = scored
        uninterrupted = actor.call("train_step", next_batch, objective, dispatch="dp_split")
        expected_weights = on_ranks(actor, exported)[0]
        actor.call("load_checkpoint", str(tmp_path / "ckpt"))
        assert actor.call("train_step", next_batch, objective, dispatch="dp_split") == uninterrupted
        resumed = on_ranks(actor, exported)[0]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed, expected_weights, strict=True))


def completes(stages, chunks, micros, train):
    """Whether every stage's :func:`stage_steps` runs to the end when each receive blocks until its neighbour
    sent (sends never block), each backward follows its own forward, and messages keep their order
    (:func:`messages_in_order`)."""
    from rl_engines.strategies.megatron_pipeline import stage_steps

    steps = [stage_steps(rank, stages, chunks, micros, train=train) for rank in range(stages)]
    done, position = set(), [0] * stages

    def source(kind, rank, chunk):  # the virtual stage whose message this step waits for
        if kind == "forward":
            return (rank - 1, chunk) if rank else ((stages - 1, chunk - 1) if chunk else None)
        return (rank + 1, chunk) if rank < stages - 1 else ((0, chunk + 1) if chunk < chunks - 1 else None)

    in_order = messages_in_order(steps, stages, chunks, source)
    progressed = True
    while progressed:
        progressed = False
        for rank in range(stages):
            while position[rank] < len(steps[rank]):
                kind, micro, chunk = steps[rank][position[rank]]
                waits = source(kind, rank, chunk)
                if waits is not None and (kind, micro, *waits) not in done:
                    break
                assert kind == "forward" or ("forward", micro, rank, chunk) in done
                done.add((kind, micro, rank, chunk))
                position[rank] += 1
                progressed = True
    return in_order and position == [len(s) for s in steps]


def messages_in_order(steps, stages, chunks, source):
    """Whether, between any two stages and in each direction, the activations (and, apart, the gradients) are
    received in the order they are sent: what a backend without message tags (NCCL) needs, the gradients travelling
    on a group of their own."""
    sent, received = {}, {}
    for rank, stage_steps_ in enumerate(steps):
        for kind, micro, chunk in stage_steps_:
            if (waits := source(kind, rank, chunk)) is not None:
                received.setdefault((waits[0], rank, kind), []).append((micro, chunk))
            for other in range(stages):  # the virtual stage this step's message goes to waits for it
                for other_chunk in range(chunks):
                    if source(kind, other, other_chunk) == (rank, chunk):
                        sent.setdefault((rank, other, kind), []).append((micro, other_chunk))
    return all(sent.get(key, []) == received.get(key, []) for key in {*sent, *received})


def test_interleaved_schedule_never_deadlocks_and_matches_megatron_core():
    """Every stage count, chunk count and micro-batch count up to 6 x 4 x 16 completes (the remainders
    megatron-core refuses take a larger group), each direction's messages arrive in the order they leave, and the
    order is megatron-core's where it has one."""
    from rl_engines.strategies.megatron_pipeline import group_size, schedule_table, stage_steps

    stuck = [(p, v, m, train) for p in range(1, 7) for v in range(1, 5) for m in range(1, 17) for train in (True, False)
             if not completes(p, v, m, train)]  # fmt: skip
    assert stuck == []
    assert group_size(8, 4) == 4 and group_size(5, 4) == 5 and group_size(9, 4) == 5 and group_size(3, 4) == 4
    # megatron-core's docstring example (PP=2, N=3, M=5, VP=2): micro-batch ids 0 1 2 0 1 2 3 4 3 4
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    steps = stage_steps(0, 2, 2, 4, train=True)  # warm-up 2 (p - 1) + (v - 1) p = 4 forwards
    assert steps[:6] == [("forward", 0, 0), ("forward", 1, 0), ("forward", 0, 1), ("forward", 1, 1),
                         ("forward", 2, 0), ("backward", 0, 1)]  # fmt: skip
    assert stage_steps(1, 3, 1, 4, train=True) == [("forward", 0, 0), ("forward", 1, 0), ("backward", 0, 0),
        ("forward", 2, 0), ("backward", 1, 0), ("forward", 3, 0), ("backward", 2, 0), ("backward", 3, 0)]  # fmt: skip


# ---- validation -------------------------------------------------------------------------------------------------
def test_rolls_selective_recompute_modules_recompute_and_train_exactly_as_without(tiny_model_dir):
    """recompute_modules (ROLL's comma-separated form, given through additional_configs as mcore_adapter allows): every
    layer recomputes its attention core and MLP in the backward, and the update is the one without."""
    selective = {"recompute_granularity": "selective",
                 "additional_configs": {"recompute_modules": "core_attn, mlp"}}  # fmt: skip
    plain, recomputing = megatron_pp1(tiny_model_dir), megatron_pp1(tiny_model_dir, strategy_config=selective)
    layers = list(recomputing.model.module.decoder.layers)
    assert len(layers) == 4 and all(layer.recompute_mlp and not layer.recompute_input_layernorm for layer in layers)
    assert all(layer.self_attention.checkpoint_core_attention for layer in layers)
    assert not any(layer.recompute_mlp for layer in plain.model.module.decoder.layers)
    batch = rollout_batch(batch_size=8, seed=4)
    batch.batch["old_log_probs"] = plain.compute_log_probs(batch).batch["log_probs"]
    assert recomputing.train_step(batch, ActorObjective()) == plain.train_step(batch, ActorObjective())
    for (name, a), (_, b) in zip(plain.named_weights(), recomputing.named_weights(), strict=True):
        assert torch.equal(a, b), name


def test_pipeline_size_must_divide_the_layers(tiny_model_dir):
    from rl_engines.strategies.megatron_config import parse_megatron_options
    from rl_engines.strategies.megatron_model import _check_divisors, read_spec

    options = parse_megatron_options({"pipeline_model_parallel_size": 3}, "actor_train", train=True, dtype="fp32")
    spec = read_spec(str(tiny_model_dir), "actor_train")
    match = r"strategy_config\.pipeline_model_parallel_size=3 does not divide the model's num_hidden_layers=4"
    with pytest.raises(ValueError, match=match):
        _check_divisors(spec, options, "actor_train", str(tiny_model_dir))


def test_tp_times_pp_must_divide_the_world_size():
    from rl_engines.strategies.megatron_config import check_world_size, parse_megatron_options

    options = parse_megatron_options(TP2_PP2, "actor_train", train=True, dtype="fp32")
    assert check_world_size(options, 8, "actor_train") == 2  # data-parallel size
    match = (r"tensor_model_parallel_size=2 x actor_train\.strategy_args\.strategy_config\.pipeline_model_parallel_size"
             r"=2 = 4 does not divide the role's world size 2")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        check_world_size(options, 2, "actor_train")


def test_virtual_pipeline_chunks_must_divide_the_layers(tiny_model_dir):
    from rl_engines.strategies.megatron_config import parse_megatron_options
    from rl_engines.strategies.megatron_model import _check_divisors, read_spec

    options = parse_megatron_options({**VPP2, "virtual_pipeline_model_parallel_size": 4}, "actor_train", train=True,
                                     dtype="fp32")  # fmt: skip
    assert options.virtual_pipeline_model_parallel_size == 4
    spec = read_spec(str(tiny_model_dir), "actor_train")
    match = (r"pipeline_model_parallel_size=2 x actor_train\.strategy_args\.strategy_config\."
             r"virtual_pipeline_model_parallel_size=4 does not divide the model's num_hidden_layers=4")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        _check_divisors(spec, options, "actor_train", str(tiny_model_dir))
    _check_divisors(spec, parse_megatron_options(VPP2, "actor_train", train=True, dtype="fp32"), "actor_train",
                    str(tiny_model_dir))  # fmt: skip


def test_rolls_embedding_and_loss_counted_in_the_pipeline_split_fail_naming_the_keys(tiny_model_dir):
    from rl_engines.strategies.megatron_config import parse_megatron_options
    from rl_engines.strategies.megatron_model import _check_divisors, read_spec

    options = parse_megatron_options({**PP2, "account_for_embedding_in_pipeline_split": True}, "actor_train",
                                     train=True, dtype="fp32")  # fmt: skip
    match = (r"pipeline_model_parallel_size=2 does not divide the model's num_hidden_layers=4 \+ 1 "
             r"\(actor_train\.strategy_args\.strategy_config\.account_for_embedding_in_pipeline_split\)")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        _check_divisors(read_spec(str(tiny_model_dir), "actor_train"), options, "actor_train", str(tiny_model_dir))


def two_rank_actor(model_dir, strategy_config):
    """An actor_train role config of megatron_train with ``strategy_config`` on two ranks."""
    section = megatron("megatron_train", strategy_config)
    return {"actor_train": worker_config(model_dir, "actor_train", training_args=TRAIN_ARGS, device_mapping=[0, 1],
                                         infer_batch_size=4, **section)}  # fmt: skip


def check_split_scores_and_trains_as_fsdp2(model_dir, strategy_config, local_layers, out, checkpoint=None):
    """On two ranks with ``strategy_config`` each rank holds ``local_layers``, scores as the HF model, and one update
    (and its save_hf export) equals fsdp2_train's; ``checkpoint``: where to save one after the update."""
    batch = rollout_batch(batch_size=8, seed=6)
    mask = batch.batch["response_mask"]
    with Roles(ClusterSpec(num_nodes=1, num_gpus_per_node=2), two_rank_actor(model_dir, strategy_config),
               rpc_timeout=180) as roles:  # fmt: skip
        actor = roles["actor_train"]
        assert on_ranks(actor, lambda w: w.strategy.model.layout.local_layers) == local_layers
        scored = with_old_log_probs(actor, batch).batch["old_log_probs"]
        torch.testing.assert_close(scored[mask].double(), reference_log_probs(model_dir, batch)[mask], atol=2e-6,
                                   rtol=0)  # fmt: skip
        metrics = actor.call("train_step", batch, ActorObjective(), dispatch="dp_split")[0]
        actor.call("save_hf", str(out / "hf"))
        if checkpoint is not None:
            actor.call("save_checkpoint", str(checkpoint))
    single = fsdp2(model_dir)
    expected = single.train_step(batch, ActorObjective())
    assert metrics["actor/pg_loss"] == pytest.approx(expected["pg_loss"], abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    saved = hf_state(out / "hf")
    for name, value in single.named_weights():
        torch.testing.assert_close(saved[name], value, atol=2e-6, rtol=0, msg=name)


def test_the_embedding_counted_as_a_layer_gives_the_first_stage_one_fewer_and_trains_as_pp1(ray_session, tmp_path):
    """ROLL's Qwen3-235B files count the embedding (and the loss) as a layer in the pipeline split
    (account_for_*_in_pipeline_split): a 5-layer model over 2 stages with the embedding counted holds layers 0-1 on
    the first stage and 2-4 on the second; it scores as the HF model and one update equals fsdp2_train's."""
    from transformers import AutoTokenizer

    build_tiny_tokenizer(tmp_path, CORPUS, vocab_size=256)
    build_tiny_causal_lm(tmp_path, vocab_size=len(AutoTokenizer.from_pretrained(str(tmp_path))), num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, seed=5)  # fmt: skip
    split = {**PP2, "account_for_embedding_in_pipeline_split": True}
    check_split_scores_and_trains_as_fsdp2(tmp_path, split, [(0, 1), (2, 3, 4)], tmp_path)


def test_a_custom_pipeline_layout_places_the_layers_and_trains_as_fsdp2(ray_session, tiny_model_dir, tmp_path):
    """ROLL's Qwen3.5-397B file gives Megatron's pipeline_model_parallel_layout ("E|(tt|)*30,L"). Here "E|tt|t|tL"
    on 2 ranks: 4 virtual stages, so 2 model chunks per rank (the virtual pipeline size derived, as ROLL's
    mcore_adapter does); rank 0 holds the embedding alone, then layer 2; rank 1 layers 0-1, then layer 3 and the
    output layer. It scores as the HF model, one update equals fsdp2_train's, and a checkpoint resumes only under
    the same split."""
    layout = {**PP2, "pipeline_model_parallel_layout": "E|tt|t|tL"}
    check_split_scores_and_trains_as_fsdp2(tiny_model_dir, layout, [(2,), (0, 1, 3)], tmp_path, tmp_path / "ckpt")
    other = {**PP2, "pipeline_model_parallel_layout": "E|t|tt|tL"}  # the same sizes, another split
    split = r"at \(0, 0, 2, 3, 4\), this run splits them at \(0, 0, 1, 3, 4\)"
    with Roles(ClusterSpec(num_nodes=1, num_gpus_per_node=2), two_rank_actor(tiny_model_dir, other),
               rpc_timeout=180) as roles, pytest.raises(Exception, match=split):  # fmt: skip
        roles["actor_train"].call("load_checkpoint", str(tmp_path / "ckpt"))


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"pipeline_model_parallel_layout": "Et|tx|L"}, r"holds \['x'\]"),
        ({"pipeline_model_parallel_layout": "Et|t t|t|tL"}, r"holds \[' '\]"),  # megatron-core refuses spaces
        ({"pipeline_model_parallel_layout": "tE|tt|tt|tL"}, r"'E' must come once, first"),
        ({"pipeline_model_parallel_layout": "Et|t|tL"}, r"has 3 stages, which .*pipeline_model_parallel_size=2 does"),
        (
            {"pipeline_model_parallel_layout": "Et|t|t|tL", "virtual_pipeline_model_parallel_size": 1},
            r"virtual_pipeline_model_parallel_size=1 contradicts",
        ),
        (
            {"pipeline_model_parallel_layout": "Et|ttL", "account_for_embedding_in_pipeline_split": True},
            r"places every layer itself; remove",
        ),
        ({"distrib_optim_fully_reshardable": True}, r"distrib_optim_fully_reshardable=true: a checkpoint here"),
    ],
)
def test_bad_pipeline_layouts_fail_naming_the_key(config, match):
    from rl_engines.strategies.megatron_config import parse_megatron_options

    with pytest.raises(ValueError, match=match):
        parse_megatron_options({**PP2, **config}, "actor_train", train=True, dtype="fp32")


def test_a_layout_must_place_every_decoder_layer(tiny_model_dir):
    from rl_engines.strategies.megatron_config import parse_megatron_options
    from rl_engines.strategies.megatron_model import _check_divisors, read_spec

    options = parse_megatron_options({**PP2, "pipeline_model_parallel_layout": "Et|t*2L", "bf16": False,
                                      "distrib_optim_fully_reshardable": False}, "actor_train", train=True,
                                     dtype="fp32")  # fmt: skip
    assert options.virtual_pipeline_model_parallel_size == 1
    with pytest.raises(ValueError, match=r"places 3 decoder layers \('t'\); the model has num_hidden_layers=4"):
        _check_divisors(read_spec(str(tiny_model_dir), "actor_train"), options, "actor_train", str(tiny_model_dir))

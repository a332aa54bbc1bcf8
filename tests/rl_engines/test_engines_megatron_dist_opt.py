"""megatron_train with ``use_distributed_optimizer: true`` at DP = 2 (TP = 1) on two Ray ranks, and ROLL's Megatron
``strategy_config`` blocks (CPU, gloo, real megatron-core).

Expected values are independent: a replicated-AdamW twin of the same strategy in the same worker processes (same
batches, same process groups), fsdp2_train on one rank in this process, and an uninterrupted run for resume. The
workers apply the test-harness shims (megatron_shims) through the session's start-up hook; the test reads
strategy internals on a worker through Ray's ``__ray_call__``.
"""

from __future__ import annotations

import copy

import pytest
import ray
import torch
import yaml
from engine_fixtures import CORPUS, require_engine, rollout_batch, tiny_model_dir, worker_config

from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_engines.strategies import create_strategy
from rl_engines.strategies.megatron_ops import ChainedOptimizer, local_optimizer, optimizer_state_numel
from rl_engines.tiny_model import build_tiny_moe_lm, build_tiny_tokenizer
from tests.shared_dir import ROLL_EXAMPLES, require_shared

pytest.importorskip("megatron.core")

__all__ = ["tiny_model_dir"]
CLUSTER = ClusterSpec(num_nodes=1, num_gpus_per_node=2)
# A ROLL-style block: the distributed optimizer plus performance-only switches (accepted, not used on CPU).
DIST_OPT = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "apply_rope_fusion": True,
            "bias_activation_fusion": True, "bf16": False}  # fmt: skip
# One optimizer step per 2 samples per DP rank (4 per global mini-batch); adam_epsilon 1e-4 as in
# test_engines_megatron (no rounding noise of near-zero gradients amplified into visible steps).
TRAIN_ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
              "adam_epsilon": 1e-4, "lr_scheduler_type": "linear", "max_steps": 10}  # fmt: skip
ONE_RANK_ARGS = {**TRAIN_ARGS, "per_device_train_batch_size": 2}  # the same global mini-batch of 4 on one rank
DP_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]  # one rank's view of 2 DP ranks' mini-batches (rank r holds rows 4r..4r+3)


def train_config(model_dir, strategy_config):
    strategy_args = {"strategy_name": "megatron_train", "strategy_config": strategy_config}
    return worker_config(model_dir, "actor_train", device_mapping=[0, 1], training_args=TRAIN_ARGS,
                         infer_batch_size=4, strategy_args=strategy_args)  # fmt: skip


@pytest.fixture(scope="module")
def workers(ray_session, tiny_model_dir, tmp_path_factory):
    """actor_train on two ranks with the partitioned optimizer; each worker also holds ``twin``, the same strategy
    with use_distributed_optimizer false."""
    with Roles(CLUSTER, {"actor_train": train_config(tiny_model_dir, DIST_OPT)}, rpc_timeout=120) as roles:
        group = roles["actor_train"]
        twin = train_config(tiny_model_dir, {**DIST_OPT, "use_distributed_optimizer": False})
        on_ranks(group, start_twin, twin)
        yield group


# ---- run on a worker (worker = the RoleWorker instance) ---------------------------------------------------------
def on_ranks(group, fn, *args, per_rank=None):
    """``fn(worker, *args[, per_rank[r]])`` on every rank at once (the strategies run collectives)."""
    extra = per_rank or [()] * len(group.actors)
    return ray.get([a.__ray_call__.remote(fn, *args, *e) for a, e in zip(group.actors, extra, strict=True)])


def start_twin(worker, config):
    worker.twin = create_strategy(config, "actor_train")
    worker.twin.initialize()


def strategy_of(worker, which):
    return worker.strategy if which == "dist" else getattr(worker, which)


def start_strategy(worker, which, config):
    setattr(worker, which, create_strategy(config, "actor_train"))
    getattr(worker, which).initialize()


def train(worker, which, objective, batch):
    return strategy_of(worker, which).train_step(batch, objective)


def weights(worker, which):
    return {name: value.clone() for name, value in strategy_of(worker, which).named_weights()}


def optimizer_state(worker, which):
    """(elements of optimizer state on this rank, names of the parameters it holds state for)."""
    strategy = strategy_of(worker, which)
    names = {id(master): name for name, master in strategy.masters.items()}
    held = sorted(names[id(param)] for param in local_optimizer(strategy.optimizer).state)
    return optimizer_state_numel(strategy.optimizer), held


def checkpoint(worker, which, method, path):
    getattr(strategy_of(worker, which), method)(path)


# ---- tests --------------------------------------------------------------------------------------------------------
def with_old_log_probs(group, batch):
    batch.batch["old_log_probs"] = group.call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    return batch


def test_partitioned_adamw_gives_the_replicated_update_with_half_the_state(workers, tiny_model_dir):
    batch = with_old_log_probs(workers, rollout_batch(batch_size=8, seed=2))
    objective = ActorObjective()
    metrics = workers.call("train_step", batch, objective, dispatch="dp_split")  # 2 optimizer steps
    twin_metrics = on_ranks(workers, train, "twin", objective, per_rank=[(c,) for c in batch.chunk(2)])
    assert {k.removeprefix("actor/"): v for k, v in metrics[0].items()} == twin_metrics[0]

    dist, twin = on_ranks(workers, weights, "dist"), on_ranks(workers, weights, "twin")
    for name, value in twin[0].items():  # bit-identical: the same elementwise AdamW, on the owner rank only
        assert torch.equal(dist[0][name], value), name
        assert torch.equal(dist[1][name], value), name  # the owners' broadcasts reached the other rank

    (numel_0, held_0), (numel_1, held_1) = on_ranks(workers, optimizer_state, "dist")
    full, held_all = on_ranks(workers, optimizer_state, "twin")[0]
    assert set(held_0).isdisjoint(held_1) and sorted(held_0 + held_1) == held_all
    assert numel_0 + numel_1 == full  # every parameter's state on exactly one rank
    assert max(numel_0, numel_1) < 0.6 * full, (numel_0, numel_1, full)  # measured 98,952 + 98,824 of 197,776

    single = create_strategy(worker_config(tiny_model_dir, training_args=ONE_RANK_ARGS, infer_batch_size=4),
                             "actor_train")  # fmt: skip
    single.initialize()
    single_metrics = single.train_step(batch.reorder(DP_ORDER), objective)
    assert metrics[0]["actor/grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
    for name, value in single.named_weights():  # measured max |diff| 5e-7 after two lr=1e-2 AdamW steps
        torch.testing.assert_close(dist[0][name], value, atol=2e-6, rtol=0, msg=name)


def test_partitioned_checkpoint_resumes_bit_identically_and_at_dp1(workers, tiny_model_dir, tmp_path):
    objective = ActorObjective()
    batch = with_old_log_probs(workers, rollout_batch(batch_size=8, seed=3))
    workers.call("save_checkpoint", str(tmp_path / "ckpt"))
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt"))
    assert [f for f in files if f.startswith(("mp_", "optim_"))] == [
        "mp_rank_00.pt", "optim_mp_rank_00_dp_rank_000.pt", "optim_mp_rank_00_dp_rank_001.pt"]  # fmt: skip
    uninterrupted = workers.call("train_step", batch, objective, dispatch="dp_split")
    expected = on_ranks(workers, weights, "dist")[0]

    workers.call("load_checkpoint", str(tmp_path / "ckpt"))
    resumed = workers.call("train_step", batch, objective, dispatch="dp_split")
    assert resumed == uninterrupted
    got = on_ranks(workers, weights, "dist")[0]
    assert all(torch.equal(got[name], value) for name, value in expected.items())

    # the replicated twin reads the partitioned files: the same state, so the same next update
    on_ranks(workers, checkpoint, "twin", "load_checkpoint", str(tmp_path / "ckpt"))
    on_ranks(workers, train, "twin", objective, per_rank=[(c,) for c in batch.chunk(2)])
    twin = on_ranks(workers, weights, "twin")[0]
    assert all(torch.equal(twin[name], value) for name, value in expected.items())

    # one rank, in this process, picks both partitions (a resume at another data-parallel size)
    require_engine("megatron_train")
    config = worker_config(tiny_model_dir, training_args=ONE_RANK_ARGS, infer_batch_size=4,
                           strategy_args={"strategy_name": "megatron_train", "strategy_config": DIST_OPT})  # fmt: skip
    single = create_strategy(config, "actor_train")
    single.initialize()
    assert local_optimizer(single.optimizer) is single.optimizer  # DP = 1: nothing to partition
    single.load_checkpoint(str(tmp_path / "ckpt"))
    assert optimizer_state_numel(single.optimizer) == sum(n for n, _ in on_ranks(workers, optimizer_state, "dist"))
    single.train_step(batch.reorder(DP_ORDER), objective)
    for name, value in single.named_weights():  # the DP sums in another order only: measured 6e-8
        torch.testing.assert_close(value, expected[name], atol=2e-6, rtol=0, msg=name)


def test_a_moe_models_expert_state_partitions_over_the_ranks_holding_those_experts(workers, tmp_path):
    """A Qwen3-MoE at expert_model_parallel_size 1 in the same two workers: the dense state partitions over the
    data-parallel ranks and the experts' over the ranks holding the same experts (here both), in two chained AdamW
    parts as Megatron's; the update is the replicated twin's bit for bit and a checkpoint resumes bit-identically."""
    from transformers import AutoTokenizer

    model = tmp_path / "moe"
    build_tiny_tokenizer(model, CORPUS, vocab_size=256)
    build_tiny_moe_lm(model, vocab_size=len(AutoTokenizer.from_pretrained(str(model))))
    on_ranks(workers, start_strategy, "moe_dist", train_config(model, DIST_OPT))
    on_ranks(workers, start_strategy, "moe_twin", train_config(model, {**DIST_OPT, "use_distributed_optimizer": False}))
    objective, batch = ActorObjective(), rollout_batch(batch_size=8, seed=5)
    chunks = [(c,) for c in batch.chunk(2)]
    batch.batch["old_log_probs"] = torch.cat(on_ranks(workers, score, "moe_twin", per_rank=chunks))
    chunks = [(c,) for c in batch.chunk(2)]
    assert on_ranks(workers, train, "moe_dist", objective, per_rank=chunks) == on_ranks(
        workers, train, "moe_twin", objective, per_rank=chunks)  # fmt: skip
    dist, twin = on_ranks(workers, weights, "moe_dist")[0], on_ranks(workers, weights, "moe_twin")[0]
    assert all(torch.equal(dist[name], value) for name, value in twin.items())

    (_, held_0), (_, held_1) = on_ranks(workers, optimizer_state, "moe_dist")
    _, held_all = on_ranks(workers, optimizer_state, "moe_twin")[0]
    experts = [name for name in held_all if ".mlp.experts." in name]
    assert set(held_0).isdisjoint(held_1) and sorted(held_0 + held_1) == held_all
    assert any(name in experts for name in held_0) and any(name in experts for name in held_1)
    assert on_ranks(workers, lambda w: isinstance(w.moe_dist.optimizer, ChainedOptimizer)) == [True, True]

    on_ranks(workers, checkpoint, "moe_dist", "save_checkpoint", str(tmp_path / "ckpt"))
    uninterrupted = on_ranks(workers, train, "moe_dist", objective, per_rank=chunks)
    expected = on_ranks(workers, weights, "moe_dist")[0]
    on_ranks(workers, checkpoint, "moe_dist", "load_checkpoint", str(tmp_path / "ckpt"))
    assert on_ranks(workers, train, "moe_dist", objective, per_rank=chunks) == uninterrupted
    got = on_ranks(workers, weights, "moe_dist")[0]
    assert all(torch.equal(got[name], value) for name, value in expected.items())


def score(worker, which, batch):
    return strategy_of(worker, which).compute_log_probs(batch).batch["log_probs"]


# ---- ROLL's strategy_config blocks -------------------------------------------------------------------------------
def roll_megatron_sections():
    """(file, role, section) of every megatron_train / megatron_infer section of the ROLL example files; without
    ../shared one placeholder, which the test fails (CI) or skips through require_shared."""
    if not ROLL_EXAMPLES.is_dir():
        return [pytest.param(ROLL_EXAMPLES, "actor_train", {}, id="no-shared-dir")]
    found = []
    for path in sorted(ROLL_EXAMPLES.rglob("*.yaml")):
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for role in ("actor_train", "actor_infer", "reference", "critic"):
            section = raw.get(role) or {}
            if str((section.get("strategy_args") or {}).get("strategy_name", "")).startswith("megatron_"):
                found.append(pytest.param(path, role, section, id=f"{path.parent.name}/{path.name}:{role}"))
    return found


@pytest.mark.parametrize(("path", "role", "section"), roll_megatron_sections())
def test_roll_example_megatron_strategy_configs_parse(path, role, section, tmp_path):
    require_shared(path)
    model_args = {k: v for k, v in (section.get("model_args") or {}).items() if k in ("dtype", "model_type")}
    model_args = {k: v for k, v in model_args.items() if v is not None}  # ROLL writes model_type: ~
    config = worker_config(tmp_path, role, model_args=model_args, strategy_args=section["strategy_args"])
    strategy = create_strategy(config, role)  # parses strategy_config; the engine loads only in initialize()
    strategy_config = section["strategy_args"]["strategy_config"]
    if role in ("actor_train", "critic"):
        assert strategy.options.use_distributed_optimizer == strategy_config.get("use_distributed_optimizer", False)


def test_roll_examples_use_the_distributed_optimizer_and_fusion_switches():
    require_shared(ROLL_EXAMPLES)
    keys = {key for param in roll_megatron_sections() for key in param.values[2]["strategy_args"]["strategy_config"]}
    assert {"use_distributed_optimizer", "apply_rope_fusion", "bias_activation_fusion", "bf16"} <= keys


@pytest.mark.parametrize(
    ("config", "dtype", "match"),
    [
        ({"bf16": True}, "fp16", r"strategy_config\.bf16=true contradicts actor_train\.model_args\.dtype='fp16'"),
        ({"fp16": False}, "fp16", r"strategy_config\.fp16=false contradicts .*remove actor_train\.strategy_args"),
        ({"apply_rope_fusion": "yes"}, "fp32", r"strategy_config\.apply_rope_fusion must be bool"),
        ({"overlap_param_gather": True}, "fp32", r"overlap_param_gather=true applies to the distributed optimizer"),
        ({"apply_query_key_layer_scaling": True}, "fp32", r"\['actor_train\.strategy_args\.strategy_config\.apply_q"),
    ],
)
def test_precision_and_performance_keys_are_validated_by_name(config, dtype, match, tmp_path):
    strategy_args = {"strategy_name": "megatron_train", "strategy_config": config}
    with pytest.raises(ValueError, match=match):
        create_strategy(worker_config(tmp_path, model_args={"dtype": dtype}, strategy_args=strategy_args),
                        "actor_train")  # fmt: skip


def test_performance_switches_are_accepted_and_reported_as_unused(tmp_path):
    from rl_engines.strategies.megatron_config import describe_unused_switches

    config = {**DIST_OPT, "masked_softmax_fusion": True, "gradient_accumulation_fusion": True, "bf16": True,
              "persist_layer_norm": False}  # fmt: skip
    strategy = create_strategy(
        worker_config(tmp_path, model_args={"dtype": "bf16"},
                      strategy_args={"strategy_name": "megatron_train", "strategy_config": copy.deepcopy(config)}),
        "actor_train",
    )  # fmt: skip
    assert set(strategy.options.unused_switches) == {"overlap_grad_reduce", "apply_rope_fusion",
                                                     "bias_activation_fusion", "masked_softmax_fusion",
                                                     "gradient_accumulation_fusion"}  # fmt: skip
    line = describe_unused_switches(strategy.options, "actor_train")
    assert "apply_rope_fusion: Transformer Engine's fused RoPE kernel" in line and "persist_layer_norm" not in line


def test_sequence_parallel_is_honoured_with_torch_norms():
    """ROLL's rlvr_config_async.yaml sets sequence_parallel: true. megatron-core's torch layer norm refuses it; the
    local spec here builds torch RMSNorms tagged for the TP gradient sum, so the option runs on every machine
    (test_engines_megatron trains with it against fsdp2); at TP = 1 there is nothing to split."""
    from rl_engines.strategies.megatron_config import parse_megatron_options

    options = parse_megatron_options({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "actor_train",
                                     train=True, dtype="fp32")  # fmt: skip
    assert options.sequence_parallel and options.unused_switches == ()
    single = parse_megatron_options({"sequence_parallel": True}, "actor_train", train=True, dtype="fp32")
    assert not single.sequence_parallel


def test_training_keys_rolls_files_repeat_on_a_log_prob_role_are_accepted_and_reported_as_unused():
    """ROLL's Qwen3-Next files give the megatron_infer reference the train role's use_distributed_optimizer and
    moe_shared_expert_overlap: nothing to act on there (no optimizer; a CUDA-stream overlap), so logged as unused."""
    from rl_engines.strategies.megatron_config import describe_unused_switches, parse_megatron_options

    options = parse_megatron_options({"use_distributed_optimizer": True, "moe_shared_expert_overlap": True},
                                     "reference", train=False, dtype="fp32")  # fmt: skip
    assert not options.use_distributed_optimizer
    line = describe_unused_switches(options, "reference")
    assert "use_distributed_optimizer: a log-prob role has no optimizer" in line
    assert "moe_shared_expert_overlap: overlapping the shared expert" in line

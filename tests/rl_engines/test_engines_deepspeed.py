"""``deepspeed_train`` against ``fsdp2_train``: every ZeRO stage (and CPU offload) gives the same update.

Tolerance: weights within 1e-6 after two AdamW steps (lr 1e-2) with clipping active. DeepSpeed computes the same
gradients up to one rounding (its ZeRO optimizers sum the squares of the norm in another order and clip with
``1 / ((norm + 1e-6) / max)`` rather than ``max / (norm + 1e-6)``; stage 3 reduces through flat partitions). AdamW
divides each coordinate by its own magnitude, which turns rounding noise of a near-zero gradient into a visible
step (about 1e-5 here with ``adam_epsilon=1e-8``), so the comparisons use ``adam_epsilon=1e-3``: then every stage
lands within 1.2e-7, one float32 rounding of a weight near 1, of fsdp2's weights (measured on CPU, stages 0-3 and
both offload presets), and 1e-6 leaves room for other CPUs' kernels. Adam and clipping do not see a uniform
gradient scale, so ``grad_norm`` (DeepSpeed's, from the reduced gradients; rel 1e-5, summation order) is what
checks that two ranks *sum* their gradients.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from engine_fixtures import rollout_batch, tiny_model_dir, worker_config

from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_engines.strategies import create_strategy
from rl_engines.strategies.deepspeed_config import finalize_deepspeed_config, resolve_strategy_config

__all__ = ["tiny_model_dir"]

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
PREFIX = "actor_train.strategy_args.strategy_config"
TRAIN_ARGS = {"learning_rate": 1e-2, "adam_epsilon": 1e-3, "max_grad_norm": 1.0,
              "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}  # fmt: skip
ATOL = 1e-6


def make(model_dir, strategy_name="deepspeed_train", strategy_config=None, model_args=None, **training_args):
    strategy_args = {"strategy_name": strategy_name, "strategy_config": strategy_config or {}}
    config = worker_config(model_dir, training_args={**TRAIN_ARGS, **training_args}, infer_batch_size=4,
                           model_args=model_args or {}, strategy_args=strategy_args)  # fmt: skip
    strategy = create_strategy(config, "actor_train")
    strategy.initialize()
    return strategy


@pytest.fixture(scope="module")
def scorer(tiny_model_dir):
    """fsdp2_train at the initial weights: scores ``old_log_probs`` for every training batch."""
    return make(tiny_model_dir, "fsdp2_train")


def training_batch(scorer, batch_size=4, seed=3):
    batch = rollout_batch(batch_size=batch_size, seed=seed)
    batch.batch["old_log_probs"] = scorer.compute_log_probs(batch).batch["log_probs"]
    return batch


@pytest.fixture(scope="module")
def fsdp2_result(tiny_model_dir, scorer):
    """Two optimizer steps of fsdp2_train on a 4-sample batch (micro-batch 1 x accumulation 2)."""
    batch = training_batch(scorer)
    strategy = make(tiny_model_dir, "fsdp2_train")
    metrics = strategy.train_step(batch, ActorObjective())
    return batch, metrics, {name: value.clone() for name, value in strategy.named_weights()}


@needs_deepspeed
@pytest.mark.parametrize(
    "strategy_config",
    [{"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
     {"preset": "deepspeed_zero2_cpuoffload"}],
    ids=["zero0", "zero1", "zero2", "zero3", "zero2_cpuoffload"],
)  # fmt: skip
def test_every_zero_stage_updates_like_fsdp2(tiny_model_dir, fsdp2_result, strategy_config):
    batch, expected_metrics, expected = fsdp2_result
    strategy = make(tiny_model_dir, strategy_config=strategy_config)
    metrics = strategy.train_step(batch, ActorObjective())
    assert metrics["skipped_steps"] == 0 and expected_metrics["grad_norm"] > TRAIN_ARGS["max_grad_norm"]  # clipped
    for key in ("pg_loss", "total_loss", "pg_clipfrac", "lr"):
        assert metrics[key] == pytest.approx(expected_metrics[key], abs=1e-6), key
    assert metrics["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=1e-5)
    weights = dict(strategy.named_weights())
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, atol=ATOL, rtol=0, msg=name)


@needs_deepspeed
def test_freeze_module_prefix_keeps_those_weights_and_trains_the_rest_like_fsdp2(tiny_model_dir, scorer):
    """ROLL's freeze_module_prefix (comma-separated) under ZeRO-3: the named layer and norm keep their loaded
    values, the rest trains as fsdp2_train does with the same prefixes."""
    from transformers import AutoModelForCausalLM

    batch, freeze = training_batch(scorer), {"freeze_module_prefix": "model.layers.0., model.norm"}
    initial = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    trained = []
    for name, options in (("fsdp2_train", None), ("deepspeed_train", {"zero_stage": 3})):
        strategy = make(tiny_model_dir, name, options, model_args=freeze)
        assert strategy.frozen and all(n.startswith(("model.layers.0.", "model.norm")) for n in strategy.frozen)
        strategy.train_step(batch, ActorObjective())
        trained.append(dict(strategy.named_weights()))
    for name, value in initial.items():
        frozen = name.startswith(("model.layers.0.", "model.norm"))
        assert torch.equal(trained[1][name], value) == frozen, name
        torch.testing.assert_close(trained[1][name], trained[0][name], atol=ATOL, rtol=0, msg=name)


@needs_deepspeed
def test_zero3_named_weights_are_full_gathered_tensors(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    strategy = make(tiny_model_dir, strategy_config={"zero_stage": 3})
    embed = strategy.engine.module.get_parameter("model.embed_tokens.weight")
    assert embed.numel() == 0 and embed.ds_numel > 0  # partitioned outside a gather
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    weights = dict(strategy.named_weights())
    assert weights.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(weights[name], value), name
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]  # tied: gathered once


@needs_deepspeed
@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoint_resume_equals_uninterrupted_training(tiny_model_dir, scorer, tmp_path, stage):
    config = {"zero_stage": stage}
    batches = [training_batch(scorer, batch_size=2, seed=seed) for seed in (10, 11)]
    schedule = {"lr_scheduler_type": "linear", "max_steps": 6, "warmup_steps": 1}
    first = make(tiny_model_dir, strategy_config=config, **schedule)
    first.train_step(batches[0], ActorObjective())
    first.save_checkpoint(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["zero_stage"] == stage
    expected = first.train_step(batches[1], ActorObjective())

    resumed = make(tiny_model_dir, strategy_config=config, **schedule)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.global_step == 1
    assert resumed.train_step(batches[1], ActorObjective()) == expected
    for (name, a), (_, b) in zip(first.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    return ClusterSpec(num_nodes=1, num_gpus_per_node=2)


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ray_ranks_match_one_rank_fsdp2_and_resume(tiny_model_dir, scorer, ray_cluster, tmp_path, stage):
    from safetensors.torch import load_file

    batches = [training_batch(scorer, batch_size=8, seed=seed) for seed in (4, 5)]
    config = worker_config(tiny_model_dir, device_mapping=[0, 1], infer_batch_size=4,
                           training_args={**TRAIN_ARGS, "per_device_train_batch_size": 2},
                           strategy_args={"strategy_name": "deepspeed_train",
                                          "strategy_config": {"zero_stage": stage}})  # fmt: skip
    infer = worker_config(
        tiny_model_dir,
        "actor_infer",
        device_mapping=[0, 1],
        infer_batch_size=4,
        strategy_args={"strategy_name": "hf_infer"},
    )  # in actor_train's processes
    with Roles(ray_cluster, {"actor_train": config, "actor_infer": infer}, rpc_timeout=300) as roles:
        train = roles["actor_train"]
        metrics = train.call("train_step", batches[0], ActorObjective(), dispatch="dp_split")
        roles.model_updater().sync()  # the gathered weights (ZeRO-3: partitioned on the ranks) into hf_infer
        synced = roles["actor_infer"].call("compute_log_probs", batches[1], dispatch="dp_split")
        trained = train.call("compute_log_probs", batches[1], dispatch="dp_split")
        mask = batches[1].batch["response_mask"].bool()
        torch.testing.assert_close(synced.batch["log_probs"][mask], trained.batch["log_probs"][mask], atol=1e-6, rtol=0)
        train.call("save_checkpoint", str(tmp_path / "ckpt"))
        train.call("save_hf", str(tmp_path / "step1"))
        train.call("train_step", batches[1], ActorObjective(), dispatch="dp_split")
        train.call("save_hf", str(tmp_path / "step2"))
        train.call("load_checkpoint", str(tmp_path / "ckpt"))
        train.call("train_step", batches[1], ActorObjective(), dispatch="dp_split")
        train.call("save_hf", str(tmp_path / "step2_resumed"))

    # the same mini-batch of 8 on one rank: micro-batch 4 x accumulation 2
    single = make(tiny_model_dir, "fsdp2_train", per_device_train_batch_size=4)
    expected = single.train_step(batches[0], ActorObjective())
    assert metrics[0] == metrics[1]  # reduced over ranks
    assert metrics[0]["actor/pg_loss"] == pytest.approx(expected["pg_loss"], abs=1e-6)
    assert metrics[0]["actor/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    gathered = load_file(str(tmp_path / "step1" / "model.safetensors"))
    for name, value in single.named_weights():
        if name in gathered:  # the tied lm_head is stored once
            torch.testing.assert_close(gathered[name], value, atol=ATOL, rtol=0, msg=name)
    uninterrupted = load_file(str(tmp_path / "step2" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "step2_resumed" / "model.safetensors"))
    assert all(torch.equal(resumed[name], value) for name, value in uninterrupted.items())

    one_rank = make(tiny_model_dir, strategy_config={"zero_stage": stage})
    with pytest.raises(ValueError, match=f"written at world size 2 with ZeRO stage {stage}; this run has 1 / {stage}"):
        one_rank.load_checkpoint(str(tmp_path / "ckpt"))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"zero_stag": 2}, rf"\['{PREFIX}\.zero_stag'\]"),
        ({"offload_optimizer": "yes"}, rf"{PREFIX}\.offload_optimizer must be bool"),
        ({"zero_stage": 4}, rf"{PREFIX}\.zero_stage=4"),
        ({"zero_stage": True}, rf"{PREFIX}\.zero_stage must be int"),
        ({"preset": "deepspeed_zero4"}, rf"{PREFIX}\.preset='deepspeed_zero4'"),
        ({"optimizer": {"type": "AdamW"}}, rf"{PREFIX}\.optimizer is not accepted: .*training_args"),
        ({"gradient_predivide_factor": 2.0}, rf"{PREFIX}\.gradient_predivide_factor is not accepted"),
        ({"zero_stage": 2, "zero_optimization": {"stage": 3}}, rf"{PREFIX}\.zero_stage=2 contradicts"),
        ({"zero_stage": 2, "offload_param": True}, rf"{PREFIX}\.offload_param needs ZeRO stage 3"),
        ({"zero_optimization": {"stage": "two"}}, rf"{PREFIX}\.zero_optimization must be a mapping whose stage"),
        ({"deepspeed_config": {"zero_optimisation": {}}}, rf"{PREFIX}\.deepspeed_config\.zero_optimisation is not"),
        ({"deepspeed_config": "/no/such/ds.json"}, rf"{PREFIX}\.deepspeed_config='/no/such/ds.json' is not a file"),
        ({"deepspeed_config": "zero2.yaml"}, rf"{PREFIX}\.deepspeed_config='zero2.yaml': give a DeepSpeed JSON"),
    ],
)
def test_bad_strategy_config_is_rejected_naming_the_key(tiny_model_dir, options, match):
    config = worker_config(tiny_model_dir, strategy_args={"strategy_name": "deepspeed_train",
                                                          "strategy_config": options})  # fmt: skip
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        create_strategy(config, "actor_train")


def test_zero_stage_0_refuses_low_precision_naming_both_keys(tiny_model_dir):
    config = worker_config(tiny_model_dir, model_args={"dtype": "bf16"},
                           strategy_args={"strategy_name": "deepspeed_train",
                                          "strategy_config": {"preset": "deepspeed_zero"}})  # fmt: skip
    with pytest.raises(ValueError, match=rf"{PREFIX} selects ZeRO stage 0, .* actor_train\.model_args\.dtype='bf16'"):
        create_strategy(config, "actor_train")


def test_roll_deepspeed_config_resolves_with_auto_batch_keys(tmp_path):
    roll_zero3 = {  # ROLL's deepspeed_zero3 as YAML reads it (1e9 without a dot is a string)
        "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "sub_group_size": "1e9",
                              "reduce_bucket_size": "auto", "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": "1e5",
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }  # fmt: skip
    (tmp_path / "zero3.json").write_text(json.dumps(roll_zero3))
    config = worker_config(tmp_path, training_args={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                                                    "max_grad_norm": 0.5})  # fmt: skip
    for options in (roll_zero3, {"deepspeed_config": str(tmp_path / "zero3.json")}):
        merged = resolve_strategy_config(options, PREFIX)
        final = finalize_deepspeed_config(merged, config.training_args, dtype="bf16", world_size=2, prefix=PREFIX,
                                          pin_memory=False)  # fmt: skip
        assert final["train_batch_size"] == 2 * 4 * 2  # ROLL FAQ: per_device x accumulation x world size
        assert (final["train_micro_batch_size_per_gpu"], final["gradient_accumulation_steps"]) == (2, 4)
        assert final["gradient_clipping"] == 0.5 and final["bf16"]["enabled"] and not final["fp16"]["enabled"]
        assert final["zero_optimization"]["sub_group_size"] == 10**9 and final["steps_per_print"] == 10**5
        assert "reduce_bucket_size" not in final["zero_optimization"]  # auto: DeepSpeed's default

    with pytest.raises(ValueError, match=rf"{PREFIX}\.train_batch_size=8, but .* gives 16"):
        finalize_deepspeed_config({**merged, "train_batch_size": 8}, config.training_args, dtype="bf16",
                                  world_size=2, prefix=PREFIX, pin_memory=False)  # fmt: skip
    with pytest.raises(ValueError, match=rf"{PREFIX}\.bf16\.enabled=True contradicts model_args\.dtype='fp32'"):
        finalize_deepspeed_config({**merged, "bf16": {"enabled": True}}, config.training_args, dtype="fp32",
                                  world_size=2, prefix=PREFIX, pin_memory=False)  # fmt: skip


def test_presets_and_shorthand_build_roll_configs():
    zero3_offload = resolve_strategy_config({"preset": "deepspeed_zero3_cpuoffload"}, PREFIX)["zero_optimization"]
    assert zero3_offload == {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    shorthand = resolve_strategy_config({"zero_stage": 3, "offload_optimizer": True, "offload_param": True}, PREFIX)
    assert shorthand["zero_optimization"] == zero3_offload
    assert resolve_strategy_config({}, PREFIX)["zero_optimization"] == {"stage": 2}  # default: deepspeed_zero2
    no_offload = resolve_strategy_config({"preset": "deepspeed_zero2_cpuoffload", "offload_optimizer": False}, PREFIX)
    assert no_offload["zero_optimization"] == {"stage": 2}

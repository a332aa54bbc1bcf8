"""Vision-language models in the Megatron strategies (issue 23): the language model under Megatron TP (with
sequence parallelism and full activation recomputation), the vision tower replicated on the first stage. A tiny
Qwen3-VL (interleaved multimodal RoPE, DeepStack features added after the first layer, q / k norms) on prompts with
pictures of three sizes and one without: log-probs equal the HF model on each sample alone, an update equals
fsdp2_train's (vision tower and q / k norms included), and a weight sync into hf_infer carries it. Pipeline
parallelism with a VL model is the alignment matrix's Megatron VL column (tests/apps/test_apps_alignment_vl.py).
ROLL's ``freeze_module_prefix: vision_model`` freezes the tower."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import CORPUS, require_engine, worker_config
from test_engines_video import video_prompts
from vl_fixtures import alone, teacher_forced, vl_prompts

from rl_core.batch import RolloutBatch
from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_vl_model

pytest.importorskip("megatron.core")

# adam_epsilon 1e-3: Adam would turn the rounding of near-zero gradients (summed in another order by the TP
# all-reduces) into full-rate steps.
TRAINING = {"learning_rate": 1e-2, "adam_epsilon": 1e-3, "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """A tiny Qwen3-VL with 2 KV heads (Megatron splits whole KV groups over TP ranks)."""
    path = tmp_path_factory.mktemp("tiny_qwen3_vl")
    build_tiny_vl_model(path, CORPUS, model_type="qwen3_vl", num_key_value_heads=2)
    return path


@pytest.fixture(scope="module")
def roles(ray_session, qwen3_vl, tmp_path_factory):
    # full recomputation: each layer re-run in the backward pass must re-add its micro-batch's DeepStack features
    tp2 = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "recompute_granularity": "full",
           "recompute_method": "uniform", "recompute_num_layers": 1}  # fmt: skip
    configs = {
        "actor_train": worker_config(qwen3_vl, "actor_train", device_mapping=[0, 1], training_args=TRAINING,
                                     strategy_args={"strategy_name": "megatron_train", "strategy_config": tp2}),
        # hf_infer runs inside actor_train's processes (shared processes): the sync loads it in process
        "actor_infer": worker_config(qwen3_vl, "actor_infer", device_mapping=[0, 1],
                                     strategy_args={"strategy_name": "hf_infer"}),
    }  # fmt: skip
    with Roles(ClusterSpec(num_nodes=1, num_gpus_per_node=2), configs, rpc_timeout=120) as started:
        yield started


def hf_state(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).state_dict()


def test_tp_scores_video_prompts_like_hf(roles, qwen3_vl):
    """Videos (timestamped blocks, one-frame RoPE numbering, DeepStack features at the video pads) with a picture in
    the same batch, before any update: log-probs equal the HF model on each sample alone."""
    prompts = video_prompts(qwen3_vl, "qwen3_vl")
    batch = teacher_forced(RolloutBatch.concat([prompts, prompts.slice(0, 1)]))  # 4: two data-parallel halves
    mask = batch.batch["response_mask"]
    train = roles["actor_train"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    torch.testing.assert_close(train[mask], alone(qwen3_vl, batch)[mask], atol=2e-6, rtol=0)


def test_megatron_trains_qwen2_5_vl_videos_like_fsdp2(tmp_path):
    """Qwen2.5-VL videos (``second_per_grid_ts`` in the positions) in megatron_train: log-probs of the HF model on each
    sample alone, and the update of fsdp2_train (vision tower included)."""
    require_engine("megatron_train")
    build_tiny_vl_model(tmp_path, CORPUS, model_type="qwen2_5_vl", num_key_value_heads=2)
    batch = teacher_forced(video_prompts(tmp_path, "qwen2_5_vl"))
    mask = batch.batch["response_mask"]
    training = {**TRAINING, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 1}
    config = worker_config(tmp_path, training_args=training, strategy_args={"strategy_name": "megatron_train"})
    megatron = create_strategy(config, "actor_train")
    megatron.initialize()
    tower = "model.visual.patch_embed.proj.weight"  # the frames' gradients reach the tower
    before = dict(megatron.named_weights())[tower].clone()
    scored = megatron.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(scored[mask], alone(tmp_path, batch)[mask], atol=2e-6, rtol=0)
    batch.batch["old_log_probs"] = scored
    batch.batch["advantages"] = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape) * mask
    fsdp2 = create_strategy(worker_config(tmp_path, training_args=training), "actor_train")
    fsdp2.initialize()
    a, b = megatron.train_step(batch, ActorObjective()), fsdp2.train_step(batch, ActorObjective())
    assert a["pg_loss"] == pytest.approx(b["pg_loss"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    after, reference = dict(megatron.named_weights()), dict(fsdp2.named_weights())
    torch.testing.assert_close(after[tower], reference[tower], atol=2e-6, rtol=0)
    assert not torch.equal(after[tower], before)


def test_tp_scores_trains_and_syncs_a_vl_model_like_hf_and_fsdp2(roles, qwen3_vl, tmp_path):
    batch = teacher_forced(vl_prompts(qwen3_vl, extra=1))
    mask = batch.batch["response_mask"]
    expected = alone(qwen3_vl, batch)
    train = roles["actor_train"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    # fp32: the TP all-reduces only reorder sums (measured within 1e-6)
    torch.testing.assert_close(train[mask], expected[mask], atol=2e-6, rtol=0)

    batch.batch["old_log_probs"] = train
    batch.batch["advantages"] = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape) * mask
    metrics = roles["actor_train"].call("train_step", batch, ActorObjective(), dispatch="dp_split")
    single = create_strategy(worker_config(qwen3_vl, training_args=TRAINING), "actor_train")
    single.initialize()
    before = {name: value.clone() for name, value in single.named_weights()}
    single_metrics = single.train_step(batch, ActorObjective())
    assert metrics[0]["actor/pg_loss"] == pytest.approx(single_metrics["pg_loss"], abs=1e-6)
    assert metrics[0]["actor/grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
    roles["actor_train"].call("save_hf", str(tmp_path / "hf"))
    exported, updated = hf_state(tmp_path / "hf"), dict(single.named_weights())
    assert exported.keys() == updated.keys()
    for name, value in updated.items():
        torch.testing.assert_close(exported[name], value, atol=2e-6, rtol=0, msg=name)
    trained = {name for name in updated if not torch.equal(updated[name], before[name])}
    assert any(name.startswith("model.visual.deepstack_merger_list.") for name in trained)
    assert any(name.startswith("model.visual.blocks.0.") for name in trained)

    roles.model_updater("actor_train", "actor_infer").sync()  # transformers' names, vision tower included
    synced = roles["actor_infer"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    now = roles["actor_train"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    torch.testing.assert_close(synced[mask], now[mask], atol=2e-6, rtol=0)
    assert not torch.allclose(now[mask], train[mask], atol=1e-3)


def test_rolls_vision_model_prefix_freezes_the_tower_in_megatron(qwen3_vl):
    """``freeze_module_prefix: vision_model`` (ROLL's Qwen3-VL Megatron example): no master, no optimizer state and no
    change for the tower while the language model trains; a sync after the first leaves it out. HF's name for it is
    refused, naming the key and the Megatron names."""
    from rl_engines.role_worker import weights_to_send

    require_engine("megatron_train")
    batch = teacher_forced(vl_prompts(qwen3_vl))
    mask = batch.batch["response_mask"]
    config = worker_config(qwen3_vl, training_args={**TRAINING, "per_device_train_batch_size": 3,
                           "gradient_accumulation_steps": 1}, model_args={"freeze_module_prefix": "vision_model"},
                           strategy_args={"strategy_name": "megatron_train"})  # fmt: skip
    train = create_strategy(config, "actor_train")
    train.initialize()
    before = {name: value.clone() for name, value in train.named_weights()}
    visual = {name for name in before if name.startswith("model.visual.")}
    assert visual and train.frozen == visual
    assert not any(name.startswith("vision_model.") for name in train.masters)
    batch.batch["old_log_probs"] = train.compute_log_probs(batch).batch["log_probs"]
    batch.batch["advantages"] = torch.ones(mask.shape) * mask
    train.train_step(batch, ActorObjective())
    after = dict(train.named_weights())
    assert all(torch.equal(after[name], before[name]) for name in visual)
    assert not torch.equal(after["model.language_model.layers.0.mlp.up_proj.weight"],
                           before["model.language_model.layers.0.mlp.up_proj.weight"])  # fmt: skip
    assert {name for name, _ in weights_to_send(train, "module", frozen=False)} == set(after) - visual

    config.model_args.freeze_module_prefix = "model.visual"
    refused = r"freeze_module_prefix: \['model\.visual'\] match no parameter.*'vision_model"
    with pytest.raises(ValueError, match=refused):
        create_strategy(config, "actor_train").initialize()


def test_what_megatron_does_not_build_for_a_vl_model_is_refused_naming_the_key(qwen3_vl):
    require_engine("megatron_train")
    packed = worker_config(qwen3_vl, use_sequence_packing=True, strategy_args={"strategy_name": "megatron_train"})
    with pytest.raises(ValueError, match=r"actor_train\.use_sequence_packing: the Megatron strategies do not pack"):
        create_strategy(packed, "actor_train")
    infer = create_strategy(worker_config(qwen3_vl, "reference", strategy_args={"strategy_name": "megatron_infer"}),
                            "reference")  # fmt: skip
    infer.initialize()
    with pytest.raises(ValueError, match=r"reference: megatron_infer generates from text prompts only"):
        infer.generate(vl_prompts(qwen3_vl))


def test_qwen3_vl_moe_over_expert_parallel_ranks_scores_trains_and_syncs_like_hf_and_fsdp2(ray_session, tmp_path):
    """Qwen3-VL-MoE (ROLL's video_r1.yaml architecture) in megatron_train with expert_model_parallel_size 2 on 2 Ray
    ranks, each holding 2 of a layer's 4 experts (the files stack them: rl_ckpt.experts): log-probs of the HF model
    on each sample alone; with the router loss on, the update of fsdp2_train on one rank over the same micro-batches;
    the HF export (experts stacked again, vision tower included) loads into transformers as that update, and a sync
    into hf_infer scores as the trained model."""
    require_engine("megatron_train")
    build_tiny_vl_model(tmp_path / "vl", CORPUS, model_type="qwen3_vl_moe", num_key_value_heads=2)
    path = tmp_path / "vl"
    batch = teacher_forced(vl_prompts(path, extra=1))  # 4 samples: one micro-batch of 2 per rank, one step
    mask = batch.batch["response_mask"]
    router = {"moe_aux_loss_coef": 0.5}
    training = {**TRAINING, "gradient_accumulation_steps": 1}
    options = {"expert_model_parallel_size": 2}
    configs = {
        "actor_train": worker_config(path, "actor_train", device_mapping=[0, 1], training_args=training,
                                     model_args=router,
                                     strategy_args={"strategy_name": "megatron_train", "strategy_config": options}),
        "actor_infer": worker_config(path, "actor_infer", device_mapping=[0, 1],
                                     strategy_args={"strategy_name": "hf_infer"}),
    }  # fmt: skip
    single = create_strategy(worker_config(path, training_args=TRAINING, model_args=router), "actor_train")
    single.initialize()
    with Roles(ClusterSpec(num_nodes=1, num_gpus_per_node=2), configs, rpc_timeout=120) as roles:
        train = roles["actor_train"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
        torch.testing.assert_close(train[mask], alone(path, batch)[mask], atol=2e-6, rtol=0)
        batch.batch["old_log_probs"] = train
        batch.batch["advantages"] = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape) * mask
        ours = roles["actor_train"].call("train_step", batch, ActorObjective(), dispatch="dp_split")[0]
        theirs = single.train_step(batch, ActorObjective())
        assert ours["actor/pg_loss"] == pytest.approx(theirs["pg_loss"], abs=1e-6)
        assert ours["actor/grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert ours["actor_train/load_balancing_loss"] == pytest.approx(theirs["load_balancing_loss"], rel=1e-5)
        roles["actor_train"].call("save_hf", str(tmp_path / "hf"))
        roles.model_updater("actor_train", "actor_infer").sync()
        synced = roles["actor_infer"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    exported, updated = hf_state(tmp_path / "hf"), dict(single.named_weights())
    assert exported.keys() == updated.keys()
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in updated
    for name, value in updated.items():
        torch.testing.assert_close(exported[name], value, atol=2e-6, rtol=0, msg=name)
    trained = single.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(synced[mask], trained[mask], atol=2e-6, rtol=0)
    assert not torch.allclose(trained[mask], train[mask], atol=1e-3)

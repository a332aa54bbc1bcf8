"""Vision-language models in the torch-native engines (issue 23): tiny Qwen2.5-VL, Qwen2-VL and Qwen3-VL models
built locally, prompts with images of different sizes through the model's own image processor, generation in
hf_infer, log-probs and training in fsdp2_train, weight sync. The reference is the HF model itself on each sample
alone, without padding, with the token types its processor returns (so its multimodal RoPE positions are 3-D)."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import CORPUS, worker_config
from transformers import AutoConfig
from vl_fixtures import alone, ieee_fp32_convolutions, teacher_forced, vl_prompts

from rl_engines.config import GeneratingArgs
from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import VL_MODEL_TYPES, build_tiny_vl_model
from rl_engines.vision import VISUAL_KEY

__all__ = ["ieee_fp32_convolutions"]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_vl")
    build_tiny_vl_model(path, CORPUS)
    return path


@pytest.fixture(scope="module", params=VL_MODEL_TYPES)
def any_vl_dir(request, vl_dir, tmp_path_factory):
    """A tiny model of each architecture: Qwen2.5-VL, Qwen2-VL, Qwen3-VL (16-pixel patches, DeepStack)."""
    if request.param == "qwen2_5_vl":
        return vl_dir
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_vl_model(path, CORPUS, model_type=request.param)
    return path


def test_vl_rollouts_score_train_and_sync_as_the_hf_model(any_vl_dir):
    vl_dir = any_vl_dir
    args = GeneratingArgs(max_new_tokens=5, temperature=1.0, num_return_sequences=2, seed=3)
    infer = create_strategy(worker_config(vl_dir, "actor_infer", generating_args=args.__dict__,
                                          strategy_args={"strategy_name": "hf_infer"}), "actor_infer")  # fmt: skip
    infer.initialize()
    rollout = infer.generate(vl_prompts(vl_dir), args)
    assert len(rollout) == 6 and len(rollout.non_tensor_batch[VISUAL_KEY]) == 6
    mask = rollout.batch["response_mask"]
    expected = alone(vl_dir, rollout)
    # generation's own log-probs (KV cache, multimodal RoPE offsets) agree with a fresh forward
    torch.testing.assert_close(rollout.batch["rollout_log_probs"][mask], expected[mask], atol=1e-4, rtol=0)

    training = {"learning_rate": 1e-2, "per_device_train_batch_size": 6}
    train = create_strategy(worker_config(vl_dir, training_args=training, infer_batch_size=4), "actor_train")
    train.initialize()
    scored = train.compute_log_probs(rollout).batch["log_probs"]
    torch.testing.assert_close(scored[mask], expected[mask], atol=1e-5, rtol=0)

    rollout.batch["old_log_probs"] = scored
    rollout.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    before = {name: value.clone() for name, value in train.named_weights()}
    metrics = train.train_step(rollout, ActorObjective())
    after = dict(train.named_weights())
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert any(name.startswith("visual.") or ".visual." in name for name in changed), sorted(changed)[:5]
    assert any("layers.0.self_attn" in name and "visual" not in name for name in changed)
    moe = AutoConfig.from_pretrained(vl_dir).model_type == "qwen3_vl_moe"  # its routers train, balanced by the aux loss
    assert ("load_balancing_loss" in metrics) == moe
    assert not moe or any(name.endswith("layers.0.mlp.gate.weight") for name in changed)

    infer.load_weights(train.named_weights())
    synced = infer.compute_log_probs(rollout).batch["log_probs"]
    torch.testing.assert_close(synced[mask], train.compute_log_probs(rollout).batch["log_probs"][mask], atol=1e-5,
                               rtol=0)  # fmt: skip


PACKED = {"use_sequence_packing": True,
          "sequence_packing_args": {"algorithm": "load_balance", "max_packed_sequence_length_train": 128,
                                    "max_packed_sequence_length_forward": 128}}  # fmt: skip
"""ROLL's sequence packing with rows of 128 tokens: the three samples (about 20 tokens each) share one row."""


def test_vl_samples_pack_into_one_row_and_score_and_train_as_padded_rows(any_vl_dir):
    """use_sequence_packing on a VL batch (pictures of two sizes and a text-only sample in one packed row, each
    token at the multimodal RoPE position the padded forward gives it): the log-probs and the update equal the
    padded ones."""
    rollout = teacher_forced(vl_prompts(any_vl_dir))
    mask = rollout.batch["response_mask"]
    # adam_epsilon 1e-3: Adam would turn the rounding of near-zero gradients into full-rate steps
    training = {"learning_rate": 1e-2, "adam_epsilon": 1e-3, "per_device_train_batch_size": 3}
    runs = {}
    for layout, extra in (("padded", {}), ("packed", PACKED)):
        strategy = create_strategy(worker_config(any_vl_dir, training_args=training, **extra), "actor_train")
        strategy.initialize()
        scored = strategy.compute_log_probs(rollout).batch["log_probs"]
        rollout.batch["old_log_probs"] = scored
        rollout.batch["advantages"] = torch.ones(mask.shape) * mask
        runs[layout] = (scored, strategy.train_step(rollout, ActorObjective()), dict(strategy.named_weights()))
    (padded, padded_metrics, padded_weights), (packed, packed_metrics, packed_weights) = runs.values()
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    for key in ("pg_loss", "grad_norm"):
        assert packed_metrics[key] == pytest.approx(padded_metrics[key], rel=1e-5, abs=1e-6), key
    for name, value in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], value, atol=1e-6, rtol=0, msg=name)


def test_rolls_freeze_module_prefix_freezes_the_vision_tower_and_syncs_it_once(vl_dir):
    """``freeze_module_prefix: model.visual`` (ROLL's Qwen2.5-VL fsdp2 example): the vision tower gets no gradient
    and no optimizer state and stays as loaded while the language model trains; a weight sync after the first leaves
    the frozen weights out, the first sends them. A prefix that matches nothing is refused naming it."""
    from rl_engines.role_worker import weights_to_send

    rollout = teacher_forced(vl_prompts(vl_dir))
    mask = rollout.batch["response_mask"]
    training = {"learning_rate": 1e-2, "per_device_train_batch_size": 3}
    train = create_strategy(worker_config(vl_dir, training_args=training, model_args={
        "freeze_module_prefix": "model.visual"}), "actor_train")  # fmt: skip
    train.initialize()
    visual = {name for name, _ in train.named_weights() if name.startswith("model.visual.")}
    assert visual and train.frozen == visual
    assert not any(id(p) in {id(q) for q in train.model.model.visual.parameters()}
                   for group in train.optimizer.param_groups for p in group["params"])  # fmt: skip
    rollout.batch["old_log_probs"] = train.compute_log_probs(rollout).batch["log_probs"]
    rollout.batch["advantages"] = torch.ones(mask.shape) * mask
    before = dict((name, value.clone()) for name, value in train.named_weights())
    train.train_step(rollout, ActorObjective())
    after = dict(train.named_weights())
    assert all(torch.equal(after[name], before[name]) for name in visual)
    assert not torch.equal(after["model.language_model.layers.0.mlp.up_proj.weight"],
                           before["model.language_model.layers.0.mlp.up_proj.weight"])  # fmt: skip
    assert {name for name, _ in weights_to_send(train, "module", frozen=True)} == set(after)
    assert {name for name, _ in weights_to_send(train, "module", frozen=False)} == set(after) - visual

    with pytest.raises(ValueError, match=r"actor_train\.model_args\.freeze_module_prefix: \['vision_model'\] match"):
        create_strategy(
            worker_config(vl_dir, training_args=training, model_args={"freeze_module_prefix": "vision_model"}),
            "actor_train",
        ).initialize()


def test_deepspeed_freezes_the_vision_tower_and_updates_the_rest_like_fsdp2(vl_dir):
    """ROLL's freeze_module_prefix on deepspeed_train (ZeRO-2): the vision tower stays as loaded and out of the
    weight sync after the first, and the language model gets fsdp2_train's update on the same VL batch."""
    pytest.importorskip("deepspeed")
    from rl_engines.role_worker import weights_to_send

    rollout = teacher_forced(vl_prompts(vl_dir))
    mask = rollout.batch["response_mask"]
    training = {"learning_rate": 1e-2, "adam_epsilon": 1e-3, "per_device_train_batch_size": 3}
    updated = {}
    for name, strategy_args in (("fsdp2", {}), ("zero2", {"strategy_name": "deepspeed_train",
                                                          "strategy_config": {"zero_stage": 2}})):  # fmt: skip
        config = worker_config(vl_dir, training_args=training, strategy_args=strategy_args,
                               model_args={"freeze_module_prefix": "model.visual"})  # fmt: skip
        train = create_strategy(config, "actor_train")
        train.initialize()
        rollout.batch["old_log_probs"] = train.compute_log_probs(rollout).batch["log_probs"]
        rollout.batch["advantages"] = torch.ones(mask.shape) * mask
        before = {key: value.clone() for key, value in train.named_weights()}
        train.train_step(rollout, ActorObjective())
        updated[name] = dict(train.named_weights())
        visual = {key for key in before if key.startswith("model.visual.")}
        assert visual and train.frozen == visual
        assert all(torch.equal(updated[name][key], before[key]) for key in visual)
        assert {key for key, _ in weights_to_send(train, "module", frozen=False)} == set(before) - visual
    for key, value in updated["fsdp2"].items():
        torch.testing.assert_close(updated["zero2"][key], value, atol=1e-6, rtol=0, msg=key)


def test_deepspeed_trains_qwen3_vl_moe_like_fsdp2(tmp_path):
    """Qwen3-VL-MoE on deepspeed_train (ZeRO-2): the update of fsdp2_train on the same VL batch, router load-balancing
    loss included (its metric equal too)."""
    pytest.importorskip("deepspeed")
    build_tiny_vl_model(tmp_path, CORPUS, model_type="qwen3_vl_moe")
    rollout = teacher_forced(vl_prompts(tmp_path))
    mask = rollout.batch["response_mask"]
    training = {"learning_rate": 1e-2, "adam_epsilon": 1e-3, "per_device_train_batch_size": 3}
    updated, metrics = {}, {}
    for name, strategy_args in (("fsdp2", {}), ("zero2", {"strategy_name": "deepspeed_train",
                                                          "strategy_config": {"zero_stage": 2}})):  # fmt: skip
        train = create_strategy(worker_config(tmp_path, training_args=training, strategy_args=strategy_args),
                                "actor_train")  # fmt: skip
        train.initialize()
        rollout.batch["old_log_probs"] = train.compute_log_probs(rollout).batch["log_probs"]
        rollout.batch["advantages"] = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape) * mask
        metrics[name] = train.train_step(rollout, ActorObjective())
        updated[name] = dict(train.named_weights())
    assert metrics["zero2"]["load_balancing_loss"] == pytest.approx(metrics["fsdp2"]["load_balancing_loss"], abs=1e-6)
    for key, value in updated["fsdp2"].items():
        torch.testing.assert_close(updated["zero2"][key], value, atol=1e-6, rtol=0, msg=key)


def test_what_does_not_take_pictures_yet_refuses_a_vl_model_or_batch(vl_dir):
    """vLLM / SGLang would drop the prompts' pictures and Ulysses' packed rows do not carry them: each refuses,
    naming the key, rather than run blind to the pictures. Frozen weights are left out of a sync only into an engine
    that loads any subset of tensors and keeps its weights (hf_infer)."""
    from types import SimpleNamespace

    from rl_engines.role_worker import RoleWorker
    from rl_engines.strategies.ulysses import ulysses_outputs

    for engine in ("vllm", "sglang"):
        with pytest.raises(ValueError, match=rf"is a vision-language model; the {engine} adapter does not pass"):
            create_strategy(worker_config(vl_dir, "actor_infer", strategy_args={"strategy_name": engine}),
                            "actor_infer")  # fmt: skip
    with pytest.raises(ValueError, match=r"ulysses_size > 1 on a vision-language batch"):
        ulysses_outputs(None, vl_prompts(vl_dir), torch.device("cpu"), None, kernel="sdpa", value_head=False,
                        temperature=1.0, with_entropy=False)  # fmt: skip
    hf = create_strategy(worker_config(vl_dir, "actor_infer", strategy_args={"strategy_name": "hf_infer"}),
                         "actor_infer")  # fmt: skip
    assert not RoleWorker.needs_every_weight(SimpleNamespace(strategy=hf))
    assert RoleWorker.needs_every_weight(SimpleNamespace(strategy=SimpleNamespace()))  # fuses / reloads by layer
    dropping = SimpleNamespace(loads_any_subset=True, discards_weights=lambda: True)  # vLLM sleep_level 2
    assert RoleWorker.needs_every_weight(SimpleNamespace(strategy=dropping))

"""ROLL's tiled MLP in fsdp2 (strategy_config apply_tiled_mlp / tiled_num_shards / model_type): each MLP runs on
slices of the sequence one after another, recomputed per slice in the backward; scores and the update equal the
untiled MLP's. apply_expert_patch is accepted as ROLL takes it with transformers >= 5.2 (off, said so)."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import rollout_batch, tiny_model_dir, worker_config

from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy

__all__ = ["tiny_model_dir"]
ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}


def make(model_dir, options, name="fsdp2_train", role="actor_train"):
    config = worker_config(model_dir, role, training_args=ARGS if name == "fsdp2_train" else None,
                           strategy_args={"strategy_name": name, "strategy_config": options})  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


def mlp_calls(strategy, batch):
    """How often layer 0's gate projection runs in one log-prob pass."""
    calls = []
    layer = strategy.model.model.layers[0].mlp
    handle = layer.gate_proj.register_forward_hook(lambda *args: calls.append(1))
    try:
        strategy.compute_log_probs(batch)
    finally:
        handle.remove()
    return len(calls)


def test_a_tiled_mlp_scores_and_trains_as_the_whole_mlp(tiny_model_dir):
    batch = rollout_batch(4)
    plain, tiled = make(tiny_model_dir, {}), make(tiny_model_dir, {"apply_tiled_mlp": True, "tiled_num_shards": 3})
    passes = mlp_calls(plain, batch)  # one per micro-batch
    assert passes > 0 and mlp_calls(tiled, batch) == 3 * passes  # three slices per MLP call
    scores = [s.compute_log_probs(batch).batch["log_probs"] for s in (plain, tiled)]
    torch.testing.assert_close(scores[1], scores[0], atol=1e-6, rtol=0)
    batch.batch["old_log_probs"] = scores[0]
    ours, theirs = tiled.train_step(batch, ActorObjective()), plain.train_step(batch, ActorObjective())
    assert ours["pg_loss"] == pytest.approx(theirs["pg_loss"], abs=1e-6)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    after = dict(plain.named_weights())
    # Adam's first step is about lr * sign(gradient) = 1e-2 per weight, so a wrong gradient moves a weight by ~1e-2;
    # a gradient near zero turns its rounding into up to lr / adam_epsilon times as much: measured 1.9e-5 on one
    # weight of 16k on an AVX-512 AMD EPYC (0 on the earlier machines)
    for name, weight in tiled.named_weights():
        torch.testing.assert_close(weight, after[name], atol=1e-4, rtol=0, msg=name)
    reference = make(tiny_model_dir, {"apply_tiled_mlp": True, "model_type": "qwen2"}, "fsdp2_infer", "reference")
    assert mlp_calls(reference, batch) == 4 * passes  # ROLL's default tiled_num_shards


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tiled_num_shards": 8},
            r"\['actor_train\.strategy_args\.strategy_config\.tiled_num_shards'\] apply to the "
            r"tiled MLP only; set actor_train\.strategy_args\.strategy_config\.apply_tiled_mlp",
        ),
        ({"apply_tiled_mlp": True, "model_type": "gpt2"}, r"model_type='gpt2': the tiled MLP supports \["),
        ({"apply_tiled_mlp": True, "tiled_num_shards": 0}, r"tiled_num_shards=0 must be >= 1"),
    ],
)
def test_tiled_mlp_keys_are_checked_naming_them(tiny_model_dir, options, message):
    with pytest.raises(ValueError, match=message):
        create_strategy(
            worker_config(tiny_model_dir, strategy_args={"strategy_name": "fsdp2_train", "strategy_config": options}),
            "actor_train",
        )


def test_the_expert_patch_is_off_as_roll_turns_it_off_with_fused_experts(tiny_model_dir):
    strategy = create_strategy(worker_config(tiny_model_dir, strategy_args={
        "strategy_name": "fsdp2_train", "strategy_config": {"apply_expert_patch": True}}), "actor_train")  # fmt: skip
    assert any(
        "apply_expert_patch: true - ROLL's per-expert module patch, which ROLL itself turns off with "
        "transformers >= 5.2" in note
        for note in strategy.notes()
    )

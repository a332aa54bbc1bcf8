"""Contract suite for train strategies: every registered ``kind == "train"`` strategy must pass it.

Runs in-process (a world of one); the multi-rank behaviour is covered in test_engines_roles.py on Ray.
Expected values come from an independent slow reference (fresh HF model, one un-padded forward per token).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
from engine_fixtures import (
    file_size_limit,
    leftovers,
    reference_log_probs,
    require_engine,
    rollout_batch,
    strategies_of_kind,
    tiny_model_dir,
    worker_config,
)

from rl_core.batch import BatchSizeError
from rl_core.losses import LossCoefficients
from rl_engines.disk_space import OutOfSpaceError
from rl_engines.objectives import ActorObjective, CriticObjective
from rl_engines.strategies import create_strategy

__all__ = ["tiny_model_dir"]


@pytest.fixture(params=strategies_of_kind("train"))
def strategy_name(request: pytest.FixtureRequest) -> str:
    return require_engine(str(request.param))


def make(strategy_name, model_dir, role="actor_train", **training_args):
    args = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, **training_args}
    config = worker_config(model_dir, role, training_args=args, infer_batch_size=3,
                           strategy_args={"strategy_name": strategy_name})  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


def with_old_log_probs(strategy, batch):
    batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
    return batch


def test_log_probs_and_entropy_match_an_unpadded_reference(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir)
    batch = rollout_batch(batch_size=5)
    out = strategy.compute_log_probs(batch, temperature=0.7, with_entropy=True)
    mask = batch.batch["response_mask"]
    expected = reference_log_probs(tiny_model_dir, batch, temperature=0.7)
    torch.testing.assert_close(out.batch["log_probs"][mask].double(), expected[mask], atol=2e-5, rtol=0)
    entropy = out.batch["entropy"]
    assert entropy.shape == mask.shape
    assert bool((entropy[mask] > 0).all()) and bool((entropy[mask] <= torch.log(torch.tensor(259.0)) + 1e-4).all())


def test_positive_advantages_raise_the_log_probs_of_the_trained_tokens(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, learning_rate=3e-3)
    batch = rollout_batch(batch_size=4)
    batch.batch["advantages"] = torch.ones_like(batch.batch["advantages"])
    mask = batch.batch["response_mask"]
    before = strategy.compute_log_probs(batch).batch["log_probs"][mask].mean()
    for _ in range(3):
        with_old_log_probs(strategy, batch)
        metrics = strategy.train_step(batch, ActorObjective())
        assert metrics["skipped_steps"] == 0
    after = strategy.compute_log_probs(batch).batch["log_probs"][mask].mean()
    assert after > before + 0.1


@pytest.mark.parametrize(("micro", "accumulation"), [(1, 4), (2, 2)])
def test_update_is_independent_of_the_micro_batch_split(strategy_name, tiny_model_dir, micro, accumulation):
    # Adam divides each coordinate by its own magnitude, which turns the rounding noise of a near-zero gradient
    # summed in another order into a visible step; a larger epsilon keeps this a comparison of gradients.
    batch = rollout_batch(batch_size=4, seed=3)
    whole = make(strategy_name, tiny_model_dir, per_device_train_batch_size=4, adam_epsilon=1e-4)
    split = make(strategy_name, tiny_model_dir, per_device_train_batch_size=micro,
                 gradient_accumulation_steps=accumulation, adam_epsilon=1e-4)  # fmt: skip
    with_old_log_probs(whole, batch)
    noise = torch.randn(batch.batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(5))
    batch.batch["old_log_probs"] = batch.batch["old_log_probs"] + 0.2 * noise  # ratios off 1: metrics not trivial
    objective = ActorObjective(loss_agg_mode="seq-mean-token-mean")
    metrics_whole = whole.train_step(batch, objective)
    metrics_split = split.train_step(batch, objective)
    assert 0.0 < metrics_whole["ppo_ratio_clipfrac"] < 1.0 and metrics_whole["ratio_min"] < 1.0
    for key in ("pg_loss", "total_loss", "grad_norm", "pg_clipfrac", "ratio_mean", "ratio_max", "ratio_min",
                "approxkl", "policykl", "ppo_ratio_high_clipfrac", "ppo_ratio_low_clipfrac", "clipfrac"):  # fmt: skip
        assert metrics_split[key] == pytest.approx(metrics_whole[key], abs=1e-6), key
    weights_whole, weights_split = dict(whole.named_weights()), dict(split.named_weights())
    for name, value in weights_whole.items():
        torch.testing.assert_close(weights_split[name], value, atol=1e-6, rtol=0)


def test_grad_norm_equals_plain_torch_on_the_same_loss(strategy_name, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rl_core.losses import GlobalBatchInfo
    from rl_engines.strategies.model_io import forward_log_probs

    batch = rollout_batch(batch_size=4, seed=5)
    strategy = make(strategy_name, tiny_model_dir, per_device_train_batch_size=4, max_grad_norm=1e-3)
    with_old_log_probs(strategy, batch)
    objective = ActorObjective()
    metrics = strategy.train_step(batch, objective)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    log_probs, _ = forward_log_probs(model, batch, torch.device("cpu"))
    loss, _ = objective({"log_probs": log_probs}, batch, GlobalBatchInfo.from_mask(batch.batch["response_mask"]))
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)  # reported before clipping


def test_checkpoint_resume_equals_uninterrupted_training(strategy_name, tiny_model_dir, tmp_path):
    batches = [rollout_batch(batch_size=4, seed=s) for s in (10, 11)]
    objective = ActorObjective(coefficients=LossCoefficients(entropy_loss_coef=0.01))
    first = make(strategy_name, tiny_model_dir, lr_scheduler_type="linear", max_steps=8, warmup_steps=1)
    first.train_step(with_old_log_probs(first, batches[0]), objective)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left behind
    expected = first.train_step(with_old_log_probs(first, batches[1]), objective)

    resumed = make(strategy_name, tiny_model_dir, lr_scheduler_type="linear", max_steps=8, warmup_steps=1)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.global_step == first.global_step - 2
    batches[1].batch.pop("old_log_probs")
    got = resumed.train_step(with_old_log_probs(resumed, batches[1]), objective)
    assert got == expected
    for (name, a), (_, b) in zip(first.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name


def test_a_full_disk_fails_the_save_and_export_cleanly_and_resume_equals_uninterrupted(
    strategy_name, tiny_model_dir, tmp_path
):
    """Writes past 64 KiB fail (EFBIG, as ENOSPC on a full disk): one error naming the path and the sizes, no
    temporary folder left, the earlier checkpoint and export untouched; after the limit is lifted, resuming from
    that checkpoint equals the uninterrupted run, and the same save succeeds."""
    batches = [rollout_batch(batch_size=4, seed=s) for s in (10, 11)]
    objective = ActorObjective()
    first = make(strategy_name, tiny_model_dir)
    first.train_step(with_old_log_probs(first, batches[0]), objective)
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    first.save_checkpoint(str(ckpt))
    first.save_hf(str(hf))
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    expected = first.train_step(with_old_log_probs(first, batches[1]), objective)

    for call, path in ((first.save_checkpoint, ckpt), (first.save_hf, hf)):
        with file_size_limit(64 << 10), pytest.raises(OutOfSpaceError) as caught:
            call(str(path))
        message = str(caught.value)
        assert "actor_train: rank 0 could not " in message and f" {path}: out of disk space (" in message, message
        assert "File too large" in message or "torch wrote a file only in part" in message, message
        assert re.search(r"It needs about \d+\.\d\d [KM]iB; .* are free on that file system, and this process may "
                         r"write files of at most 64\.00 KiB \(ulimit -f\)", message), message  # fmt: skip
        assert "was removed" in message and "Fix: free space there, point output_dir" in message, message
        assert leftovers(tmp_path) == []
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before  # the complete checkpoint untouched
    assert (ckpt / "COMPLETE").exists() and (hf / "config.json").exists()

    resumed = make(strategy_name, tiny_model_dir)
    resumed.load_checkpoint(str(ckpt))
    batches[1].batch.pop("old_log_probs")
    assert resumed.train_step(with_old_log_probs(resumed, batches[1]), objective) == expected
    for (name, a), (_, b) in zip(first.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name
    first.save_checkpoint(str(ckpt))  # space is back: the same save goes through on a clean tree
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"] and leftovers(tmp_path) == []


def test_incomplete_checkpoint_is_refused_with_the_path(strategy_name, tiny_model_dir, tmp_path):
    strategy = make(strategy_name, tiny_model_dir)
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        strategy.load_checkpoint(str(tmp_path / "half"))


def test_exported_hf_folder_loads_in_transformers_and_scores_the_same(strategy_name, tiny_model_dir, tmp_path):
    strategy = make(strategy_name, tiny_model_dir)
    batch = rollout_batch(batch_size=3, seed=7)
    strategy.train_step(with_old_log_probs(strategy, batch.index([0, 1])), ActorObjective())
    strategy.save_hf(str(tmp_path / "hf"))
    names = {name for name, _ in strategy.named_weights()}
    from transformers import AutoModelForCausalLM

    reference_names = set(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict())
    assert names == reference_names
    mask = batch.batch["response_mask"]
    expected = reference_log_probs(tmp_path / "hf", batch)
    got = strategy.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(got[mask].double(), expected[mask], atol=2e-5, rtol=0)
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_learning_rate_follows_warmup_then_linear_decay(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, learning_rate=1.0, lr_scheduler_type="linear", warmup_steps=2,
                    max_steps=4, per_device_train_batch_size=1)  # fmt: skip
    batch = rollout_batch(batch_size=1)
    lrs = [strategy.train_step(with_old_log_probs(strategy, batch), ActorObjective())["lr"] for _ in range(4)]
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.5])  # the rate each step applied (transformers' convention)


def test_non_finite_gradient_skips_the_update(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir)
    batch = with_old_log_probs(strategy, rollout_batch(batch_size=2))
    batch.batch["advantages"][0, 0] = float("nan")
    before = {name: value.clone() for name, value in strategy.named_weights()}
    metrics = strategy.train_step(batch, ActorObjective())
    assert metrics["skipped_steps"] == 1
    assert math.isnan(metrics["grad_norm"])  # no finite step to average
    for name, value in strategy.named_weights():
        assert torch.equal(value, before[name]), name


def test_batch_not_divisible_by_the_mini_batch_names_the_keys(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    batch = with_old_log_probs(strategy, rollout_batch(batch_size=6))
    with pytest.raises(BatchSizeError, match="per_device_train_batch_size \\(2\\) x gradient_accumulation_steps"):
        strategy.train_step(batch, ActorObjective())


def test_decaying_schedule_without_max_steps_is_rejected(strategy_name, tiny_model_dir):
    with pytest.raises(ValueError, match=r"actor_train\.training_args\.max_steps"):
        make(strategy_name, tiny_model_dir, lr_scheduler_type="cosine")


def test_critic_values_and_value_loss_training(strategy_name, tiny_model_dir):
    critic = make(strategy_name, tiny_model_dir, role="critic", learning_rate=1e-2)
    batch = rollout_batch(batch_size=4)
    values = critic.compute_values(batch).batch["values"]
    assert values.shape == batch.batch["responses"].shape
    batch.batch["returns"] = torch.full_like(values, 2.0)
    losses = []
    for _ in range(4):
        batch.batch["values"] = critic.compute_values(batch).batch["values"]
        losses.append(critic.train_step(batch, CriticObjective(value_clip=None))["value_loss"])
    assert losses[-1] < losses[0] * 0.8
    with pytest.raises(RuntimeError, match="value head"):
        critic.compute_log_probs(batch)
    with pytest.raises(ValueError, match="pass CriticObjective to the critic role"):
        critic.train_step(batch, ActorObjective())


def test_offload_and_reload_keep_the_weights(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir)
    batch = rollout_batch(batch_size=2)
    before = strategy.compute_log_probs(batch).batch["log_probs"]
    strategy.offload()
    strategy.reload()
    assert torch.equal(strategy.compute_log_probs(batch).batch["log_probs"], before)


def test_objective_rejects_an_unknown_policy_loss_on_the_driver():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        ActorObjective(policy_loss="ppo2")
    assert replace(ActorObjective(), policy_loss="gspo").policy_loss == "gspo"


def test_activation_checkpointing_does_not_change_the_update(strategy_name, tiny_model_dir):
    batch = rollout_batch(batch_size=4, seed=9)
    results = []
    for disable in (False, True):
        config = worker_config(tiny_model_dir, training_args={"per_device_train_batch_size": 2, "adam_epsilon": 1e-4},
                               model_args={"disable_gradient_checkpointing": disable},
                               strategy_args={"strategy_name": strategy_name})  # fmt: skip
        strategy = create_strategy(config, "actor_train")
        strategy.initialize()
        batch.batch.pop("old_log_probs", None)
        metrics = strategy.train_step(with_old_log_probs(strategy, batch), ActorObjective())
        results.append((metrics, dict(strategy.named_weights())))
    (with_ckpt, weights_a), (without, weights_b) = results
    assert with_ckpt["grad_norm"] == pytest.approx(without["grad_norm"], rel=1e-6)
    for name, value in weights_a.items():
        torch.testing.assert_close(weights_b[name], value, atol=1e-6, rtol=0)


def test_bf16_compute_trains_and_keeps_fp32_masters(strategy_name, tiny_model_dir):
    config = worker_config(tiny_model_dir, model_args={"dtype": "bf16"}, strategy_args={"strategy_name": strategy_name},
                           training_args={"learning_rate": 3e-3, "per_device_train_batch_size": 4})  # fmt: skip
    strategy = create_strategy(config, "actor_train")
    strategy.initialize()
    batch = rollout_batch(batch_size=4)
    batch.batch["advantages"] = torch.ones_like(batch.batch["advantages"])
    mask = batch.batch["response_mask"]
    before = strategy.compute_log_probs(batch).batch["log_probs"]
    assert before.dtype == torch.float32  # log-softmax runs in fp32 on bf16 logits
    for _ in range(3):
        batch.batch.pop("old_log_probs", None)
        strategy.train_step(with_old_log_probs(strategy, batch), ActorObjective())
    assert all(value.dtype == torch.float32 for _, value in strategy.named_weights())
    assert strategy.compute_log_probs(batch).batch["log_probs"][mask].mean() > before[mask].mean() + 0.1

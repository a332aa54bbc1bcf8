"""Ulysses sequence parallelism in fsdp2 (``model_args.ulysses_size``; rl_engines/strategies/ulysses.py).

What it promises: on 2 CPU ranks (gloo all-to-all) with ``ulysses_size: 2`` each rank runs half of every packed row,
and the log-probs, values and training metrics equal ``ulysses_size: 1`` on one rank (fp32, 1e-6; updated weights
1e-5), for a model with fewer key/value heads than ranks (they are repeated), one whose key/value heads split, and a
mixture-of-experts model whose router loss (its config's coefficient) is summed from the ranks' slices; bad sizes
fail naming the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from engine_fixtures import CORPUS, tiny_model_dir, worker_config
from test_engines_micro_batches import make, varied_batch

from rl_core.losses.terms import LossCoefficients
from rl_engines.objectives import ActorObjective, CriticObjective
from rl_engines.strategies import create_strategy
from rl_engines.strategies.ulysses import check_ulysses
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_moe_lm, build_tiny_tokenizer

__all__ = ["tiny_model_dir"]

ULYSSES = {"model_args": {"ulysses_size": 2}}


def critic_batch():
    batch = varied_batch(seed=7)
    gen = torch.Generator().manual_seed(7)
    batch.batch["values"] = torch.randn(batch.batch["response_mask"].shape, generator=gen)
    batch.batch["returns"] = torch.randn(batch.batch["response_mask"].shape, generator=gen)
    return batch


def run(strategy, rows: list[int], folder: str, tag: str) -> None:
    """Score, train one step (two mini-batches) and score again; save what this rank returns."""
    batch = varied_batch().index(rows)
    first = strategy.compute_log_probs(batch, with_entropy=True)
    batch.batch["old_log_probs"] = first.batch["log_probs"] + 0.01
    metrics = strategy.train_step(
        batch,
        ActorObjective(loss_agg_mode="seq-mean-token-mean", coefficients=LossCoefficients(entropy_loss_coef=0.01)),
    )
    after = strategy.compute_log_probs(batch).batch["log_probs"]
    weights = dict(strategy.named_weights())
    torch.save({"first": first.batch, "after": after, "weights": weights}, os.path.join(folder, f"{tag}.pt"))
    Path(folder, f"{tag}.json").write_text(json.dumps(metrics))


def _on_rank(rank: int, port: int, models: list[str], folder: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for index, model in enumerate(models):
            strategy = make("fsdp2_train", model, **ULYSSES)
            run(strategy, list(range(rank * 4, rank * 4 + 4)), folder, f"ulysses{index}-{rank}")
        critic = make("fsdp2_train", models[0], "critic", **ULYSSES)
        half = critic_batch().index(list(range(rank * 4, rank * 4 + 4)))
        values = critic.compute_values(half).batch["values"]
        metrics = critic.train_step(half, CriticObjective())
        torch.save({"values": values, "metrics": metrics}, os.path.join(folder, f"critic-{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def split_heads_model_dir(tmp_path_factory):
    """4 query and 2 key/value heads: each rank of 2 gets whole key/value heads without repeating them."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_4_heads")
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    build_tiny_causal_lm(path, vocab_size=len(AutoTokenizer.from_pretrained(str(path))), num_attention_heads=4,
                         num_key_value_heads=2, seed=3)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    """Qwen3-MoE whose config asks for a router loss coefficient of 0.5 (the default when the key is unset)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_moe")
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    build_tiny_moe_lm(path, vocab_size=len(AutoTokenizer.from_pretrained(str(path))), router_aux_loss_coef=0.5)
    return path


def test_ulysses_on_two_ranks_equals_one_rank(tiny_model_dir, split_heads_model_dir, moe_model_dir, tmp_path):
    import torch.multiprocessing as mp

    from rl_engines.worker_group import WorkerBase

    models = [str(tiny_model_dir), str(split_heads_model_dir), str(moe_model_dir)]
    mp.spawn(_on_rank, args=(WorkerBase.free_port(), models, str(tmp_path)), nprocs=2)
    mask = varied_batch().batch["response_mask"]
    for index, model in enumerate(models):
        run(make("fsdp2_train", model), list(range(8)), str(tmp_path), f"single{index}")
        single = torch.load(tmp_path / f"single{index}.pt")
        ranks = [torch.load(tmp_path / f"ulysses{index}-{rank}.pt") for rank in (0, 1)]
        for key in ("log_probs", "entropy"):
            got = torch.cat([r["first"][key] for r in ranks])
            torch.testing.assert_close(got[mask], single["first"][key][mask], atol=1e-6, rtol=0)
        got = torch.cat([r["after"] for r in ranks])
        torch.testing.assert_close(got[mask], single["after"][mask], atol=1e-6, rtol=0)
        # Adam turns a near-zero gradient's rounding into up to lr / adam_epsilon times as much in its weight:
        # measured 1.2e-6 on one weight of 16k on an AVX-512 AMD EPYC; a wrong gradient moves a weight by ~lr
        for name, value in single["weights"].items():
            torch.testing.assert_close(ranks[0]["weights"][name], value, atol=1e-5, rtol=0, msg=name)
            torch.testing.assert_close(ranks[1]["weights"][name], value, atol=1e-5, rtol=0, msg=name)
        expected = json.loads((tmp_path / f"single{index}.json").read_text())
        for rank in (0, 1):
            got_metrics = json.loads((tmp_path / f"ulysses{index}-{rank}.json").read_text())
            # ratio_min / ratio_max: the rank a Ulysses group does not count adds neutral values (a 0 had been the min)
            keys = ["pg_loss", "entropy", "ppo_kl", "grad_norm", "ratio_mean", "ratio_min", "ratio_max"]
            keys += ["load_balancing_loss"] * (index == 2)
            for key in keys:
                name = next(k for k in expected if k.endswith(key))
                assert got_metrics[name] == pytest.approx(expected[name], rel=1e-6, abs=1e-6), (index, name)
    critic = make("fsdp2_train", tiny_model_dir, "critic")
    batch = critic_batch()
    values = critic.compute_values(batch).batch["values"]
    expected = critic.train_step(batch, CriticObjective())
    ranks = [torch.load(tmp_path / f"critic-{rank}.pt") for rank in (0, 1)]
    mask = batch.batch["response_mask"]
    torch.testing.assert_close(torch.cat([r["values"] for r in ranks])[mask], values[mask], atol=1e-6, rtol=0)
    for name in ("value_loss", "grad_norm"):  # (a clip fraction may flip a token at the threshold)
        assert ranks[0]["metrics"][name] == pytest.approx(expected[name], rel=1e-6, abs=1e-6), name


@pytest.mark.parametrize(
    ("size", "world", "heads", "kv_heads", "message"),
    [
        (2, 3, 4, 2, r"actor_train.model_args.ulysses_size=2 must divide the role's 3 ranks"),
        (4, 4, 6, 2, r"actor_train.model_args.ulysses_size=4 must divide the model's num_attention_heads \(6\)"),
        (4, 4, 8, 3, r"actor_train.model_args.ulysses_size=4 and the model's num_key_value_heads \(3\) must divide"),
        (0, 4, 8, 2, r"actor_train.model_args.ulysses_size must be >= 1, got 0"),
    ],
)
def test_bad_ulysses_sizes_name_the_key(size, world, heads, kv_heads, message):
    with pytest.raises(ValueError, match=message):
        check_ulysses(size, world, heads, kv_heads, "actor_train.model_args")
    check_ulysses(2, 4, 4, 1, "actor_train.model_args")  # fewer key/value heads than ranks: repeated


def test_a_size_the_model_heads_do_not_allow_fails_before_the_model_loads(tiny_model_dir):
    """The tiny model has 2 attention heads: 4 ranks of Ulysses cannot split them (read from config.json)."""
    config = worker_config(tiny_model_dir, device_mapping=[0, 1, 2, 3], model_args={"ulysses_size": 4})
    with pytest.raises(ValueError, match=r"actor_train.model_args.ulysses_size=4 must divide the model's "
                                         r"num_attention_heads \(2\)"):  # fmt: skip
        create_strategy(config, "actor_train")


@pytest.mark.parametrize("name", ["hf_infer", "deepspeed_train", "megatron_train", "megatron_infer", "vllm"])
def test_strategies_without_ulysses_refuse_the_key(tiny_model_dir, name):
    role = "actor_train" if name.endswith("_train") else "actor_infer" if name == "vllm" else "reference"
    config = worker_config(tiny_model_dir, role, strategy_args={"strategy_name": name}, **ULYSSES)
    with pytest.raises(ValueError, match=rf"{role}.model_args.ulysses_size=2: {name} has no Ulysses"):
        create_strategy(config, role)


def test_the_row_mask_keeps_attention_causal_within_each_sample_and_its_sliding_window():
    """sdpa reads a sliding-window layer's window from its mask only: the row's mask carries it per window."""
    from rl_engines.strategies.ulysses import _Row

    segments = torch.tensor([[0, 0, 0, 0, 1, 1, -1, -1]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1]])
    row = _Row(None, positions, "sdpa", None, segments)
    full, window = row.mask(None)[0, 0], row.mask(2)[0, 0]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for start, end in ((0, 4), (4, 6), (6, 8)):
        expected[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    torch.testing.assert_close(full, expected)
    assert window[3].tolist() == [False, False, True, True, False, False, False, False]  # keys 2 and 3 only
    torch.testing.assert_close(window, expected & ~torch.ones(8, 8, dtype=torch.bool).tril(-2))
    assert row.mask(2) is row.mask(2)  # built once per row and window

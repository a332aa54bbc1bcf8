"""Sequence packing (rl_engines/strategies/packing.py): one row of real tokens per micro-batch, attention kept within
each sample, outputs back in the batch layout; ROLL's load-balanced micro-batches (Karmarkar-Karp)."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_fixtures import tiny_model_dir, worker_config
from test_engines_micro_batches import make, varied_batch

from rl_core.batch import RolloutBatch
from rl_core.seqlen_balance import workload
from rl_engines.config import WorkerConfigError
from rl_engines.strategies import create_strategy
from rl_engines.strategies.micro_batches import LoadBalance, plan_load_balance
from rl_engines.strategies.packing import balanced_partitions, pack

__all__ = ["tiny_model_dir"]


def test_a_packed_row_holds_each_samples_real_tokens_with_restarting_positions():
    batch = varied_batch(size=5)
    mask = batch.batch["attention_mask"].bool()
    real = [batch.batch["input_ids"][row][mask[row]] for row in range(5)]
    lengths = [len(tokens) for tokens in real]
    round_to = 16 if sum(lengths) % 16 else 15  # some fill
    packed = pack(batch, round_to=round_to)
    assert packed.tokens % round_to == 0 and 0 < packed.tokens - sum(lengths) < round_to
    torch.testing.assert_close(packed.input_ids[0, : sum(lengths)], torch.cat(real))
    expected_positions = torch.cat([torch.arange(length) for length in lengths])
    torch.testing.assert_close(packed.position_ids[0, : sum(lengths)], expected_positions)
    assert packed.segments[0, sum(lengths) :].eq(-1).all() and packed.position_ids[0, sum(lengths)] == 0
    # every response token is predicted from the packed position just before it, within its own sample
    responses = batch.batch["responses"]
    torch.testing.assert_close(packed.targets, responses[packed.samples, packed.columns])
    torch.testing.assert_close(packed.input_ids[0, packed.rows + 1], packed.targets)
    assert packed.segments[0, packed.rows].eq(packed.samples).all()
    assert len(packed.targets) == int(batch.batch["response_mask"].sum())


def test_a_row_per_sample_starts_each_sample_at_column_0_and_pads_after_it():
    batch = varied_batch(size=5, seed=2)
    mask = batch.batch["attention_mask"].bool()
    lengths = mask.sum(dim=1).tolist()
    packed = pack(batch, round_to=8, per_sample=True)
    width = min(-(-max(lengths) // 8) * 8, mask.shape[1])
    assert packed.input_ids.shape == packed.position_ids.shape == (5, width)
    for row, length in enumerate(lengths):
        torch.testing.assert_close(packed.input_ids[row, :length], batch.batch["input_ids"][row][mask[row]])
        assert packed.input_ids[row, length:].eq(0).all() and packed.segments[row, length:].eq(-1).all()
        assert packed.segments[row, :length].eq(row).all()
    torch.testing.assert_close(packed.position_ids, torch.arange(width).expand(5, width))  # no restart: no mask
    torch.testing.assert_close(packed.targets, batch.batch["responses"][packed.samples, packed.columns])
    torch.testing.assert_close(packed.input_ids.flatten()[packed.rows + 1], packed.targets)
    assert packed.segments.flatten()[packed.rows].eq(packed.samples).all()


def test_scatter_puts_values_back_in_the_batch_layout_with_zeros_past_each_response():
    batch = varied_batch(size=4)
    packed = pack(batch)
    out = packed.scatter(packed.targets.float())
    mask = batch.batch["response_mask"]
    torch.testing.assert_close(out[mask], batch.batch["responses"][mask].float())
    assert out[~mask].eq(0).all()


def test_packing_refuses_a_sample_without_prompt_tokens_or_offset_positions():
    batch = varied_batch(size=2)
    no_prompt = batch.batch["attention_mask"].clone()
    no_prompt[0, :12] = 0
    with pytest.raises(ValueError, match="at least one prompt token per sample"):
        pack(RolloutBatch({**batch.batch, "attention_mask": no_prompt}))
    shifted = (batch.batch["attention_mask"].cumsum(1) - 1).clamp(min=0) + 5
    with pytest.raises(ValueError, match="position ids that start at 0"):
        pack(RolloutBatch({**batch.batch, "position_ids": shifted}))


def test_attention_never_crosses_a_sample_boundary(tiny_model_dir):
    """A packed row's log-probs equal each sample run alone (so they cannot depend on their neighbours)."""
    from transformers import AutoModelForCausalLM

    from rl_engines.strategies.packing import needs_padding_mask, packed_outputs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = varied_batch(size=3, seed=4)
    with torch.no_grad():
        together = packed_outputs(model, batch, torch.device("cpu"), value_head=False, temperature=1.0,
                                  with_entropy=False)["log_probs"]  # fmt: skip
        alone = [packed_outputs(model, batch.index([row]), torch.device("cpu"), value_head=False, temperature=1.0,
                                with_entropy=False)["log_probs"] for row in range(3)]  # fmt: skip
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-6, rtol=0)
    assert not needs_padding_mask(model)  # dense, sdpa: a row per sample runs without a mask
    with torch.no_grad():  # a row per sample, the padding after each sample's tokens
        rows = packed_outputs(model, batch, torch.device("cpu"), value_head=False, temperature=1.0,
                              with_entropy=False, round_to=8, per_sample=True)["log_probs"]  # fmt: skip
    torch.testing.assert_close(rows, torch.cat(alone), atol=1e-6, rtol=0)
    model.config._attn_implementation = "flash_attention_2"  # flash-attention skips the padding it is shown
    assert needs_padding_mask(model)


# ---- load-balanced micro-batches ---------------------------------------------------------------------------------
def spread(weights, parts):
    sums = [sum(weights[i] for i in part) for part in parts]
    return max(sums) - min(sums)


def test_karmarkar_karp_cuts_every_sample_once_into_balanced_non_empty_groups():
    weights = [8, 7, 6, 5, 4]
    parts = balanced_partitions(weights, 2)
    assert sorted(i for part in parts for i in part) == list(range(5))
    assert sorted(sum(weights[i] for i in part) for part in parts) == [14, 16]  # differencing: 8-7, 6-5, 4-1-1
    rng = torch.Generator().manual_seed(0)
    for size, count in ((9, 3), (12, 4), (6, 6)):
        weights = torch.randint(1, 100, (size,), generator=rng).tolist()
        parts = balanced_partitions(weights, count)
        assert len(parts) == count and all(parts) and sorted(i for part in parts for i in part) == list(range(size))
        # never worse than cutting the samples in order into equal runs
        chunks = [list(range(size))[i::count] for i in range(count)]
        best = min(spread(weights, [[order[i] for i in c] for c in chunks])
                   for order in itertools.islice(itertools.permutations(range(size)), 200))  # fmt: skip
        assert spread(weights, parts) <= max(best, max(weights))
    with pytest.raises(ValueError, match="cannot cut 2 samples into 3"):
        balanced_partitions([1, 2], 3)


def test_load_balance_needs_as_many_micro_batches_as_the_tokens_and_orders_them_as_roll():
    lengths = [10, 20, 30, 40, 50, 60, 70, 80]  # rounded to 16: 16, 32, 32, 48, 64, 64, 80, 80 = 416 tokens
    plan = LoadBalance(max_tokens=128, min_count=1, key="k", min_key="m")
    parts = plan_load_balance(lengths, plan, None, agree=False)
    assert len(parts) == 4 and sorted(i for part in parts for i in part) == list(range(8))  # ceil(416 / 128)
    work = [sum(workload(-(-lengths[i] // 16) * 16) for i in part) for part in parts]
    assert work[0] <= work[1] and work[-1] <= work[-2]  # light micro-batches at both ends
    assert len(plan_load_balance(lengths, LoadBalance(128, 6, "k", "m"), None, agree=False)) == 6
    assert len(plan_load_balance(lengths, LoadBalance(10_000, 1, "k", "m"), None, agree=False)) == 1
    key = "actor_train.sequence_packing_args.max_packed_sequence_length_train"
    with pytest.raises(ValueError, match=rf"{key}=64 is shorter than a sample of 80 tokens"):
        plan_load_balance(lengths, LoadBalance(64, 1, key, "m"), None, agree=False)
    assert len(plan_load_balance(lengths, LoadBalance(128, 8, "k", "m"), None, agree=False)) == 8  # one per sample
    min_key = "actor_train.sequence_packing_args.min_num_micro_batches_train"
    with pytest.raises(ValueError, match=rf"{min_key}=9 asks for more micro-batches than the 8 samples .* at most 8"):
        plan_load_balance(lengths, LoadBalance(128, 9, "k", min_key), None, agree=False)  # ROLL asserts; not capped


# ---- config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sequence_packing_args": {"algorithm": "greedy"}},
         r"actor_train.sequence_packing_args.algorithm='greedy'; use one of \['none', 'load_balance'\]"),
        ({"sequence_packing_args": {"min_num_micro_batches_train": 0}},
         r"actor_train.sequence_packing_args.min_num_micro_batches_train must be >= 1"),
        ({"sequence_packing_args": {"max_packed_sequence_length_forward": 0}},
         r"actor_train.sequence_packing_args.max_packed_sequence_length_forward must be >= 1"),
    ],
)  # fmt: skip
def test_bad_packing_keys_name_the_key(tiny_model_dir, values, message):
    with pytest.raises(WorkerConfigError, match=message):
        worker_config(tiny_model_dir, use_sequence_packing=True, **values)


def test_load_balance_without_its_length_is_refused_before_the_model_loads(tiny_model_dir):
    config = worker_config(tiny_model_dir, use_sequence_packing=True,
                           sequence_packing_args={"algorithm": "load_balance"})  # fmt: skip
    with pytest.raises(ValueError, match=r"actor_train.sequence_packing_args.max_packed_sequence_length_train is "
                                         r"not set"):  # fmt: skip
        create_strategy(config, "actor_train")


@pytest.mark.parametrize("key", ["use_sequence_packing", "use_remove_padding"])
def test_generation_engines_refuse_packing(tiny_model_dir, key):
    for name in ("vllm", "sglang"):
        config = worker_config(tiny_model_dir, "actor_infer", strategy_args={"strategy_name": name}, **{key: True})
        with pytest.raises(ValueError, match=rf"actor_infer.{key} is set, but {name} schedules its own batches"):
            create_strategy(config, "actor_infer")


def test_a_packed_critic_gives_the_padded_values(tiny_model_dir):
    batch = varied_batch(seed=3)
    mask = batch.batch["response_mask"]
    padded = make("fsdp2_train", tiny_model_dir, "critic")
    packed = make("fsdp2_train", tiny_model_dir, "critic", use_remove_padding=True)
    expected, got = padded.compute_values(batch).batch["values"], packed.compute_values(batch).batch["values"]
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-6, rtol=0)

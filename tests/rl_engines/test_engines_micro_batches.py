"""Micro-batch planning (rl_engines/strategies/micro_batches.py): ROLL's dynamic batching by a token budget, and
sequence packing (``use_sequence_packing`` / ``use_remove_padding``) in every strategy that runs the model itself.

What it promises: every dynamic pass holds at most the budget (samples x longest, rounded) and runs without the
padding columns; every packed pass is one row of exactly its samples' real tokens; both give the log-probs and the
update of the fixed, padded micro-batches (fp32, in-process).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from engine_fixtures import require_engine, tiny_model_dir, worker_config

from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfigError
from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy
from rl_engines.strategies.micro_batches import MicroBatchPlanner, TokenBudget, plan_token_budget, split_to_count
from rl_engines.strategies.model_io import without_padding_columns
from rl_engines.strategies.packing import PackedBatch

__all__ = ["tiny_model_dir"]

BUDGET, ROUND = 64, 4
DYNAMIC = {"use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": BUDGET,
           "sequence_length_round_in_train": ROUND, "use_dynamic_batching_in_infer": True,
           "max_tokens_per_microbatch_in_infer": BUDGET, "sequence_length_round_in_infer": ROUND}  # fmt: skip
PACKED = {"use_sequence_packing": True,
          "sequence_packing_args": {"algorithm": "load_balance", "max_packed_sequence_length_train": BUDGET,
                                    "max_packed_sequence_length_forward": BUDGET}}  # fmt: skip
LAYOUTS = {"dynamic_batching": DYNAMIC, "sequence_packing": PACKED, "remove_padding": {"use_remove_padding": True},
           "dynamic_batching_packed": {**DYNAMIC, "use_sequence_packing": True}}  # fmt: skip


def varied_batch(size: int = 8, prompt_len: int = 12, resp_len: int = 20, seed: int = 0) -> RolloutBatch:
    """Prompts of 2-12 tokens (left-padded) and responses of 1-20 (right-padded): most columns of most rows are
    padding, as in RL where a few responses run to the limit."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    prompts = torch.randint(3, 250, (size, prompt_len), generator=gen)
    responses = torch.randint(3, 250, (size, resp_len), generator=gen)
    attention = torch.zeros(size, prompt_len + resp_len, dtype=torch.long)
    response_mask = torch.zeros(size, resp_len, dtype=torch.bool)
    for row in range(size):
        prompt, response = rng.randint(2, prompt_len), rng.choice([1, 2, 3, 5, 8, resp_len])
        attention[row, prompt_len - prompt : prompt_len + response] = 1
        response_mask[row, :response] = True
    return RolloutBatch({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention, "response_mask": response_mask,
        "advantages": torch.randn(size, resp_len, generator=gen),
    })  # fmt: skip


# ---- planning ---------------------------------------------------------------------------------------------------
def test_samples_are_grouped_by_length_within_the_budget():
    budget = TokenBudget(max_tokens=24, round_to=4, key="actor_train.max_tokens_per_microbatch_in_train")
    # sorted: 3 (4), 5 (8), 7 (8) fit 3 x 8 = 24; 10 (12) starts a new one; 12 (12) joins: 2 x 12 = 24
    assert plan_token_budget([(0, 10), (0, 3), (0, 7), (0, 12), (0, 5)], budget) == [[1, 4, 2], [0, 3]]
    # a long prompt with a short response and a short prompt with a long one: a row per sample (ROLL's layout) is 6
    # wide for both, 3 x 8 = 24 together; with prompts left-padded and responses right-padded (trimmed) 6 + 6 = 12
    assert plan_token_budget([(5, 1), (1, 5), (1, 1)], budget) == [[2, 0, 1]]
    assert plan_token_budget([(5, 1), (1, 5), (1, 1)], budget, aligned=False) == [[2, 0], [1]]


def test_every_plan_covers_each_sample_once_and_respects_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        spans = [(rng.randint(1, 20), rng.randint(0, 20)) for _ in range(rng.randint(1, 30))]
        lengths = [p + r for p, r in spans]
        budget = TokenBudget(max_tokens=rng.choice([40, 64, 128]), round_to=rng.choice([1, 4, 8]), key="k")
        aligned = rng.random() < 0.5
        groups = plan_token_budget(spans, budget, aligned=aligned)
        assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
        for group in groups:
            if aligned:
                width = max(lengths[i] for i in group)
            else:
                width = max(spans[i][0] for i in group) + max(spans[i][1] for i in group)
            assert len(group) * budget.rounded(width) <= budget.max_tokens
        count = rng.randint(len(groups), len(lengths))
        more = split_to_count(groups, count)
        assert len(more) == count and sorted(i for group in more for i in group) == list(range(len(lengths)))


def test_a_sample_longer_than_the_budget_names_the_key_and_the_fix():
    budget = TokenBudget(max_tokens=16, round_to=4, key="actor_train.max_tokens_per_microbatch_in_train")
    with pytest.raises(ValueError, match=r"actor_train.max_tokens_per_microbatch_in_train=16 is smaller than one "
                                         r"sample: 17 tokens, 20 rounded .* Raise it to at least"):  # fmt: skip
        plan_token_budget([(1, 2), (9, 8)], budget)


def test_padding_columns_are_removed_and_the_width_rounded():
    batch = varied_batch(size=3, seed=1)
    mask = batch.batch["attention_mask"].bool()
    trimmed = without_padding_columns(batch)
    used = mask.any(dim=0).nonzero().flatten()
    assert trimmed.batch["input_ids"].shape[1] == int(used[-1] - used[0] + 1)
    assert trimmed.batch["attention_mask"].sum() == mask.sum()  # no real token dropped
    rounded = without_padding_columns(batch, round_to=8)
    assert rounded.batch["input_ids"].shape[1] % 8 == 0 and rounded.batch["attention_mask"].sum() == mask.sum()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"use_dynamic_batching_in_train": True}, r"actor_train.use_dynamic_batching_in_train is true but "
                                                  r"actor_train.max_tokens_per_microbatch_in_train is 0"),
        ({"use_dynamic_batching_in_infer": True, "max_tokens_per_microbatch_in_infer": 2},
         r"actor_train.max_tokens_per_microbatch_in_infer=2 is smaller than "
         r"actor_train.sequence_length_round_in_infer=4: no sample fits a pass"),
        ({"sequence_length_round_in_train": 0}, r"actor_train.sequence_length_round_in_train must be >= 1"),
    ],
)  # fmt: skip
def test_bad_dynamic_batching_keys_name_the_key(tiny_model_dir, values, message):
    with pytest.raises(WorkerConfigError, match=message):
        worker_config(tiny_model_dir, **values)


def test_strategies_that_cannot_honour_the_keys_refuse_them(tiny_model_dir):
    """vLLM / SGLang schedule their own batches: a log-prob budget or packing is refused, naming the key."""
    for name in ("vllm", "sglang"):
        config = worker_config(tiny_model_dir, "actor_infer", strategy_args={"strategy_name": name}, **DYNAMIC)
        with pytest.raises(ValueError, match=rf"actor_infer.use_dynamic_batching_in_infer is set, but {name} sched"):
            create_strategy(config, "actor_infer")
        config = worker_config(tiny_model_dir, "actor_infer", strategy_args={"strategy_name": name}, **PACKED)
        with pytest.raises(ValueError, match=rf"actor_infer.use_sequence_packing is set, but {name} schedules"):
            create_strategy(config, "actor_infer")


def test_a_training_budget_on_an_inference_role_is_noted_and_changes_no_pass(tiny_model_dir, caplog):
    """ROLL's own files set use_dynamic_batching_in_train on an inference reference (agentic_deepeyes), where
    ROLL ignores it: accepted with a warning; the passes stay the fixed ones and the log-probs the padded ones."""
    train_only = {key: value for key, value in DYNAMIC.items() if key.endswith("_train")}
    batch = varied_batch(seed=3)
    expected = make("hf_infer", tiny_model_dir, "reference").compute_log_probs(batch).batch["log_probs"]
    with caplog.at_level(logging.WARNING, logger="rl_engines.strategies.micro_batches"):
        strategy = make("hf_infer", tiny_model_dir, "reference", **train_only)
    assert ("reference.use_dynamic_batching_in_train has no effect: reference does not train (hf_infer)"
            in caplog.text)  # fmt: skip
    seen = passes(strategy, "hf_infer")
    torch.testing.assert_close(strategy.compute_log_probs(batch).batch["log_probs"], expected, atol=0, rtol=0)
    width = batch.batch["input_ids"].shape[1]
    assert seen == [(4, width), (4, width)]  # infer_batch_size samples per pass, every pass as wide as the batch


# ---- the strategies ---------------------------------------------------------------------------------------------
MODULE = {"fsdp2_train": lambda s: s.model, "deepspeed_train": lambda s: s.engine, "hf_infer": lambda s: s.model,
          "megatron_train": lambda s: s.model.module, "megatron_infer": lambda s: s.megatron.module}  # fmt: skip


def passes(strategy: object, name: str) -> list[tuple[int, int]]:
    """``(samples, width)`` of every forward pass of the strategy's model from now on (its token embedding's)."""
    seen: list[tuple[int, int]] = []
    module = MODULE[name](strategy)
    embedding = next(m for n, m in module.named_modules() if n.endswith(("embed_tokens", "word_embeddings")))
    embedding.register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape)))
    return seen


def make(name, model_dir, role="actor_train", **sections):
    training = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                "adam_epsilon": 1e-4}  # fmt: skip
    config = worker_config(model_dir, role, training_args=training, infer_batch_size=4,
                           strategy_args={"strategy_name": name}, **sections)  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


def real_tokens(batch: RolloutBatch) -> int:
    return int(batch.batch["attention_mask"].sum())


def check_passes(seen: list[tuple[int, int]], layout: str, batch: RolloutBatch) -> None:
    """Dynamic passes: within the budget, rounded, and well under the padded batch; packed passes: single rows that
    hold exactly the batch's real tokens (no padding at all)."""
    if layout in ("dynamic_batching",):
        assert all(samples * width <= BUDGET and width % ROUND == 0 for samples, width in seen), seen
        assert sum(samples * width for samples, width in seen) < 0.6 * batch.batch["input_ids"].numel()
    else:
        assert all(samples == 1 for samples, _ in seen), seen
        assert sum(width for _, width in seen) == real_tokens(batch), seen


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["fsdp2_train", "deepspeed_train", "megatron_train"])
def test_dynamic_batching_and_packing_give_the_padded_log_probs_and_update(name, layout, tiny_model_dir):
    require_engine(name)
    batch = varied_batch()
    mask = batch.batch["response_mask"]
    padded, other = make(name, tiny_model_dir), make(name, tiny_model_dir, **LAYOUTS[layout])
    seen = passes(other, name)
    expected = padded.compute_log_probs(batch, with_entropy=True)
    got = other.compute_log_probs(batch, with_entropy=True)  # sorted by length inside, returned in batch order
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got.batch[key][mask], expected.batch[key][mask], atol=1e-6, rtol=0)
    check_passes(seen, layout, batch)

    batch.batch["old_log_probs"] = expected.batch["log_probs"]
    objective = ActorObjective(loss_agg_mode="seq-mean-token-mean")
    seen.clear()
    metrics_padded, metrics_other = padded.train_step(batch, objective), other.train_step(batch, objective)
    check_passes(seen, layout, batch)
    for key in ("pg_loss", "total_loss", "grad_norm", "ppo_kl", "entropy"):
        if key in metrics_padded:
            assert metrics_other[key] == pytest.approx(metrics_padded[key], rel=1e-6, abs=1e-6), key
    weights = dict(other.named_weights())
    for weight_name, value in padded.named_weights():
        torch.testing.assert_close(weights[weight_name], value, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["hf_infer", "megatron_infer"])
def test_inference_strategies_score_by_the_token_budget_alike(name, tiny_model_dir):
    require_engine(name)
    batch = varied_batch(seed=2)
    mask = batch.batch["response_mask"]
    infer_only = {key: value for key, value in DYNAMIC.items() if key.endswith("_infer")}
    padded = make(name, tiny_model_dir, "reference")
    expected = padded.compute_log_probs(batch, temperature=0.7).batch["log_probs"]
    for layout, sections in (("dynamic_batching", infer_only), ("sequence_packing", PACKED)):
        other = make(name, tiny_model_dir, "reference", **sections)
        seen = passes(other, name)
        got = other.compute_log_probs(batch, temperature=0.7).batch["log_probs"]
        torch.testing.assert_close(got[mask], expected[mask], atol=1e-6, rtol=0)
        check_passes(seen, layout, batch)


def test_token_counts_are_reported_only_with_a_budget_and_a_packed_pass_runs_its_real_tokens():
    batch = batch_of_lengths([5, 30])  # one pass of width 32 under a 64-token budget: 2 x 32 run, 35 real
    budget = TokenBudget(max_tokens=64, round_to=4, key="k")
    trimmed, packed = MicroBatchPlanner(size=1, budget=budget), MicroBatchPlanner(size=1, budget=budget, packed=True)
    trimmed.split(batch), packed.split(batch)
    assert trimmed.dynamic_batching_metrics("reference/compute_log_probs")[
        "dynamic_batching/reference/compute_log_probs/actual_tokens"] == 64  # fmt: skip
    assert packed.dynamic_batching_metrics("x")["dynamic_batching/x/actual_tokens"] == 35
    assert MicroBatchPlanner(size=1).dynamic_batching_metrics("x") == {}  # ROLL logs them with dynamic batching only


def batch_of_spans(spans: list[tuple[int, int]], prompt_len: int = 12, resp_len: int = 20) -> RolloutBatch:
    """Samples of the given (prompt, response) real lengths: prompts left-padded, responses right-padded."""
    attention = torch.zeros(len(spans), prompt_len + resp_len, dtype=torch.long)
    for row, (prompt, response) in enumerate(spans):
        attention[row, prompt_len - prompt : prompt_len + response] = 1
    ids = torch.randint(3, 250, attention.shape)
    return RolloutBatch({"input_ids": ids, "attention_mask": attention, "responses": ids[:, prompt_len:]})


def test_a_pass_is_as_wide_as_its_longest_sample_as_in_roll():
    """A long prompt with a short response and a short prompt with a long one (14 tokens each) share one pass of
    16 columns, each sample from column 0 (ROLL's layout), where left-padded prompts and right-padded responses
    would need 24 columns, i.e. two passes under a 32-token budget; a batch with a sample that has no prompt token
    cannot be laid out so and is planned and run by that wider rule."""
    budget = TokenBudget(max_tokens=32, round_to=4, key="k")
    planner = MicroBatchPlanner(size=1, budget=budget)
    batch = batch_of_spans([(12, 2), (2, 12)])
    assert planner.layout(batch) == "aligned" and planner.plan(batch) == [[0, 1]]
    assert planner.dynamic_batching_metrics("x")["dynamic_batching/x/actual_tokens"] == 2 * 16
    no_prompt = batch_of_spans([(12, 2), (0, 12)])
    assert planner.layout(no_prompt) == "trimmed" and len(planner.plan(no_prompt)) == 2


def test_actual_tokens_count_what_each_pass_runs():
    """A pass without the prompt-less sample runs a row per sample even where its batch is planned by the wider rule:
    the reported actual_tokens are the passes' own sizes either way."""
    planner = MicroBatchPlanner(size=1, budget=TokenBudget(max_tokens=16, round_to=1, key="k"))
    for spans in ([(1, 2), (0, 5), (4, 1), (3, 0), (6, 3), (2, 5)], [(1, 2), (7, 5), (4, 1), (3, 0), (6, 3)]):
        batch = batch_of_spans(spans)
        runs = planner.runs(planner.split(batch))
        ran = sum(int(run.input_ids.numel() if isinstance(run, PackedBatch) else run.batch["input_ids"].numel())
                  for run in runs)  # fmt: skip
        assert planner.dynamic_batching_metrics("x")["dynamic_batching/x/actual_tokens"] == ran


def test_a_fixed_planner_keeps_the_batch_order_and_sizes():
    batch = varied_batch(size=5)
    planner = MicroBatchPlanner(size=2)
    assert [len(micro) for micro in planner.split(batch)] == [2, 2, 1] and planner.layout(batch) == "padded"
    out = planner.map(batch, lambda micro: {"first": micro.batch["input_ids"][:, :1]})
    torch.testing.assert_close(out.batch["first"], batch.batch["input_ids"][:, :1])


# ---- data-parallel ranks agree on the number of passes -----------------------------------------------------------
def batch_of_lengths(lengths: list[int], width: int = 32) -> RolloutBatch:
    """Samples of the given real lengths (a 4-token prompt, the rest response), right-padded to ``width``."""
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention[row, :length] = 1
    ids = torch.randint(3, 250, (len(lengths), width))
    return RolloutBatch({"input_ids": ids, "attention_mask": attention, "responses": ids[:, 4:],
                         "response_mask": attention[:, 4:].bool()})  # fmt: skip


def _plan_on_rank(rank: int, port: int, lengths: list[list[int]], folder: str) -> None:
    import json
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        planner = MicroBatchPlanner(size=1, budget=TokenBudget(max_tokens=32, round_to=4, key="k"))
        sizes = [len(micro) for micro in planner.split(batch_of_lengths(lengths[rank]))]
        both = planner.dynamic_batching_metrics("actor_train/train_step")
        planner.split(batch_of_lengths(lengths[rank]))
        first = planner.dynamic_batching_metrics("actor_train/train_step", counted=rank == 0)  # rank 1 a copy
        with open(os.path.join(folder, f"{rank}.json"), "w") as file:
            json.dump([sizes, both, first], file)
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_lengths_run_the_same_number_of_passes(tmp_path):
    """FSDP and ZeRO gather parameters inside every pass, so a rank must not run fewer: rank 0's four short
    samples fit one pass of the budget (4 x 8 tokens), rank 1's need three (2 x 16, 1 x 20, 1 x 24); rank 0 splits
    its pass into three as well."""
    import json

    import torch.multiprocessing as mp

    from rl_engines.worker_group import WorkerBase

    lengths = [[5, 6, 7, 8], [12, 14, 20, 24]]
    mp.spawn(_plan_on_rank, args=(WorkerBase.free_port(), lengths, str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [sizes for sizes, _, _ in results] == [[1, 1, 2], [2, 1, 1]]
    # ROLL's dynamic_batching metrics, summed over the ranks (each rank gets the sums). Rank 0 runs widths 8, 8 and
    # 2 x 8 (its passes rounded up to 4, at least the 5 columns its shortest sample spans): 32 tokens; rank 1 runs
    # 2 x 16, 20 and 24: 76. Each holds 4 x 32 = 128 padded tokens.
    prefix = "dynamic_batching/actor_train/train_step"
    both = {f"{prefix}/valid_tokens": 26 + 70, f"{prefix}/actual_tokens_origin": 256, f"{prefix}/actual_tokens": 108,
            f"{prefix}/removed_padding_tokens": 148, f"{prefix}/removed_padding_ratio": 148 / 256}  # fmt: skip
    assert results[0][1] == results[1][1] == both
    first = {f"{prefix}/valid_tokens": 26, f"{prefix}/actual_tokens_origin": 128, f"{prefix}/actual_tokens": 32,
             f"{prefix}/removed_padding_tokens": 96, f"{prefix}/removed_padding_ratio": 0.75}  # fmt: skip
    assert results[0][2] == results[1][2] == first  # counts start again after each report; copies count 0

"""The alignment matrix of issue 6: dump RLVR rollouts once, replay the same rollouts through every other training
variant, compare the per-step training metrics with the reference's.

fsdp2_train on 2 data-parallel ranks is the reference (the dumping run). fsdp2_train on 1 rank with twice the
gradient accumulation trains on the same global batches, and with ROLL's dynamic batching (token-budget passes
without padding) and sequence packing (load-balanced packed rows) on the same mini-batches (Ulysses sequence
parallelism on 2 ranks against 1 rank: tests/rl_engines/test_engines_ulysses.py, weights within 1e-6);
deepspeed_train ZeRO-3 (2 ranks), megatron_train TP=2 (1 data-parallel rank) and PP=2 (2 pipeline stages, 1
data-parallel rank) train on the same samples in the same mini-batches, in fp32 on CPU. Their per-step pg_loss,
total_loss, approx_kl (ppo_kl) and grad_norm must match the reference to within what fp32 reduction order explains.
LoRA (ROLL's lora_* keys) on fsdp2_train, deepspeed_train ZeRO-3 and megatron_train TP=2 (adapters sharded like
their base weights), from the same adapter init, must match each other the same way. (Megatron's expert parallelism
against fsdp2 on a MoE model: tests/rl_engines/test_engines_megatron_moe.py.) Megatron's Ray workers get the test
harness's CUDA shims (tests/rl_engines/megatron_shims.py) through the session's start-up hook, never through product
code. One matrix (one dump, one replay per other variant) serves every test of this module.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from rlvr_fixtures import NO_KL, make_setup

from apps.rlvr.alignment import ALIGNED, AlignmentResult, alignment_matrix, parse_variant

# Rewards with a learning signal on the random tiny model: REINFORCE on a length penalty, plus an entropy term;
# two PPO epochs of two optimizer steps each, so approx_kl (ppo_kl) is not trivially 0 and the mini-batches must be
# the same sets of samples on one and on two ranks (the pipeline orders samples mini-batch-major for that). Two
# steps: the second trains from weights and optimizer moments the first one left. Inference runs on one rank (replay
# generates nothing). No KL to the reference, so the reference does not run (ROLL's enable_reference): a KL term is
# rl-core arithmetic on the same log-probs the policy loss uses, and the reference's log-probs under every layout
# are compared with the padded ones in tests/rl_engines/test_engines_micro_batches.py.
BASE = ["max_steps=2", "prompt_length=32", "adv_estimator=reinforce", "entropy_loss_coef=0.05", "ppo_epochs=2",
        "+rewards.math_rule.response_length_penalty_coef=0.01", *NO_KL,
        "actor_infer.device_mapping=[0]",
        "actor_train.training_args.per_device_train_batch_size=1",
        "actor_train.training_args.gradient_accumulation_steps=2"]  # fmt: skip
ONE_DATA_RANK = ["actor_train.training_args.gradient_accumulation_steps=4"]  # the same global batch on 1 DP rank
STRATEGY = "actor_train.strategy_args"
ENGINE_VARIANTS = ("zero3", "megatron_tp2", "megatron_pp2")
"""DeepSpeed's column is ZeRO-3 (parameters partitioned too); ZeRO-1 / ZeRO-2 train the same update and are compared
with fsdp2_train at 1e-6 on one and two ranks in tests/rl_engines/test_engines_deepspeed.py. Megatron at TP = 1 on 2
data-parallel ranks is compared with fsdp2_train (2e-6) and with itself replicated in
tests/rl_engines/test_engines_megatron_dist_opt.py."""
# ROLL's dynamic batching: passes of at most 80 tokens (a sample is 31-37 tokens, rounded to 4: two share one)
# without their padding columns, in training and in actor_train's log-probs.
DYNAMIC_BATCHING = [
    "+actor_train.use_dynamic_batching_in_infer=true",
    "+actor_train.max_tokens_per_microbatch_in_infer=80",
    "+actor_train.use_dynamic_batching_in_train=true",
    "+actor_train.max_tokens_per_microbatch_in_train=80",
]
# ROLL's sequence packing, load_balance: each pass one row of real tokens, as many passes as 96-token rows need
# (lengths rounded to 16), samples spread over them by Karmarkar-Karp; actor_train's log-prob and training passes.
SEQUENCE_PACKING = [
    "+actor_train.use_sequence_packing=true",
    "+actor_train.sequence_packing_args.algorithm=load_balance",
    "+actor_train.sequence_packing_args.max_packed_sequence_length_forward=96",
    "+actor_train.sequence_packing_args.max_packed_sequence_length_train=96",
]
# ROLL's LoRA keys (rank 8 on every linear layer) on the same replayed rollouts: fsdp2 on 2 ranks is the LoRA
# reference, deepspeed ZeRO-3 (parameters partitioned) must train the same adapters from the same init. Measured here
# with fsdp2 on 1 rank and ZeRO-1 too: every LoRA column within 3e-8 of the reference.
LORA = ["+actor_train.model_args.lora_rank=8", "+actor_train.model_args.lora_alpha=16",
        "+actor_train.model_args.lora_target=all-linear", "actor_train.training_args.learning_rate=1e-2"]  # fmt: skip
# fp32 on CPU: fsdp2 on 1 and 2 ranks differ only in the order of the gradient reduction (measured <= 1e-7); the
# engines also in their kernels and Megatron's vocab-parallel softmax (measured <= 1e-6).
FSDP2_TOLERANCE, ENGINE_TOLERANCE = 1e-6, 2e-5


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def variants() -> dict[str, list[str]]:
    """The reference first; the engine adapters' variants only where their engine is installed."""
    deepspeed, megatron = f"{STRATEGY}.strategy_name=deepspeed_train", f"{STRATEGY}.strategy_name=megatron_train"
    found: dict[str, list[str]] = {"fsdp2_dp2": [], "fsdp2_dp1": ["actor_train.device_mapping=[0]", *ONE_DATA_RANK],
                                   "fsdp2_dynamic_batching": DYNAMIC_BATCHING,
                                   "fsdp2_sequence_packing": SEQUENCE_PACKING,
                                   "lora_fsdp2": LORA}  # fmt: skip
    if _installed("deepspeed"):
        found["zero3"] = [deepspeed, f"+{STRATEGY}.strategy_config.zero_stage=3"]
        found["lora_zero3"] = [*LORA, deepspeed, f"+{STRATEGY}.strategy_config.zero_stage=3"]
    if _installed("megatron.core"):
        found["megatron_tp2"] = [megatron, f"+{STRATEGY}.strategy_config.tensor_model_parallel_size=2",
                                 *ONE_DATA_RANK]  # fmt: skip
        found["megatron_pp2"] = [megatron, f"+{STRATEGY}.strategy_config.pipeline_model_parallel_size=2",
                                 *ONE_DATA_RANK]  # fmt: skip
        found["lora_megatron_tp2"] = [*LORA, *found["megatron_tp2"]]
    return found


def _varied_prompts(setup) -> str:
    """Prompts of 4 to 10 characters, 23 to 29 tokens in the template (prompt_length 32 keeps them whole): every
    batch has left padding, which the padding-free passes drop. Returns the override that reads them."""
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "ground_truth": str(a + b)}
            for a in (1, 23, 456, 7890) for b in (2, 34, 567, 8901)]  # fmt: skip
    (setup / "varied.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    return f"actor_train.data_args.file_name={setup / 'varied.jsonl'}"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, ray_session) -> AlignmentResult:
    root = tmp_path_factory.mktemp("alignment")
    setup = make_setup(root / "setup", num_attention_heads=4, num_key_value_heads=2)  # TP=2 splits 2 KV heads
    result = alignment_matrix(setup / "rlvr.yaml", [*BASE, _varied_prompts(setup)], variants(), root / "work")
    print("\n" + result.table())  # the matrix, for the issue notes (pytest -s)
    return result


def _assert_aligned(result: AlignmentResult, variant: str, tolerance: float, against: str | None = None) -> None:
    reference = result.metrics[against or result.reference]
    for key in ALIGNED:
        scale = max(1.0, max(abs(reference[step][key]) for step in reference))
        assert result.max_abs_diff(variant, key, against) <= tolerance * scale, (variant, key)


@pytest.mark.slow
def test_replayed_rollouts_train_alike_on_one_and_two_ranks(matrix):
    reference = matrix.metrics["fsdp2_dp2"]
    assert sorted(reference) == [0, 1]
    assert all(reference[step]["actor/pg_loss"] != 0.0 for step in reference)
    assert any(reference[step]["actor/ppo_kl"] != 0.0 for step in reference)
    # No KL, so the reference did not run (ROLL's enable_reference): ref_log_probs were the old_log_probs, even at
    # step 1, where a running reference (the initial weights) would differ from the trained policy.
    assert reference[1]["critic/kl"] == 0.0
    _assert_aligned(matrix, "fsdp2_dp1", FSDP2_TOLERANCE)
    table = matrix.table().splitlines()
    assert table[0].startswith("| step | metric | fsdp2_dp2 | fsdp2_dp1 | ")
    assert len(table) == 2 + 2 * len(ALIGNED)


@pytest.mark.slow
def test_dynamic_batching_trains_like_the_padded_micro_batches(matrix):
    """Token-budget passes without padding columns (ranks agreeing on their count) give the padded run's update."""
    _assert_aligned(matrix, "fsdp2_dynamic_batching", FSDP2_TOLERANCE)
    for row in matrix.metrics["fsdp2_dynamic_batching"].values():  # ROLL's counts: each sample once, both ranks
        total = 2 * row["global_seqlen/actor_train/mean"]  # the mean of the 2 ranks' real tokens
        assert row["dynamic_batching/actor_train/train_step/valid_tokens"] == total
        assert row["dynamic_batching/actor_train/compute_log_probs/valid_tokens"] == total
        assert total < row["dynamic_batching/actor_train/train_step/actual_tokens"]


@pytest.mark.slow
def test_sequence_packing_trains_like_the_padded_micro_batches(matrix):
    """Packed rows without any padding, load-balanced micro-batches (count agreed over ranks): the padded update."""
    _assert_aligned(matrix, "fsdp2_sequence_packing", FSDP2_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["lora_zero3", "lora_megatron_tp2"])
def test_lora_adapters_train_alike_on_every_engine(matrix, variant):
    """The same adapter init (the seed and each module's name) trained on the same rollouts by fsdp2, by ZeRO-3 and
    by Megatron at TP=2 (column-parallel B and row-parallel A split over the ranks): the LoRA update agrees as the
    full-parameter ones do; and it is a LoRA update (it differs from the full-parameter reference). Measured at
    PP=2 and at 2 data-parallel ranks too: within 4e-7 of fsdp2."""
    lora, full = matrix.metrics["lora_fsdp2"], matrix.metrics[matrix.reference]
    assert all(abs(lora[step]["actor/grad_norm"] - full[step]["actor/grad_norm"]) > 1e-3 for step in full)
    if variant not in matrix.metrics:
        pytest.skip(f"the engine of {variant} is not installed")
    _assert_aligned(matrix, variant, FSDP2_TOLERANCE, against="lora_fsdp2")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_every_training_engine_replays_the_same_rollouts_alike(matrix, variant):
    engine = "deepspeed" if variant.startswith("zero") else "megatron.core"
    if variant not in matrix.metrics:
        pytest.skip(f"{engine} is not installed")
    _assert_aligned(matrix, variant, ENGINE_TOLERANCE)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("ref", ("ref", [])), ("z3=a=1,b.c=2", ("z3", ["a=1", "b.c=2"]))],
)
def test_variant_syntax(text, parsed):
    assert parse_variant(text) == parsed


def test_a_variant_needs_a_name():
    with pytest.raises(ValueError, match="write NAME or NAME=key=value"):
        parse_variant("=a=1")

"""The alignment matrix: dump once, replay the same rollouts through training variants, compare per step.

Here the variants are fsdp2_train on 2 data-parallel ranks (the reference) and on 1 rank with twice the gradient
accumulation: the same global batches, so the same updates up to fp32 reduction order. Engine adapters
(deepspeed_train, megatron_train) join the matrix in tests/rl_engines when their engines are installed.
"""

from __future__ import annotations

import pytest
from rlvr_fixtures import make_setup

from apps.rlvr.alignment import ALIGNED, alignment_matrix, parse_variant

# Rewards with a learning signal on the random tiny model: REINFORCE on a length penalty, plus entropy and KL terms;
# two PPO epochs of two optimizer steps each, so approx_kl (ppo_kl) is not trivially 0 and the mini-batches must be
# the same sets of samples on one and on two ranks (the pipeline orders samples mini-batch-major for that).
BASE = ["max_steps=3", "adv_estimator=reinforce", "entropy_loss_coef=0.05", "ppo_epochs=2",
        "+rewards.math_rule.response_length_penalty_coef=0.01",
        "actor_train.training_args.per_device_train_batch_size=1"]  # fmt: skip
VARIANTS = {
    "fsdp2_dp2": ["actor_train.training_args.gradient_accumulation_steps=2"],
    "fsdp2_dp1": ["actor_train.device_mapping=[0]", "actor_train.training_args.gradient_accumulation_steps=4"],
}


@pytest.mark.usefixtures("ray_session")  # the session's shared Ray (tests/conftest.py)
def test_replayed_rollouts_train_alike_on_one_and_two_ranks(tmp_path):
    root = make_setup(tmp_path / "setup")
    result = alignment_matrix(root / "rlvr.yaml", BASE, VARIANTS, tmp_path / "work")
    reference = result.metrics["fsdp2_dp2"]
    assert sorted(reference) == [0, 1, 2]
    assert all(reference[step]["actor/pg_loss"] != 0.0 for step in reference)
    assert any(reference[step]["actor/ppo_kl"] != 0.0 for step in reference)
    for key in ALIGNED:  # fp32 on CPU, only the order of the gradient reduction differs: measured <= 1e-7
        assert result.max_abs_diff("fsdp2_dp1", key) <= 1e-6 * max(1.0, abs(reference[0][key])), key
    table = result.table()
    assert table.splitlines()[0] == "| step | metric | fsdp2_dp2 | fsdp2_dp1 | |fsdp2_dp1 - ref| |"
    assert len(table.splitlines()) == 2 + 3 * len(ALIGNED)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("ref", ("ref", [])), ("z3=a=1,b.c=2", ("z3", ["a=1", "b.c=2"]))],
)
def test_variant_syntax(text, parsed):
    assert parse_variant(text) == parsed


def test_a_variant_needs_a_name():
    with pytest.raises(ValueError, match="write NAME or NAME=key=value"):
        parse_variant("=a=1")

import pytest

from rl_core.batch import BatchSizeError
from rl_core.batch_size import (
    ParallelLayout,
    deepspeed_global_batch_size,
    gradient_accumulation_for_one_update,
    lr_decay_steps,
    megatron_global_batch_size,
    plan_train_batch,
)


def test_faq_formulas():
    # ROLL FAQ: DeepSpeed global = per_device * GA * world; Megatron divides by tp * pp * cp, not ep.
    assert deepspeed_global_batch_size(1, 32, 16) == 512
    layout = ParallelLayout(world_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert megatron_global_batch_size(1, 32, layout) == 128
    assert megatron_global_batch_size(2, 4, ParallelLayout(8, context_parallel_size=2)) == 32


def test_one_update_per_rollout():
    # config guide: GA = rollout * n * tp * pp * cp / per_device / world
    layout = ParallelLayout(world_size=16, tensor_model_parallel_size=2)
    assert gradient_accumulation_for_one_update(64, 8, 1, layout) == 64 * 8 * 2 // 1 // 16
    with pytest.raises(BatchSizeError, match="not a multiple"):
        gradient_accumulation_for_one_update(3, 1, 1, ParallelLayout(2))


def test_plan_counts_updates():
    plan = plan_train_batch("actor_train", rollout_batch_size=64, num_return_sequences_in_group=8,
                            per_device_train_batch_size=2, gradient_accumulation_steps=16,
                            layout=ParallelLayout(8))  # fmt: skip
    assert (plan.samples_per_step, plan.global_batch_size, plan.optimizer_steps_per_rollout) == (512, 256, 2)
    assert plan.samples_per_dp_rank == 64
    assert lr_decay_steps(100, plan, ppo_epochs=2) == 400


def test_batch_smaller_than_dp_is_the_faq_message():
    with pytest.raises(BatchSizeError, match=r"actor_train: batch_size 32 < chunks 64"):
        plan_train_batch("actor_train", rollout_batch_size=32, num_return_sequences_in_group=1,
                         per_device_train_batch_size=1, gradient_accumulation_steps=1,
                         layout=ParallelLayout(64))  # fmt: skip


def test_lr_decay_steps_zero_is_explained():
    with pytest.raises(BatchSizeError, match=r"lr_decay_steps would be 0.*gradient_accumulation_steps to 1"):
        plan_train_batch("actor_train", rollout_batch_size=8, num_return_sequences_in_group=1,
                         per_device_train_batch_size=1, gradient_accumulation_steps=32,
                         layout=ParallelLayout(8))  # fmt: skip
    plan = plan_train_batch("critic", rollout_batch_size=8, num_return_sequences_in_group=1,
                            per_device_train_batch_size=1, gradient_accumulation_steps=1,
                            layout=ParallelLayout(8))  # fmt: skip
    with pytest.raises(BatchSizeError, match="max_steps"):
        lr_decay_steps(0, plan)


def test_megatron_divisibility_names_role_and_keys():
    with pytest.raises(BatchSizeError, match=r"critic: world_size 6 .* not divisible .* 4"):
        plan_train_batch("critic", rollout_batch_size=8, num_return_sequences_in_group=1,
                         per_device_train_batch_size=1, gradient_accumulation_steps=1,
                         layout=ParallelLayout(6, tensor_model_parallel_size=4))  # fmt: skip
    with pytest.raises(BatchSizeError, match="must be a multiple"):
        plan_train_batch("actor_train", rollout_batch_size=10, num_return_sequences_in_group=1,
                         per_device_train_batch_size=1, gradient_accumulation_steps=4,
                         layout=ParallelLayout(2))  # fmt: skip


def test_non_positive_values_named():
    with pytest.raises(BatchSizeError, match="gradient_accumulation_steps must be >= 1"):
        plan_train_batch("actor_train", rollout_batch_size=8, num_return_sequences_in_group=1,
                         per_device_train_batch_size=1, gradient_accumulation_steps=0,
                         layout=ParallelLayout(1))  # fmt: skip


def test_minibatch_major_order_gives_every_rank_a_slice_of_each_global_minibatch():
    from rl_core.batch_size import minibatch_major_order

    # 8 samples, 2 ranks, 2 mini-batches: global mini-batch 0 = {0,1,2,3}, 1 = {4,5,6,7}
    order = minibatch_major_order(8, shards=2, minibatches=2)
    assert order == [0, 1, 4, 5, 2, 3, 6, 7]
    rank0, rank1 = order[:4], order[4:]
    assert sorted(rank0[:2] + rank1[:2]) == [0, 1, 2, 3] and sorted(rank0[2:] + rank1[2:]) == [4, 5, 6, 7]
    assert minibatch_major_order(6, shards=1, minibatches=3) == list(range(6))  # one rank: unchanged
    assert minibatch_major_order(6, shards=3, minibatches=1) == list(range(6))  # one mini-batch: unchanged
    with pytest.raises(BatchSizeError, match="7 samples do not split into 2 shards x 1 mini-batches"):
        minibatch_major_order(7, shards=2, minibatches=1)

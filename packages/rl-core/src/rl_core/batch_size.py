"""Batch-size arithmetic of ROLL's config guide and FAQ, as checks that run before any worker starts.

DeepSpeed (and the torch-native strategy):  global = per_device_train_batch_size * gradient_accumulation_steps
                                                     * world_size
Megatron:  global = per_device_train_batch_size * gradient_accumulation_steps * world_size / (tp * pp * cp)
           (not divided by expert_model_parallel_size), where world_size = len(device_mapping).
The rollout produces ``rollout_batch_size * num_return_sequences_in_group`` samples per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_core.batch import BatchSizeError


@dataclass(frozen=True)
class ParallelLayout:
    """How a training role's devices are split."""

    world_size: int
    """Devices of the role: len(device_mapping)."""
    tensor_model_parallel_size: int = 1
    """Megatron TP."""
    pipeline_model_parallel_size: int = 1
    """Megatron PP."""
    context_parallel_size: int = 1
    """Megatron CP."""

    @property
    def model_parallel_size(self) -> int:
        """Devices holding one model replica (EP does not count: it splits experts inside data parallelism)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, role: str = "actor_train") -> int:
        """world_size / (tp * pp * cp), checked to divide exactly."""
        for key in ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "context_parallel_size"):  # fmt: skip
            if getattr(self, key) < 1:
                raise BatchSizeError(f"{role}: {key} must be >= 1, got {getattr(self, key)}")
        if self.world_size % self.model_parallel_size:
            raise BatchSizeError(
                f"{role}: world_size {self.world_size} (len(device_mapping)) is not divisible by "
                f"tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size = "
                f"{self.model_parallel_size}; change device_mapping or the parallel sizes"
            )
        return self.world_size // self.model_parallel_size


def deepspeed_global_batch_size(per_device_train_batch_size: int, gradient_accumulation_steps: int,
                                world_size: int) -> int:  # fmt: skip
    """Samples per optimizer step for DeepSpeed / torch-native data parallelism (ROLL FAQ)."""
    return per_device_train_batch_size * gradient_accumulation_steps * world_size


def megatron_global_batch_size(per_device_train_batch_size: int, gradient_accumulation_steps: int,
                               layout: ParallelLayout) -> int:  # fmt: skip
    """Samples per optimizer step for Megatron: divided by TP * PP * CP, not by EP (ROLL FAQ)."""
    return per_device_train_batch_size * gradient_accumulation_steps * layout.data_parallel_size()


def gradient_accumulation_for_one_update(
    rollout_batch_size: int, num_return_sequences_in_group: int, per_device_train_batch_size: int,
    layout: ParallelLayout,
) -> int:  # fmt: skip
    """gradient_accumulation_steps that makes one optimizer step per rollout (config guide's last formula)."""
    samples = rollout_batch_size * num_return_sequences_in_group
    per_pass = per_device_train_batch_size * layout.data_parallel_size()
    if samples % per_pass:
        raise BatchSizeError(
            f"rollout_batch_size * num_return_sequences_in_group = {samples} is not a multiple of "
            f"per_device_train_batch_size * data-parallel size = {per_pass}; no gradient_accumulation_steps "
            "gives exactly one update per rollout"
        )
    return samples // per_pass


@dataclass(frozen=True)
class TrainBatchPlan:
    """What one rollout step turns into on a training role."""

    samples_per_step: int
    """rollout_batch_size * num_return_sequences_in_group."""
    global_batch_size: int
    """Samples per optimizer step."""
    optimizer_steps_per_rollout: int
    """Optimizer steps per rollout and PPO epoch."""
    samples_per_dp_rank: int
    """Samples each data-parallel rank receives per rollout."""


def plan_train_batch(
    role: str,
    *,
    rollout_batch_size: int,
    num_return_sequences_in_group: int,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    layout: ParallelLayout,
) -> TrainBatchPlan:
    """Check a training role's batch settings against the rollout size; explain each failure (ROLL FAQ)."""
    for key, value in (("rollout_batch_size", rollout_batch_size),
                       ("num_return_sequences_in_group", num_return_sequences_in_group),
                       ("per_device_train_batch_size", per_device_train_batch_size),
                       ("gradient_accumulation_steps", gradient_accumulation_steps)):  # fmt: skip
        if value < 1:
            raise BatchSizeError(f"{role}: {key} must be >= 1, got {value}")
    samples = rollout_batch_size * num_return_sequences_in_group
    dp = layout.data_parallel_size(role)
    if samples < dp:
        raise BatchSizeError(
            f"{role}: batch_size {samples} < chunks {dp}: rollout_batch_size * num_return_sequences_in_group "
            f"= {samples} samples cannot be split over {dp} data-parallel ranks; raise rollout_batch_size or "
            "use fewer devices in device_mapping"
        )
    global_bs = per_device_train_batch_size * gradient_accumulation_steps * dp
    if samples < global_bs:
        raise BatchSizeError(
            f"{role}: one optimizer step needs per_device_train_batch_size * gradient_accumulation_steps * "
            f"data-parallel size = {per_device_train_batch_size} * {gradient_accumulation_steps} * {dp} = "
            f"{global_bs} samples but a rollout has only {samples}, so lr_decay_steps would be 0 "
            "(ROLL: 'assert self.lr_decay_steps > 0'); lower gradient_accumulation_steps to "
            f"{max(samples // (per_device_train_batch_size * dp), 1)} or raise rollout_batch_size"
        )
    if samples % global_bs:
        raise BatchSizeError(
            f"{role}: rollout_batch_size * num_return_sequences_in_group = {samples} must be a multiple of "
            f"per_device_train_batch_size * gradient_accumulation_steps * data-parallel size = {global_bs} "
            "(Megatron divides world_size by tp * pp * cp); adjust rollout_batch_size or "
            "gradient_accumulation_steps"
        )
    return TrainBatchPlan(samples, global_bs, samples // global_bs, samples // dp)


def lr_decay_steps(max_steps: int, plan: TrainBatchPlan, ppo_epochs: int = 1) -> int:
    """Optimizer steps over a run (what a scheduler decays over); raises when it would be 0."""
    steps = max_steps * plan.optimizer_steps_per_rollout * ppo_epochs
    if steps <= 0:
        raise BatchSizeError(
            f"lr_decay_steps = max_steps {max_steps} * optimizer steps per rollout "
            f"{plan.optimizer_steps_per_rollout} * ppo_epochs {ppo_epochs} = {steps}; it must be > 0: "
            "set max_steps >= 1 and ppo_epochs >= 1"
        )
    return steps


def minibatch_major_order(samples: int, shards: int, minibatches: int) -> list[int]:
    """Sample order that makes each optimizer step's mini-batch independent of the data-parallel size.

    Ranks receive contiguous shards (``shards`` of them) and cut each into ``minibatches`` contiguous mini-batches;
    without reordering, global mini-batch ``j`` is then a different set of samples for every shard count. Sent in
    this order, rank ``r``'s ``j``-th mini-batch is the ``r``-th slice of the global mini-batch ``j`` =
    samples ``[j * M, (j + 1) * M)`` with ``M = samples / minibatches``, whatever ``shards`` is. Returns the
    permutation ``[samples]`` to index the batch with.
    """
    if samples % (shards * minibatches):
        raise BatchSizeError(
            f"{samples} samples do not split into {shards} shards x {minibatches} mini-batches of equal size"
        )
    per_minibatch, per_slice = samples // minibatches, samples // (minibatches * shards)
    return [
        j * per_minibatch + r * per_slice + i
        for r in range(shards)
        for j in range(minibatches)
        for i in range(per_slice)
    ]

"""The driver balances tokens over data-parallel ranks (ROLL's batch_balance), for log-prob passes and training:
each rank's shard is cut as the dispatch cuts it (contiguous equal chunks) by a group that records what it received,
so the test sees exactly what each rank would compute. Outputs come back in the rollout's order, every optimizer
step keeps its samples, and ROLL's global_seqlen/<role>/* metrics report the ranks' token totals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from apps.common.training import balanced_call, train_role
from rl_core.batch import BatchSizeError, RolloutBatch
from rl_core.batch_size import TrainBatchPlan


class RecordingGroup:
    """A role of ``world_size`` ranks: ``dp_split`` cuts the batch into contiguous chunks (as WorkerGroup does);
    each rank answers with its samples' real-token counts as their log-probs, or with training metrics."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.shards: list[RolloutBatch] = []

    def call(self, method: str, batch: RolloutBatch, *args: Any, dispatch: str, **kwargs: Any) -> Any:
        assert dispatch == "dp_split"
        self.shards = batch.chunk(self.world_size)
        if method == "train_step":
            return [{"actor/pg_loss": 0.5} for _ in self.shards]
        tokens = [shard.batch["attention_mask"].sum(-1, keepdim=True).float().expand(-1, 3) for shard in self.shards]
        return RolloutBatch({"log_probs": torch.cat(tokens)})


def rollout(lengths: list[int], width: int = 64) -> RolloutBatch:
    mask = torch.arange(width).unsqueeze(0) >= width - torch.tensor(lengths).unsqueeze(1)  # left-padded samples
    return RolloutBatch({"attention_mask": mask.long(), "sample": torch.arange(len(lengths)).unsqueeze(1)})


def test_log_prob_outputs_come_back_in_rollout_order_from_balanced_shards():
    lengths = [60, 64, 62, 58] + [2, 3, 2, 4] * 3  # the plain order would send all the long samples to rank 0
    group = RecordingGroup(world_size=4)
    got = balanced_call(group, "compute_log_probs", rollout(lengths), 1.0)
    assert got[:, 0].tolist() == [float(n) for n in lengths]  # each sample's own output, in the rollout's order
    totals = [int(shard.batch["attention_mask"].sum()) for shard in group.shards]
    assert max(totals) - min(totals) <= 4 and len({len(shard) for shard in group.shards}) == 1  # plain: 244 vs 11


def test_training_keeps_each_optimizer_steps_samples_and_reports_rolls_metrics():
    lengths = [64, 63, 62, 61, 2, 3, 4, 5, 60, 59, 58, 57, 6, 7, 8, 9]
    group = RecordingGroup(world_size=2)
    plan = TrainBatchPlan(samples_per_step=16, global_batch_size=8, optimizer_steps_per_rollout=2,
                          samples_per_dp_rank=8)  # fmt: skip
    metrics = train_role({"actor_train": group}, "actor_train", rollout(lengths), objective=None, plan=plan)
    for step in range(2):  # each rank cuts its shard into 2 mini-batches of 4: together, samples [8 step, 8 step + 8)
        sent = {int(i) for shard in group.shards for i in shard.batch["sample"][4 * step : 4 * step + 4, 0]}
        assert sent == set(range(8 * step, 8 * step + 8))
    totals = [int(shard.batch["attention_mask"].sum()) for shard in group.shards]
    plain = [sum(lengths[0:4]) + sum(lengths[8:12]), sum(lengths[4:8]) + sum(lengths[12:16])]  # 484 and 44
    assert metrics == {
        "actor/pg_loss": 0.5,
        "global_seqlen/actor_train/min": 44.0, "global_seqlen/actor_train/max": 484.0,
        "global_seqlen/actor_train/minmax_diff": 440.0,
        "global_seqlen/actor_train/balanced_min": float(min(totals)),
        "global_seqlen/actor_train/balanced_max": float(max(totals)),
        "global_seqlen/actor_train/mean": 264.0,
    }  # fmt: skip
    assert sorted(plain) == [44, 484] and max(totals) - min(totals) <= 8


def test_a_batch_the_ranks_cannot_share_gets_the_dispatchs_own_error():
    with pytest.raises(BatchSizeError, match="chunks"):  # the ROLL FAQ's batch-size fix, not a balancing error
        balanced_call(RecordingGroup(world_size=4), "compute_log_probs", rollout([3, 5]), 1.0)

"""GenerationQueue: what is queued when, with which policy version, and what a checkpoint records."""

from __future__ import annotations

import pytest
import torch

from apps.common.generation_queue import GenerationQueue, PendingRollout, staleness_metrics
from apps.common.sampler_state import SamplerState
from rl_core.batch import RolloutBatch


class Ready:
    """A finished group call: ``get()`` returns a batch of 3 rows whose first 2 are real."""

    def __init__(self, step):
        self.step, self.gets = step, 0

    def get(self):
        self.gets += 1
        return RolloutBatch.from_dict({"responses": torch.full((3, 1), self.step)}, {})


def make_queue(ratio, last_step):
    log = []

    def submit(step, version):
        log.append((step, version))
        return PendingRollout(step, version, 2, Ready(step), SamplerState(epoch=0, position=4 * step))

    return GenerationQueue(submit, ratio, last_step), log


def test_synchronous_queue_generates_each_step_when_it_is_taken():
    queue, log = make_queue(0, last_step=2)
    for step in range(3):
        rollout, waited = queue.take(step)
        assert rollout.batch["responses"][:, 0].tolist() == [step, step] and "time/generate_wait" in waited
        assert rollout.non_tensor_batch["policy_version"].tolist() == [step, step]
    assert log == [(0, 0), (1, 1), (2, 2)]
    assert queue.resume_state() is None


def test_ratio_two_queues_two_steps_ahead_with_the_weights_of_the_current_step():
    queue, log = make_queue(2, last_step=4)
    staleness = []
    for step in range(5):
        rollout, _ = queue.take(step)
        staleness.append(staleness_metrics(rollout, step)["async/staleness/max"])
    assert log == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2)]  # nothing past last_step
    assert staleness == [0, 1, 2, 2, 2]


def test_a_checkpoint_records_the_sampler_before_the_earliest_untrained_step():
    queue, _ = make_queue(1, last_step=5)
    queue.take(0)
    assert queue.resume_state() == SamplerState(epoch=0, position=4)  # step 1 is queued, not trained


def test_drain_waits_for_queued_generation_once_and_keeps_the_result():
    queue, _ = make_queue(1, last_step=5)
    queue.take(0)
    queue.drain()
    pending = queue.pending[0]
    assert pending.future.gets == 1
    rollout, _ = queue.take(1)
    assert pending.future.gets == 1 and rollout.batch["responses"][0, 0] == 1


def test_negative_ratio_is_rejected():
    with pytest.raises(ValueError, match="async_generation_ratio must be >= 0"):
        GenerationQueue(lambda step, version: None, -1, 3)  # type: ignore[arg-type,return-value]

"""Generation ahead of training (ROLL's ``async_generation_ratio``), and the synchronous case as ratio 0.

Step ``k`` takes the rollout of step ``k`` and, before waiting for it, queues generation up to step
``k + ratio``. The inference workers run calls in order, so with actor_infer on devices of its own the
generation of later steps overlaps the log-probs, training and weight sync of step ``k``; the weight sync
of step ``k`` waits behind the generation already queued. A rollout generated while the policy had finished
``v`` training steps carries ``policy_version = v``; trained at step ``k`` its staleness is ``k - v`` (0 for
a synchronous pipeline, at most ``ratio`` otherwise).

Validation pauses it: ``drain()`` waits until every queued generation has finished (results are kept for
their steps), so validation samples with the weights of the step just trained and nothing new is queued
while it runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from apps.common.sampler_state import SamplerState
from rl_core.batch import RolloutBatch


@dataclass
class PendingRollout:
    """One queued generation: its step, the policy version it samples with, how many rows are real."""

    step: int
    version: int
    samples: int | None
    """Real rows (the rest is padding to the inference world size); None: every row is real."""
    future: Any
    """An ``rl_engines.worker_group.GroupFuture`` whose result is the generated RolloutBatch."""
    sampler_before: SamplerState
    """The prompt sampler's position before this step's prompts were drawn (what a checkpoint must record)."""
    batch: RolloutBatch | None = None

    def result(self) -> RolloutBatch:
        """Wait for the batch (once); padding rows are dropped and ``policy_version`` is set on every sample."""
        if self.batch is None:
            rollout: RolloutBatch = self.future.get()
            if self.samples is not None:
                rollout = rollout.slice(0, self.samples)
            rollout.non_tensor_batch["policy_version"] = np.full(len(rollout), self.version, dtype=np.int64)
            self.batch = rollout
        return self.batch


Submit = Callable[[int, int], PendingRollout]
"""``submit(step, version)`` draws step's prompts and queues their generation."""


class GenerationQueue:
    """Keeps generation ``ratio`` steps ahead of training, up to ``last_step``."""

    def __init__(self, submit: Submit, ratio: int, last_step: int) -> None:
        if ratio < 0:
            raise ValueError(f"async_generation_ratio must be >= 0, got {ratio}")
        self.submit, self.ratio, self.last_step = submit, ratio, last_step
        self.pending: deque[PendingRollout] = deque()

    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Queue generation up to ``step + ratio``, then wait for ``step``'s rollout; returns it and the wait."""
        self._fill(step)
        pending = self.pending.popleft()
        if pending.step != step:
            raise RuntimeError(f"generation queue out of order: asked for step {step}, next is {pending.step}")
        start = time.perf_counter()
        rollout = pending.result()
        return rollout, {"time/generate_wait": time.perf_counter() - start}

    def _fill(self, step: int) -> None:
        next_step = self.pending[-1].step + 1 if self.pending else step
        for ahead in range(next_step, min(step + self.ratio, self.last_step) + 1):
            self.pending.append(self.submit(ahead, step))

    def drain(self) -> float:
        """Wait for every queued generation (validation's pause); returns the seconds waited."""
        start = time.perf_counter()
        for pending in self.pending:
            pending.result()
        return time.perf_counter() - start

    def resume_state(self) -> SamplerState | None:
        """The sampler position of the earliest step not yet trained (None when nothing is queued)."""
        return self.pending[0].sampler_before if self.pending else None


def staleness_metrics(rollout: RolloutBatch, step: int) -> dict[str, float]:
    """``async/staleness/{mean,max}``: training steps between the policy that sampled and the one trained."""
    versions = rollout.non_tensor_batch.get("policy_version")
    if versions is None:
        return {}
    staleness = step - np.asarray(versions, dtype=np.float64)
    return {"async/staleness/mean": float(staleness.mean()), "async/staleness/max": float(staleness.max())}

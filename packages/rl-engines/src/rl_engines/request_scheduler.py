"""Generation through a request scheduler (ROLL's ``generate_opt_level: 1``): a batch is cut into chunks of
prompts that go to whichever inference rank has room, at most ``max_running_requests`` prompts in flight.

Ranks that finish early take more chunks, so uneven response lengths do not leave workers idle as a fixed
data-parallel split does (``generate_opt_level: 0``). Sampling stays reproducible: chunk ``i`` samples with seed
``seed + i * 7919`` whichever rank runs it (strategies add their rank to the seed, so the scheduler sends the
seed minus the rank), and results are returned in prompt order. The scheduling loop runs on a thread, so the
returned future can be waited on later (asynchronous generation).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from typing import Any

import ray

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs
from rl_engines.worker_group import GroupFuture, WorkerGroup, WorkerTimeoutError

CHUNK_SEED_STRIDE = 7919


class ScheduledGeneration:
    """Future of one batch generated chunk by chunk over ``group``; ``get()`` returns the whole RolloutBatch."""

    def __init__(
        self,
        group: WorkerGroup,
        batch: RolloutBatch,
        generating_args: GeneratingArgs,
        *,
        chunk_prompts: int,
        max_running_requests: int,
    ) -> None:
        if chunk_prompts < 1 or max_running_requests < 1:
            raise ValueError(
                f"{group.role}: chunk_prompts ({chunk_prompts}) and max_running_requests ({max_running_requests}) "
                "must be >= 1"
            )
        self.group, self.args = group, generating_args
        self.chunks = batch.split(chunk_prompts)
        self.per_rank = max(1, math.ceil(max_running_requests / (group.world_size * chunk_prompts)))
        self.results: list[RolloutBatch | None] = [None] * len(self.chunks)
        self.error: BaseException | None = None
        self.deadline = time.monotonic() + group.rpc_timeout
        self.thread = threading.Thread(target=self._run, name=f"{group.role}-request-scheduler", daemon=True)
        self.thread.start()

    def _args(self, chunk: int, rank: int) -> GeneratingArgs:
        if self.args.seed is None:
            return self.args
        return replace(self.args, seed=self.args.seed + chunk * CHUNK_SEED_STRIDE - rank)

    def _run(self) -> None:
        try:
            self._schedule()
        except BaseException as error:  # handed to the caller of get()
            self.error = error

    def _schedule(self) -> None:
        load = [0] * self.group.world_size
        in_flight: dict[Any, tuple[int, int]] = {}
        pending = list(range(len(self.chunks)))
        while pending or in_flight:
            while pending and min(load) < self.per_rank:
                rank, chunk = load.index(min(load)), pending.pop(0)
                ref = self.group.remote(rank, "generate", self.chunks[chunk], self._args(chunk, rank))
                in_flight[ref], load[rank] = (chunk, rank), load[rank] + 1
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=max(self.deadline - time.monotonic(), 0.0))
            if not ready:
                ranks = sorted({rank for _, rank in in_flight.values()})
                raise WorkerTimeoutError(
                    f"{self.group.role}: generate chunks on rank(s) {ranks} did not finish within rpc_timeout="
                    f"{self.group.rpc_timeout}s (generate_opt_level 1); raise rpc_timeout or check those workers.",
                    self.group.role, "generate", ranks,
                )  # fmt: skip
            for ref in ready:
                chunk, rank = in_flight.pop(ref)
                load[rank] -= 1
                future = GroupFuture([ref], [rank], lambda results: results[0], self.group.role, "generate", 1.0)
                self.results[chunk] = future.get()  # ready: raises WorkerDiedError / WorkerCallError at once

    def done(self) -> bool:
        """True when every chunk has answered (or the scheduling failed); never blocks."""
        return not self.thread.is_alive()

    def get(self) -> RolloutBatch:
        """Wait for every chunk; the samples in prompt order, or the first worker error."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return RolloutBatch.concat([result for result in self.results if result is not None])

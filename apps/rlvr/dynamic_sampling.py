"""Dynamic sampling (ROLL's query filter): drop prompt groups a reward's ``query_filter_config`` rejects and draw
more prompts until ``rollout_batch_size`` groups pass.

``rewards.<name>.query_filter_config`` is ``{type: no_filter | mean_filter | std_filter, filter_args: {...}}``:
``mean_filter`` drops a group whose mean score is ``<= threshold_down`` (default -1) or ``>= threshold_up``
(default +inf); ``std_filter`` drops a group whose score standard deviation (unbiased, as torch.std) is
``<= std_threshold`` (default -1), e.g. ``0`` drops the all-correct and all-wrong groups (DAPO). A group of one
sample always passes. ``is_use_additional_prompts`` draws ``max_additional_running_prompts`` extra prompts with
every step's batch, so fewer refill rounds are needed; surplus passing groups are dropped (ROLL keeps the first
that finish; here, the first in draw order). Without any filter and without extra prompts this is a no-op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rl_core.batch import RolloutBatch

FILTER_TYPES = ("no_filter", "mean_filter", "std_filter")
FILTER_ARGS = {"no_filter": (), "mean_filter": ("threshold_up", "threshold_down"), "std_filter": ("std_threshold",)}
MAX_ROUNDS = 16
"""Refill rounds per step before giving up with an error (a filter that rejects (almost) everything)."""


@dataclass(frozen=True)
class QueryFilter:
    """One reward section's query filter."""

    type: str = "no_filter"
    filter_args: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, section: dict[str, Any], key: str) -> QueryFilter:
        """Validate ``rewards.<name>.query_filter_config`` (``key``); errors name the key and the valid choices."""
        unknown = sorted(set(section) - {"type", "filter_args"})
        if unknown:
            raise ValueError(f"{key}: unknown keys {unknown}; it takes `type` and `filter_args`.")
        kind = section.get("type", "no_filter")
        if kind not in FILTER_TYPES:
            raise ValueError(f"{key}.type={kind!r} is not supported; use one of {list(FILTER_TYPES)}.")
        args = dict(section.get("filter_args") or {})
        for name, value in args.items():
            if name not in FILTER_ARGS[kind]:
                raise ValueError(f"{key}.filter_args.{name}: {kind} takes {list(FILTER_ARGS[kind]) or 'no arguments'}.")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{key}.filter_args.{name} must be a number, got {value!r}.")
        return cls(kind, {name: float(value) for name, value in args.items()})

    @property
    def active(self) -> bool:
        """False for no_filter."""
        return self.type != "no_filter"

    def keeps(self, scores: torch.Tensor) -> bool:
        """Whether a group with these scores ``[n]`` passes (ROLL's query_filter)."""
        if len(scores) == 1 or self.type == "no_filter":
            return True
        scores = scores.double()
        if self.type == "mean_filter":
            mean = float(scores.mean())
            up, down = self.filter_args.get("threshold_up", math.inf), self.filter_args.get("threshold_down", -1.0)
            return down < mean < up
        return float(scores.std()) > self.filter_args.get("std_threshold", -1.0)


def group_keep(
    rollout: RolloutBatch, filters: dict[str, QueryFilter], section_of: Callable[[int], str]
) -> tuple[list[Any], int]:
    """The prompt uids (first-appearance order) of the groups that pass their reward section's filter, and the
    number of groups in ``rollout``."""
    uids = np.asarray(rollout.non_tensor_batch["prompt_uid"])
    scores = rollout.batch["scores"]
    groups, kept = list(dict.fromkeys(uids.tolist())), []
    for uid in groups:
        rows = np.flatnonzero(uids == uid)
        section = section_of(int(rollout.non_tensor_batch["record_index"][rows[0]]))
        if filters[section].keeps(scores[torch.from_numpy(rows)]):
            kept.append(uid)
    return kept, len(groups)


class DynamicSampler:
    """Fills a step's batch with ``groups`` passing prompt groups, generating more rounds when needed."""

    def __init__(
        self, filters: dict[str, QueryFilter], section_of: Callable[[int], str], groups: int, extra: int
    ) -> None:
        self.filters, self.section_of, self.groups, self.extra = filters, section_of, groups, extra

    @classmethod
    def from_config(cls, config: Any, section_of: Callable[[int], str]) -> DynamicSampler:
        """From the RLVR config: every reward's query_filter_config, rollout_batch_size, the extra prompts."""
        filters = {
            name: QueryFilter.from_config(section.spec.query_filter_config, f"rewards.{name}.query_filter_config")
            for name, section in config.rewards.items()
        }
        extra = config.max_additional_running_prompts if config.is_use_additional_prompts else 0
        return cls(filters, section_of, config.rollout_batch_size, extra)

    @property
    def active(self) -> bool:
        """Whether sampling differs from one plain batch of ``groups`` prompts."""
        return self.extra > 0 or any(f.active for f in self.filters.values())

    def fill(
        self, first: RolloutBatch, generate: Callable[[int], RolloutBatch]
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """Keep the passing groups of ``first`` and of ``generate(prompts)`` rounds until ``groups`` pass."""
        parts, kept, generated, rejected, rounds = [], 0, 0, 0, 1
        batch = first
        while True:
            passing, count = group_keep(batch, self.filters, self.section_of)
            uids = passing[: self.groups - kept]
            generated, rejected = generated + count, rejected + count - len(passing)
            rows = np.flatnonzero(np.isin(np.asarray(batch.non_tensor_batch["prompt_uid"]), uids))
            parts.append(batch.index(rows.tolist()))
            kept += len(uids)
            if kept == self.groups:
                break
            if rounds == MAX_ROUNDS:
                raise RuntimeError(
                    f"dynamic sampling: only {kept} of {self.groups} prompt groups passed the rewards' "
                    f"query_filter_config in {rounds} rounds ({generated} groups generated); loosen the filter "
                    "thresholds or use more varied data."
                )
            batch, rounds = generate(self.groups - kept + self.extra), rounds + 1
        metrics = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/generated_groups": float(generated),
                   "dynamic_sampling/filtered_ratio": rejected / generated}  # fmt: skip
        return RolloutBatch.concat(parts), metrics

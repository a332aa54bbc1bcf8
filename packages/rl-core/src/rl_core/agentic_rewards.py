"""Agentic reward normalisation: ``reward_normalization: {grouping, method}`` of ROLL's agentic pipeline.

Two independent axes, one registry each:

- grouping (which episodes share statistics), as in ROLL / RAGEN's ``_normalize_score_tensor``:
  ``state`` = the env group id (episodes of one env group share env config and seed, i.e. the same start
  state / prompt), ``inductive`` = the env tag (all episodes of one environment type, e.g. "SimpleSokoban"),
  ``batch`` = the whole batch. ROLL's example configs spell them ``traj_group_id`` (= state) and ``tags``
  (= inductive); both spellings are registered.
- method (what is done within a group): ``identity`` (unchanged), ``mean`` (subtract the group mean),
  ``mean_std`` (``(x - mean) / (std + 1e-6)`` with the unbiased std; a group of one or with std <= 1e-6
  becomes 0), ``asym_clip`` (``mean_std`` then clamped to [-1, 3]: failures are penalised at most one std,
  successes rewarded up to three).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl_core.advantages import GroupIndex, encode_groups, group_moments
from rl_core.registry import Registry

# (batch_size, group_ids, tags) -> per-sample group labels, or None for "everything is one group".
Grouping = Callable[[int, GroupIndex | None, GroupIndex | None], GroupIndex | None]
# (scores [B], inverse [B], num_groups) -> normalised scores [B]
NormMethod = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

AGENTIC_GROUPINGS: Registry[Grouping] = Registry("agentic reward grouping", "reward_normalization.grouping")
AGENTIC_NORM_METHODS: Registry[NormMethod] = Registry(
    "agentic reward normalisation method", "reward_normalization.method"
)

# Below this group std, a group counts as constant (ROLL / RAGEN: "stable to bf16").
STD_FLOOR = 1e-6
ASYM_CLIP_LOW = -1.0
ASYM_CLIP_HIGH = 3.0


@AGENTIC_GROUPINGS.register("state", "traj_group_id")
def _group_by_state(batch_size: int, group_ids: GroupIndex | None, tags: GroupIndex | None) -> GroupIndex:
    if group_ids is None:
        raise ValueError(
            "reward_normalization.grouping 'state' needs group_ids: the env group id of each episode; got None"
        )
    return group_ids


@AGENTIC_GROUPINGS.register("inductive", "tags")
def _group_by_tag(batch_size: int, group_ids: GroupIndex | None, tags: GroupIndex | None) -> GroupIndex:
    if tags is None:
        raise ValueError(
            "reward_normalization.grouping 'inductive' needs tags: the env tag (environment type) of each "
            "episode; got None"
        )
    return tags


@AGENTIC_GROUPINGS.register("batch")
def _group_whole_batch(batch_size: int, group_ids: GroupIndex | None, tags: GroupIndex | None) -> None:
    return None


@AGENTIC_NORM_METHODS.register("identity")
def _identity(scores: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return scores


@AGENTIC_NORM_METHODS.register("mean")
def _mean(scores: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    mean, _, _ = group_moments(scores, inverse, num_groups)
    return scores - mean


@AGENTIC_NORM_METHODS.register("mean_std")
def _mean_std(scores: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    mean, std, count = group_moments(scores, inverse, num_groups)
    normalised = (scores - mean) / (std + STD_FLOOR)
    informative = (count > 1) & (std > STD_FLOOR)
    return torch.where(informative, normalised, torch.zeros_like(normalised))


@AGENTIC_NORM_METHODS.register("asym_clip")
def _asym_clip(scores: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return _mean_std(scores, inverse, num_groups).clamp(ASYM_CLIP_LOW, ASYM_CLIP_HIGH)


# What each method subtracts and divides by when ROLL's norm_mean_type / norm_std_type leave it to the method.
METHOD_MOMENTS = {
    "identity": (False, False), "mean": (True, False), "mean_std": (True, True), "asym_clip": (True, True),
}  # fmt: skip
NORM_TYPES = ("batch", "group")
"""``norm_mean_type`` / ``norm_std_type``: the whole batch's moments, or each group's."""


def normalize_agentic_rewards(
    scores: torch.Tensor,
    group_ids: GroupIndex | None,
    grouping: str,
    method: str,
    *,
    tags: GroupIndex | None = None,
    mean_type: str | None = None,
    std_type: str | None = None,
) -> torch.Tensor:
    """Normalise episode scores ``[B]`` within groups chosen by ``grouping`` using ``method``. Returns ``[B]``.

    ``group_ids`` ``[B]``: env group id per episode (needed by ``state``); ``tags`` ``[B]``: env tag per
    episode (needed by ``inductive``). Follows ROLL's agentic ``reward_normalization`` (from RAGEN,
    Wang et al. 2025, arXiv:2504.20073).

    ``mean_type`` / ``std_type`` (ROLL's ``norm_mean_type`` / ``norm_std_type``: ``batch``, ``group`` or None)
    choose separately whose mean is subtracted and whose std divides: ``(x - mean) / (std + 1e-6)``, 0 for a
    sample whose group has one member or whose std is <= 1e-6; without a std, ``x - mean``. A type left None
    comes from ``method`` (the batch's moments with ``grouping: batch``, else the group's; ``asym_clip`` then
    clamps as above).
    """
    if scores.dim() != 1:
        raise ValueError(f"agentic reward normalisation takes scores of shape [batch], got {tuple(scores.shape)}")
    labels = AGENTIC_GROUPINGS.get(grouping)(scores.shape[0], group_ids, tags)
    normalise = AGENTIC_NORM_METHODS.get(method)
    if labels is None:
        inverse, num_groups = torch.zeros(scores.shape[0], dtype=torch.long), 1
    else:
        what = f"reward_normalization.grouping {grouping!r}"
        inverse, num_groups = encode_groups(labels, scores.shape[0], what=what)
    inverse = inverse.to(scores.device)
    if mean_type is None and std_type is None:
        return normalise(scores, inverse, num_groups)
    for key, value in (("norm_mean_type", mean_type), ("norm_std_type", std_type)):
        if value is not None and value not in NORM_TYPES:
            raise ValueError(f"reward_normalization.{key}={value!r}; use batch, group or null")
    scope = "batch" if labels is None else "group"
    subtract, divide = METHOD_MOMENTS[AGENTIC_NORM_METHODS.canonical_name(method)]
    out = _by_types(scores, inverse, num_groups, mean_type or (scope if subtract else None),
                    std_type or (scope if divide else None))  # fmt: skip
    if AGENTIC_NORM_METHODS.canonical_name(method) == "asym_clip":
        out = out.clamp(ASYM_CLIP_LOW, ASYM_CLIP_HIGH)
    return out


def _by_types(
    scores: torch.Tensor, inverse: torch.Tensor, num_groups: int, mean_type: str | None, std_type: str | None
) -> torch.Tensor:
    """ROLL's ``agentic_reward_norm`` with explicit mean / std scopes (see normalize_agentic_rewards)."""
    group_mean, group_std, count = group_moments(scores, inverse, num_groups)
    batch_std = scores.std() if scores.numel() > 1 else torch.zeros((), dtype=scores.dtype, device=scores.device)
    mean = {"batch": scores.mean(), "group": group_mean, None: torch.zeros_like(scores)}[mean_type]
    if std_type is None:
        return scores - mean
    std = group_std if std_type == "group" else batch_std.expand_as(scores)
    informative = (count > 1) & (std.abs() > STD_FLOOR)
    return torch.where(informative, (scores - mean) / (std + STD_FLOOR), torch.zeros_like(scores))

"""Token balancing of a batch over data-parallel ranks (ROLL's ``batch_balance``, verl's ``_balance_batch``).

Ranks of a data-parallel group wait for the slowest at every gradient all-reduce, so a rank that happens to get the
long samples sets the pace. Before a pass the driver reorders the batch so that each rank's contiguous shard holds
about the same work, measured by ROLL's cost model of a sequence of ``L`` real tokens, ``24576 L + L^2``. Shards
keep equal sample counts (Karmarkar-Karp largest differencing with equal-size groups), and inside a shard samples
run light, heavier, heaviest, ..., light (ROLL's order: small micro-batches at both ends shorten pipeline bubbles).

Unlike ROLL, which balances the whole training batch at once (so the samples that share an optimizer step depend on
the data-parallel size), :func:`balanced_minibatch_order` balances each global mini-batch on its own: every
optimizer step sees the same set of samples whatever the number of ranks, as :func:`rl_core.batch_size.
minibatch_major_order` promises, and only which rank computes which sample changes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from rl_core.batch import BatchSizeError
from rl_core.batch_size import minibatch_major_order


def workload(length: int) -> int:
    """ROLL's cost of one sequence of ``length`` real tokens (a 7B transformer's FLOPs up to a constant)."""
    return 24576 * length + length * length


def equal_size_partitions(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``weights`` cut into ``parts`` groups of ``len(weights) / parts`` each with near-equal sums.

    Karmarkar-Karp with equal sizes: the weights, sorted, form states of ``parts`` one-sample groups; the two states
    with the largest spread are merged, heaviest group of one with lightest of the other, until one state is left.
    Each group lists its indices ascending.
    """
    if parts < 1 or len(weights) % parts:
        raise BatchSizeError(f"{len(weights)} samples do not split into {parts} equal groups")
    if not weights:
        return [[] for _ in range(parts)]
    ranked = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    states = [
        sorted(((int(weights[i]), [i]) for i in ranked[start : start + parts]), key=lambda g: -g[0])
        for start in range(0, len(ranked), parts)
    ]
    return largest_differencing(states)


Group = tuple[int, list[int]]
"""A partial group: its weight and its members' indices."""


def largest_differencing(states: list[list[Group]]) -> list[list[int]]:
    """Karmarkar-Karp's merge: ``states`` are partial solutions of as many groups each, heaviest group first; the two
    with the largest spread (heaviest minus lightest) merge, the heaviest group of one with the lightest of the other,
    until one is left. Returns its groups (member indices ascending), heaviest first."""
    heap = [(state[-1][0] - state[0][0], tag, state) for tag, state in enumerate(states)]
    heapq.heapify(heap)
    tag = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second), strict=True)]
        merged.sort(key=lambda g: -g[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tag, merged))
        tag += 1
    return [sorted(members) for _, members in heap[0][2]]


def light_heavy_light(indices: Sequence[int], weights: Sequence[int]) -> list[int]:
    """``indices`` by rising weight, every other one from the front and the rest back from the end (ROLL's order)."""
    ranked = sorted(indices, key=lambda i: (weights[i], i))
    return ranked[::2] + ranked[1::2][::-1]


def balanced_minibatch_order(
    lengths: Sequence[int], shards: int, minibatches: int, prefix: str = "global_seqlen"
) -> tuple[list[int], dict[str, float]]:
    """The batch order that gives each of ``shards`` ranks near-equal work in every one of ``minibatches`` global
    mini-batches (contiguous thirds, quarters, ... of the batch); ``lengths`` are the samples' real token counts.

    Sent in this order, rank ``r``'s ``j``-th mini-batch is the ``r``-th balanced group of global mini-batch ``j``
    (the same samples as :func:`rl_core.batch_size.minibatch_major_order`'s mini-batch ``j``, split by work instead
    of position). Also returns ROLL's ``<prefix>/*`` metrics of the ranks' token totals: ``min`` / ``max`` /
    ``minmax_diff`` as the plain order would have sent them, ``balanced_min`` / ``balanced_max`` as sent now, and
    ``mean``.
    """
    plain = minibatch_major_order(len(lengths), shards, minibatches)  # checks the sizes, names them on failure
    weights = [workload(int(length)) for length in lengths]
    per_minibatch = len(lengths) // minibatches
    ranks: list[list[int]] = [[] for _ in range(shards)]
    for j in range(minibatches):
        members = range(j * per_minibatch, (j + 1) * per_minibatch)
        groups = equal_size_partitions([weights[i] for i in members], shards)
        for rank, group in zip(ranks, groups, strict=True):
            rank += light_heavy_light([members[k] for k in group], weights)
    order = [i for rank in ranks for i in rank]
    return order, _seqlen_metrics(lengths, plain, order, shards, prefix)


def _seqlen_metrics(
    lengths: Sequence[int], plain: list[int], balanced: list[int], shards: int, prefix: str
) -> dict[str, float]:
    """ROLL's ``log_seqlen_unbalance``: the ranks' token totals before and after balancing."""
    per_rank = len(lengths) // shards

    def totals(order: list[int]) -> list[int]:
        return [sum(int(lengths[i]) for i in order[r * per_rank : (r + 1) * per_rank]) for r in range(shards)]

    before, after = totals(plain), totals(balanced)
    return {
        f"{prefix}/min": float(min(before)),
        f"{prefix}/max": float(max(before)),
        f"{prefix}/minmax_diff": float(max(before) - min(before)),
        f"{prefix}/balanced_min": float(min(after)),
        f"{prefix}/balanced_max": float(max(after)),
        f"{prefix}/mean": sum(before) / shards,
    }

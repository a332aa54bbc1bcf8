"""Token balancing over data-parallel ranks (rl_core.seqlen_balance): equal-size Karmarkar-Karp groups, ROLL's
light-heavy-light order, and the mini-batch-aware batch order with ROLL's global_seqlen metrics, by hand and against
an exhaustive search on small cases."""

from __future__ import annotations

import itertools
import random

import pytest

from rl_core.batch import BatchSizeError
from rl_core.batch_size import minibatch_major_order
from rl_core.seqlen_balance import (
    balanced_minibatch_order,
    equal_size_partitions,
    light_heavy_light,
    workload,
)


def spread(weights, groups) -> int:
    sums = [sum(weights[i] for i in group) for group in groups]
    return max(sums) - min(sums)


def test_workload_is_rolls_cost_model():
    assert workload(0) == 0 and workload(1) == 24577 and workload(100) == 24576 * 100 + 100 * 100


def test_equal_size_groups_by_hand():
    groups = equal_size_partitions([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert sorted(len(g) for g in groups) == [4, 4]
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert spread([1, 2, 3, 4, 5, 6, 7, 8], groups) == 0  # 18 and 18
    assert equal_size_partitions([5, 1, 9], 1) == [[0, 1, 2]]
    assert sorted(map(sorted, equal_size_partitions([3, 1], 2))) == [[0], [1]]


@pytest.mark.parametrize("seed", range(20))
def test_equal_size_groups_are_near_optimal_on_small_cases(seed):
    """Every equal split of 8 weights in 2 groups, or 9 in 3, searched exhaustively: Karmarkar-Karp's spread stays
    within the largest weight of the optimum and beats (or ties) the contiguous split a plain order sends."""
    rng = random.Random(seed)
    parts = 2 if seed % 2 else 3
    n = 4 * parts if parts == 2 else 3 * parts
    weights = [workload(rng.randint(1, 400)) for _ in range(n)]
    groups = equal_size_partitions(weights, parts)
    assert all(len(g) == n // parts for g in groups) and sorted(i for g in groups for i in g) == list(range(n))
    best = min(spread(weights, split) for split in _equal_splits(list(range(n)), parts))
    got = spread(weights, groups)
    assert got <= best + max(weights)
    contiguous = [list(range(r * n // parts, (r + 1) * n // parts)) for r in range(parts)]
    assert got <= spread(weights, contiguous)


def _equal_splits(items: list[int], parts: int):
    if parts == 1:
        yield [items]
        return
    size = len(items) // parts
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        group = [first, *others]
        remaining = [i for i in rest if i not in others]
        for split in _equal_splits(remaining, parts - 1):
            yield [group, *split]


def test_no_samples_make_empty_groups():
    assert equal_size_partitions([], 3) == [[], [], []]
    assert balanced_minibatch_order([], 2, 1)[0] == []


def test_equal_size_groups_refuse_uneven_counts():
    with pytest.raises(BatchSizeError, match="7 samples do not split into 2 equal groups"):
        equal_size_partitions([1] * 7, 2)


def test_light_heavy_light_is_rolls_order():
    weights = [60, 10, 50, 20, 40, 30]
    # rising: 1 (10), 3 (20), 5 (30), 4 (40), 2 (50), 0 (60) -> every other from the front, the rest from the end
    assert light_heavy_light(range(6), weights) == [1, 5, 2, 0, 4, 3]


def test_each_optimizer_step_keeps_its_samples_and_ranks_get_equal_work():
    rng = random.Random(0)
    lengths = [rng.choice([10, 20, 400, 900]) for _ in range(32)]
    shards, minibatches = 4, 2
    order, metrics = balanced_minibatch_order(lengths, shards, minibatches, prefix="global_seqlen/actor_train")
    assert sorted(order) == list(range(32))
    per_rank, per_step = 32 // shards, 32 // minibatches
    plain = minibatch_major_order(32, shards, minibatches)
    for j in range(minibatches):  # rank r's j-th mini-batch: a slice of its shard
        sent = {i for r in range(shards) for i in order[r * per_rank + j * 4 : r * per_rank + (j + 1) * 4]}
        assert sent == set(range(j * per_step, (j + 1) * per_step))  # the same samples as the plain order's step j
        assert sent == {i for r in range(shards) for i in plain[r * per_rank + j * 4 : r * per_rank + (j + 1) * 4]}
    totals = [sum(lengths[i] for i in order[r * per_rank : (r + 1) * per_rank]) for r in range(shards)]
    before = [sum(lengths[i] for i in plain[r * per_rank : (r + 1) * per_rank]) for r in range(shards)]
    assert metrics == {
        "global_seqlen/actor_train/min": min(before), "global_seqlen/actor_train/max": max(before),
        "global_seqlen/actor_train/minmax_diff": max(before) - min(before),
        "global_seqlen/actor_train/balanced_min": min(totals), "global_seqlen/actor_train/balanced_max": max(totals),
        "global_seqlen/actor_train/mean": sum(lengths) / shards,
    }  # fmt: skip
    assert max(totals) - min(totals) < (max(before) - min(before)) / 4  # the plain order's spread, cut by 4x or more


def test_one_rank_keeps_each_minibatch_in_light_heavy_light_order():
    lengths = [5, 1, 4, 2, 9, 7, 8, 6]
    order, metrics = balanced_minibatch_order(lengths, 1, 2)
    assert order == [1, 2, 0, 3, 7, 6, 4, 5]  # by length 1 4 | 5 2 and 6 8 | 9 7: every other, then back
    assert metrics["global_seqlen/balanced_max"] == metrics["global_seqlen/max"] == sum(lengths)


def test_sizes_that_do_not_split_are_refused_naming_the_counts():
    with pytest.raises(BatchSizeError, match="10 samples do not split into 4 shards x 1 mini-batches"):
        balanced_minibatch_order([1] * 10, 4, 1)

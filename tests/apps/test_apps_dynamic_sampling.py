"""Dynamic sampling: ROLL's query filters per reward section, refill rounds, and their errors."""

from __future__ import annotations

import pytest
import torch

from apps.rlvr.dynamic_sampling import MAX_ROUNDS, DynamicSampler, QueryFilter
from rl_core.batch import RolloutBatch


def scored(groups, first_uid=0):
    """A scored rollout: ``groups`` is a list of per-group score lists; uid i, record index i."""
    scores, uids, records = [], [], []
    for offset, group in enumerate(groups):
        scores += group
        uids += [f"u{first_uid + offset}"] * len(group)
        records += [first_uid + offset] * len(group)
    return RolloutBatch.from_dict({"scores": torch.tensor(scores)}, {"prompt_uid": uids, "record_index": records})


@pytest.mark.parametrize(
    ("config", "scores", "keeps"),
    [
        ({"type": "no_filter"}, [0.0, 0.0], True),
        ({"type": "std_filter", "filter_args": {"std_threshold": 0}}, [1.0, 1.0, 1.0], False),
        ({"type": "std_filter", "filter_args": {"std_threshold": 0}}, [1.0, 0.0], True),
        ({"type": "std_filter"}, [1.0, 1.0], True),  # default threshold -1 keeps everything
        ({"type": "mean_filter", "filter_args": {"threshold_up": 1.0, "threshold_down": 0.0}}, [1.0, 1.0], False),
        ({"type": "mean_filter", "filter_args": {"threshold_up": 1.0, "threshold_down": 0.0}}, [0.0, 0.0], False),
        ({"type": "mean_filter", "filter_args": {"threshold_up": 1.0, "threshold_down": 0.0}}, [1.0, 0.0], True),
        ({"type": "mean_filter", "filter_args": {"threshold_down": 0.5}}, [0.5, 0.5], False),  # boundary drops
        ({"type": "std_filter", "filter_args": {"std_threshold": 5}}, [0.0], True),  # one sample always passes
    ],
)
def test_query_filters_follow_roll(config, scores, keeps):
    assert QueryFilter.from_config(config, "rewards.math.query_filter_config").keeps(torch.tensor(scores)) is keeps


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"type": "var_filter"}, "rewards.m.query_filter_config.type='var_filter' is not supported"),
        ({"type": "std_filter", "filter_args": {"threshold_up": 1}}, "filter_args.threshold_up: std_filter takes"),
        ({"type": "std_filter", "filter_args": {"std_threshold": "low"}}, "std_threshold must be a number"),
        ({"kind": "std_filter"}, "unknown keys ['kind']"),
    ],
)
def test_bad_filter_configs_name_the_key(config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        QueryFilter.from_config(config, "rewards.m.query_filter_config")


def sampler(groups, extra=0, section="math"):
    filters = {"math": QueryFilter("std_filter", {"std_threshold": 0.0}), "other": QueryFilter()}
    return DynamicSampler(filters, lambda index: section, groups, extra)


def test_fill_keeps_passing_groups_in_order_and_refills_for_the_missing_ones():
    rounds = []

    def generate(prompts):
        rounds.append(prompts)
        return scored([[1.0, 0.0]] * prompts, first_uid=100 * len(rounds))

    first = scored([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])  # groups 0 and 2 have no variance
    batch, metrics = sampler(groups=3, extra=1).fill(first, generate)
    assert rounds == [2]  # 1 missing + 1 extra
    assert batch.non_tensor_batch["prompt_uid"].tolist() == ["u1", "u1", "u3", "u3", "u100", "u100"]
    assert metrics == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/generated_groups": 6.0,
                       "dynamic_sampling/filtered_ratio": 2 / 6}  # fmt: skip


def test_sections_without_a_filter_keep_everything():
    first = scored([[1.0, 1.0], [0.0, 0.0]])
    batch, _ = sampler(groups=2, section="other").fill(first, lambda prompts: pytest.fail("no refill needed"))
    assert len(batch) == 4


def test_a_filter_that_rejects_everything_fails_with_advice():
    with pytest.raises(RuntimeError, match=f"only 0 of 2 prompt groups passed .* in {MAX_ROUNDS} rounds"):
        sampler(groups=2).fill(scored([[1.0, 1.0]]), lambda prompts: scored([[0.0, 0.0]] * prompts))


def test_inactive_without_filters_or_extra_prompts():
    assert not DynamicSampler({"m": QueryFilter()}, lambda index: "m", 4, 0).active
    assert DynamicSampler({"m": QueryFilter()}, lambda index: "m", 4, 2).active

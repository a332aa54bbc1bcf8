"""ROLL's domain_interleave_probs: every batch holds each domain's share of prompts, drawn from its own stream, and a
resumed sampler continues exactly."""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from apps.common.sampler_state import SamplerState
from apps.rlvr.config import RewardConfig, RLVRConfig
from apps.rlvr.data import DataError
from apps.rlvr.domains import DomainSampler, domain_probs, domain_shares
from apps.rlvr.rewards import RewardRouter

DOMAINS = ["math"] * 10 + ["code"] * 4 + ["mc"] * 3 + ["other"] * 5  # "other" has no share: never drawn
PROBS = {"math": 0.5, "code": 0.25, "mc": 0.25}


def config(probs, batch=8):
    rewards = {name: {"worker_cls": "x.ExactMatchRewardWorker", "tag_included": [name]} for name in ("math", "code")}
    rewards["mc"] = {"worker_cls": "x.CrossThinkQARuleRewardWorker", "reward_type": "soft", "tag_included": ["mc"]}
    return RLVRConfig.from_dict({"rollout_batch_size": batch, "rewards": rewards,
                                 "actor_train": {"data_args": {"domain_interleave_probs": probs}}})  # fmt: skip


def test_each_batch_holds_each_domains_share_in_the_configured_order():
    sampler = DomainSampler(PROBS, DOMAINS, seed=3)
    for _ in range(5):  # past every domain's first epoch
        indices, uids = sampler.draw(8)
        assert [DOMAINS[i] for i in indices] == ["math"] * 4 + ["code"] * 2 + ["mc"] * 2
        assert all(uid.startswith(f"{DOMAINS[i]}:") and uid.endswith(f":{i}") for i, uid in zip(indices, uids))
    assert domain_shares(PROBS, 10) == {"math": 5, "code": 2, "mc": 3}  # int(p x n), the last the rest


def test_each_domain_is_its_own_shuffled_stream_covering_it_once_per_epoch():
    sampler = DomainSampler(PROBS, DOMAINS, seed=3)
    drawn = [i for _ in range(2) for i in sampler.draw(8)[0][4:6]]  # code: 2 per batch, 4 records
    assert Counter(drawn) == Counter(range(10, 14))
    assert sampler.state.streams["code"] == [1, 0]  # one epoch of code done
    assert sampler.state.streams["math"] == [0, 8]


def test_a_resumed_sampler_draws_what_the_uninterrupted_one_does():
    straight = DomainSampler(PROBS, DOMAINS, seed=3)
    for _ in range(3):
        straight.draw(8)
    saved = copy.deepcopy(straight.state)
    expected = [straight.draw(8) for _ in range(3)]
    resumed = DomainSampler(PROBS, DOMAINS, seed=3)
    resumed.state = SamplerState(**{"epoch": 0, "position": 0, "streams": saved.streams})
    assert [resumed.draw(8) for _ in range(3)] == expected
    with pytest.raises(DataError, match=r"checkpoint's sampler holds domains \['math'\].*resume with the domains"):
        resumed.state = SamplerState(streams={"math": [0, 0]})


def test_a_record_is_graded_by_the_reward_its_domain_names_as_in_roll():
    """ROLL picks a record's reward by its domain: the domain column, else the section claiming its tag, else
    math_rule. The column had decided only the sampling share (the tag picked the reward), and a tag no section
    claims had failed, though ROLL's own validation set (tags MATH-500 / aime2024, domain math_rule) relies on it."""
    router = RewardRouter(config(PROBS).rewards)
    assert router.section_for({"tag": "code"}) == "code"
    assert router.section_for({"tag": "code", "domain": "mc"}) == "mc"  # graded by mc's reward, not code's
    assert router.section_for({"tag": "aime2024", "domain": "math"}) == "math"
    assert router.section_for({"tag": "code", "domain": ""}) == "code"  # a CSV's empty cell: no domain (HF: None)
    with pytest.raises(ValueError, match=r"domain column is 'vision', which names no reward section"):
        router.section_for({"tag": "code", "domain": "vision"})
    with pytest.raises(ValueError, match=r"validation record 1: no reward takes tag 'aime2024'"):
        router.check_records([{"tag": "math"}, {"tag": "aime2024"}], "validation")
    roll = RewardRouter({"math_rule": RewardConfig.from_dict({"worker_cls": "x.MathRuleRewardWorker",
                                                              "tag_included": ["deepmath"]}, "rewards.math_rule"),
                         "general": RewardConfig.from_dict({"worker_cls": "x.MathRuleRewardWorker"},
                                                           "rewards.general")})  # fmt: skip
    assert roll.section_for({"tag": "aime2024"}) == "math_rule"  # ROLL's default domain before an untagged section


@pytest.mark.parametrize(
    ("probs", "message"),
    [
        ({"math": 0.5, "vision": 0.5}, r"names domain 'vision', which is no reward section; domains are reward"),
        ({"math": 0.5, "code": 1.5}, r"domain_interleave_probs\.code must be a probability in \(0, 1\], got 1\.5"),
        ({"math": 0.05, "code": 0.95}, r"gives \{'math': 0, 'code': 8\} of rollout_batch_size=8 prompts"),
        ([0.5, 0.5], r"must map reward section names to probabilities"),
    ],
)
def test_bad_domain_probabilities_name_the_key(probs, message):
    assert domain_probs(config({"math": 0.95, "code": 0.05})) == {"math": 0.95, "code": 0.05}  # 7 + 1 prompts
    assert domain_probs(config(None)) is None
    with pytest.raises(ValueError, match=message):
        domain_probs(config(probs))


def test_a_domain_without_records_is_refused():
    with pytest.raises(DataError, match=r"names domain 'mc', but no training record belongs to it"):
        DomainSampler(PROBS, ["math", "code"], seed=0)


def test_each_domain_gets_its_rewards_and_advantages_computed_apart_as_in_roll():
    """With domains, a batch's targets equal those of each domain's samples alone (batch reward normalisation and
    whitened advantages within the domain), and each domain's metrics come prefixed with its name."""
    import torch

    from apps.common.algorithm import AlgorithmSettings, TargetBuilder
    from rl_core.batch import RolloutBatch

    cfg = RLVRConfig.from_dict({"adv_estimator": "reinforce", "reward_norm": "batch", "whiten_advantages": True,
                                "rewards": {"math": {"worker_cls": "x.ExactMatchRewardWorker"}}})  # fmt: skip
    settings = AlgorithmSettings.from_config(cfg)
    domains = ["a", "b", "a", "b", "a", "b"]
    rewards = torch.tensor([1.0, 10.0, 0.0, 20.0, 1.0, 30.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float32)

    def batch(rows):
        return RolloutBatch.from_dict({"response_mask": mask[rows], "old_log_probs": torch.zeros(len(rows), 3)}, {})

    together = batch(list(range(6)))
    metrics = TargetBuilder(settings, cfg, domains=["a", "b"])(together, rewards, list(range(6)), domains=domains)
    for name, rows in (("a", [0, 2, 4]), ("b", [1, 3, 5])):
        alone = batch(rows)
        alone_metrics = TargetBuilder(settings, cfg)(alone, rewards[rows], rows)
        assert torch.allclose(together.batch["advantages"][rows], alone.batch["advantages"], atol=1e-6)
        assert metrics[f"{name}/critic/rewards/mean"] == pytest.approx(alone_metrics["critic/rewards/mean"], abs=1e-6)
        assert metrics[f"{name}/critic/score/mean"] == pytest.approx(float(rewards[rows].mean()))
    # not what one normalisation over the whole batch gives
    plain = batch(list(range(6)))
    TargetBuilder(settings, cfg)(plain, rewards, list(range(6)))
    assert not torch.allclose(plain.batch["advantages"], together.batch["advantages"], atol=1e-3)


def test_a_record_drawn_in_two_epochs_of_one_batch_makes_two_groups():
    from apps.rlvr.data import PromptSampler

    indices, uids = PromptSampler(3, seed=0).draw(5)  # all of epoch 0, then two of epoch 1
    assert len(set(indices)) == 3 and len(set(uids)) == 5
    assert [uid.split(":")[0] for uid in uids] == ["0", "0", "0", "1", "1"]


def test_domains_with_dynamic_sampling_are_refused_naming_both_keys():
    cfg = config(PROBS)
    cfg.rewards["math"].spec.query_filter_config = {"type": "std_filter", "filter_args": {"std_threshold": 0}}
    with pytest.raises(ValueError, match=r"with dynamic sampling \(rewards\.math\.query_filter_config\)"):
        domain_probs(cfg)
    cfg = config(PROBS)
    cfg.is_use_additional_prompts = True
    with pytest.raises(ValueError, match=r"with dynamic sampling \(is_use_additional_prompts\) is not supported"):
        domain_probs(cfg)

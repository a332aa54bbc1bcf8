"""Reward sections on Ray actors (apps.rlvr.reward_workers) against the same rewards scored in the driver.

The session's shared Ray instance serves the module (tests/conftest.py: ``ray_session``); this module's functions
are pickled by value, as a user's script's would be.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray

from apps.rlvr.config import RewardConfig
from apps.rlvr.reward_workers import RewardWorkers, chunk_bounds
from apps.rlvr.rewards import REWARD_FUNCTIONS, Grade, RewardRouter, extract_answer
from rl_engines.worker_group import WorkerCallError, WorkerError

RPC_TIMEOUT = 60.0
SYSTEM_ENVS = {"RL_TEST_REWARD_SCALE": "10"}


@REWARD_FUNCTIONS.register("test_scaled_answer_length")
def scaled_answer_length_reward(response, record, spec):
    """A user's reward: answer length times ``RL_TEST_REWARD_SCALE`` (a system_envs variable; 1 in the driver)."""
    return len(extract_answer(response)) * float(os.environ.get("RL_TEST_REWARD_SCALE", "1"))


@REWARD_FUNCTIONS.register("test_always_fails")
def failing_reward(response, record, spec):
    raise ArithmeticError(f"cannot grade {response!r}")


def _section(name, worker_cls, tags, world_size=None, coef=0.0):
    values = {"worker_cls": f"my.rewards.{worker_cls}", "tag_included": tags, "response_length_penalty_coef": coef}
    if world_size is not None:
        values["world_size"] = world_size
    return RewardConfig.from_dict(values, f"rewards.{name}")


SECTIONS = {
    "math": _section("math", "ExactMatchRewardWorker", ["math"], world_size=2, coef=0.01),
    "fmt": _section("fmt", "FormatRewardWorker", [], coef=0.001),  # no world_size: scored in the driver
    "user": _section("user", "test_scaled_answer_length", ["user"], world_size=1),
    "boom": _section("boom", "test_always_fails", ["boom"], world_size=1),
}


@pytest.fixture(scope="module")
def by_value(ray_session):
    """Actors import `apps` (on their PYTHONPATH), never this test module: its functions travel by value."""
    this_module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(this_module)
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(this_module)


@pytest.fixture(scope="module")
def router(by_value):
    router = RewardRouter(SECTIONS)
    router.start_workers(RPC_TIMEOUT, SYSTEM_ENVS)
    try:
        yield router
    finally:
        router.shutdown()


def _dies_within(actor, seconds):
    """True once a call on ``actor`` fails as dead (``ray.kill`` is asynchronous: a call may still slip in)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=seconds)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


def test_chunks_are_contiguous_non_empty_and_balanced():
    assert chunk_bounds(5, 2) == [(0, 3), (3, 5)]
    assert chunk_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert chunk_bounds(1, 3) == [(0, 1)]  # more workers than samples: one call, no empty ones
    assert chunk_bounds(0, 2) == []


def test_world_size_below_one_is_rejected_naming_the_key():
    sections = {**SECTIONS, "math": _section("math", "ExactMatchRewardWorker", ["math"], world_size=0)}
    with pytest.raises(ValueError, match=r"rewards\.math\.world_size must be an int >= 1 .*got 0"):
        RewardRouter(sections)
    with pytest.raises(ValueError, match=r"rewards\.math\.world_size"):
        RewardWorkers(sections, {}, rpc_timeout=RPC_TIMEOUT, system_envs={})


def test_ray_scores_equal_driver_scores_in_order(router):
    assert router.workers is not None
    assert router.workers.world_sizes == {"math": 2, "user": 1, "boom": 1}
    texts = ["<answer>4</answer>", "x <answer>a</answer>", "<answer>5</answer>", "none", "<answer>9</answer>", "7"]
    records = [
        {"tag": "math", "ground_truth": "4"},
        {"tag": "other", "ground_truth": "a"},  # -> fmt, in the driver
        {"tag": "math", "ground_truth": "6"},
        {"tag": "other", "ground_truth": "b"},
        {"tag": "math", "ground_truth": "9"},
        {"tag": "math", "ground_truth": "7"},
    ]
    lengths = [10, 20, 30, 40, 50, 60]
    grades = router.grade_many(texts, records, lengths)
    assert grades == [router.grade(t, r, n) for t, r, n in zip(texts, records, lengths)]
    rewards = [grade.reward for grade in grades]
    assert rewards == pytest.approx([0.9, 0.98, -0.3, -0.04, 0.5, 0.4], abs=1e-12)  # 1/0 minus 0.01 or 0.001 x len
    assert [grade.score for grade in grades] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # the penalty is the reward's
    # more workers than samples: the one sample goes to one actor
    assert router.grade_many(texts[:1], records[:1], lengths[:1]) == [Grade(1.0, pytest.approx(0.9))]
    assert router.workers.score_async("math", texts[:1], records[:1], lengths[:1]).ranks == [0]
    assert router.grade_many([], [], []) == []


def test_user_function_and_system_envs_reach_the_actors(router):
    texts = ["<answer>abc</answer>", "<answer>4</answer>"]
    records = [{"tag": "user"}, {"tag": "math", "ground_truth": "4"}]
    assert [grade.reward for grade in router.grade_many(texts, records, [1, 1])] == [30.0, pytest.approx(0.99)]
    assert router.grade(texts[0], records[0], 1) == Grade(3.0, 3.0)  # the driver lacks the system_envs variable


def test_a_raising_reward_names_the_section_rank_and_error(router):
    records = [{"tag": "math", "ground_truth": "1"}, {"tag": "boom"}]
    with pytest.raises(WorkerCallError, match=r"rewards\.boom: rank 0 raised in `score`") as caught:
        router.grade_many(["<answer>1</answer>", "oops"], records, [1, 1])
    assert caught.value.role == "rewards.boom"
    assert "ArithmeticError: cannot grade 'oops'" in str(caught.value)
    assert "failing_reward" in caught.value.remote_traceback


def test_shutdown_kills_the_actors_and_scoring_falls_back_to_the_driver(ray_session):
    sections = {"solo": _section("solo", "ExactMatchRewardWorker", [], world_size=1)}
    router = RewardRouter(sections)
    router.start_workers(RPC_TIMEOUT, {})
    with pytest.raises(RuntimeError, match="already started"):
        router.start_workers(RPC_TIMEOUT, {})
    workers = router.workers
    assert workers is not None
    (actor,) = workers.actors["solo"]
    assert router.grade_many(["<answer>2</answer>"], [{"ground_truth": "2"}], [0]) == [Grade(1.0, 1.0)]
    router.shutdown()
    router.shutdown()  # idempotent
    assert router.workers is None
    assert workers.actors == {}
    assert _dies_within(actor, seconds=30.0)
    with pytest.raises(WorkerError, match=r"rewards\.solo: the reward workers are shut down"):
        workers.score_async("solo", ["x"], [{"ground_truth": "x"}], [0])
    assert router.grade_many(["<answer>2</answer>"], [{"ground_truth": "2"}], [0]) == [Grade(1.0, 1.0)]  # driver

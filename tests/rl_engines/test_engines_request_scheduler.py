"""generate_opt_level 1: chunks go to whichever rank has room; results are in prompt order and do not depend on
which rank ran a chunk (so concurrency limits change timing, never samples); worker errors keep their type."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_fixtures import prompt_batch, tiny_model_dir, worker_config

from rl_engines.config import GeneratingArgs
from rl_engines.placement import ClusterSpec
from rl_engines.request_scheduler import ScheduledGeneration
from rl_engines.roles import Roles
from rl_engines.worker_group import WorkerCallError

__all__ = ["tiny_model_dir"]

CLUSTER = ClusterSpec(num_nodes=1, num_gpus_per_node=2)
QUESTIONS = ["1+2=", "10+12=", "3+3=", "4+5=", "7+1=", "2+2=", "9+9="]
ARGS = GeneratingArgs(max_new_tokens=5, num_return_sequences=2, seed=3)


@pytest.fixture(scope="module")
def infer(ray_session, tiny_model_dir):
    config = worker_config(tiny_model_dir, "actor_infer", device_mapping=[0, 1],
                           strategy_args={"strategy_name": "hf_infer"}, infer_batch_size=2)  # fmt: skip
    with Roles(CLUSTER, {"actor_infer": config}, rpc_timeout=120) as roles:
        yield roles["actor_infer"]


def scheduled(group, batch, running, args=ARGS):
    return ScheduledGeneration(group, batch, args, chunk_prompts=2, max_running_requests=running).get()


def test_samples_do_not_depend_on_the_concurrency_and_keep_prompt_order(infer, tiny_model_dir):
    batch = prompt_batch(tiny_model_dir, QUESTIONS)
    one_at_a_time, all_at_once = scheduled(infer, batch, running=1), scheduled(infer, batch, running=64)
    assert len(one_at_a_time) == 2 * len(QUESTIONS)
    for key in ("responses", "rollout_log_probs", "response_mask"):
        torch.testing.assert_close(one_at_a_time.batch[key], all_at_once.batch[key], rtol=0, atol=0)
    # samples of a prompt are adjacent and the prompts keep their order
    assert one_at_a_time.non_tensor_batch["question"].tolist() == [q for q in QUESTIONS for _ in range(2)]
    other_seed = scheduled(infer, batch, running=64, args=replace(ARGS, seed=4))
    assert not torch.equal(other_seed.batch["responses"], all_at_once.batch["responses"])


def test_a_worker_error_reaches_the_caller_with_its_role(infer, tiny_model_dir):
    batch = prompt_batch(tiny_model_dir, QUESTIONS[:3])
    with pytest.raises(
        WorkerCallError, match=r"(?s)actor_infer: rank \d raised in `generate`.*temperature must be >= 0"
    ):
        scheduled(infer, batch, running=4, args=replace(ARGS, temperature=-1.0))


def test_bad_limits_are_rejected(infer, tiny_model_dir):
    with pytest.raises(ValueError, match="max_running_requests \\(0\\) must be >= 1"):
        ScheduledGeneration(infer, prompt_batch(tiny_model_dir, QUESTIONS[:1]), ARGS, chunk_prompts=2,
                            max_running_requests=0)  # fmt: skip

"""Real multi-turn episodes (tiny model on hf_infer in this process, real environments): the context is the chat
template's rendering of the conversation, and exactly the sampled tokens are trained."""

from __future__ import annotations

from dataclasses import replace

import pytest
from agentic_fixtures import InProcessGroup, make_setup

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager
from apps.agentic.rollout import TrajectoryRunner, episodes_to_batch, user_turn
from apps.common.preflight import fill_model_paths
from apps.common.yaml_config import load_config
from rl_engines.role_worker import RoleWorker
from rl_engines.worker_group import WorkerBase


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    root = make_setup(tmp_path_factory.mktemp("episodes"))
    config = AgenticConfig.from_dict(load_config(root / "agentic.yaml", ["max_tokens_per_step=4"]))
    fill_model_paths(config.base)
    worker = RoleWorker("actor_infer", 0, 1, "127.0.0.1", WorkerBase.free_port(), {}, config.base.actor_infer)
    worker.initialize()
    manager = EnvManager(config, config.train_env_manager, "train")
    tokenizer = worker.strategy.tokenizer
    # A turn generates at most the smaller of max_tokens_per_step (4) and generating_args.max_new_tokens (3).
    generating = replace(config.base.actor_infer.generating_args, temperature=1.0, max_new_tokens=3)
    runner = TrajectoryRunner(manager, tokenizer, generating, 600, record_frames=True)
    try:
        yield runner.run(InProcessGroup(worker), step=0, rounds=2), tokenizer
    finally:
        manager.close()


def spans(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    found, start = [], None
    for i, value in enumerate([*mask, False]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            found.append((start, i))
            start = None
    return found


def test_sampled_tokens_are_the_responses_the_environments_got(episodes):
    runs, tokenizer = episodes
    assert len(runs) == 8 and any(len(e.rewards) > 1 for e in runs)  # 4 environments x 2 rounds, multi-turn
    assert any(b - a == 3 for e in runs for a, b in spans(e.mask))
    for episode in runs:
        turns = spans(episode.mask)
        assert len(turns) == len(episode.rewards) == len(episode.frames) - 1
        assert all(b - a <= 3 for a, b in turns)
        responses = [tokenizer.decode(episode.tokens[a:b], skip_special_tokens=True) for a, b in turns]
        assert responses == [frame["response"] for frame in episode.frames[1:]]
        assert all(episode.log_probs[i] < 0 for a, b in turns for i in range(a, b))  # the engine's log-probs
        assert all(episode.log_probs[i] == 0 for i, sampled in enumerate(episode.mask) if not sampled)


def test_context_is_the_template_rendering_of_the_conversation(episodes):
    runs, tokenizer = episodes
    for episode in runs:
        spec, eos = episode.slot.spec, tokenizer.eos_token_id
        messages = [{"role": "system", "content": spec.agent_system_template},
                    {"role": "user", "content": f"{episode.slot.env.instructions}\n"
                                                f"{user_turn(spec, episode.frames[0]['observation'], 1)}"}]  # fmt: skip
        answers = [episode.tokens[a:b] for a, b in spans(episode.mask)]
        for turn, answer in enumerate(answers, start=1):
            content = answer[:-1] if answer and answer[-1] == eos else answer
            messages.append({"role": "assistant", "content": tokenizer.decode(content)})
            if turn < len(answers):
                observation = episode.frames[turn]["observation"]
                messages.append({"role": "user", "content": user_turn(spec, observation, turn + 1)})
        before_last = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(episode.context) == before_last + tokenizer.decode(answers[-1])


def test_groups_start_alike_and_samples_keep_their_group(episodes):
    runs, _ = episodes
    first_round = [e for e in runs if e.round_index == 0]
    assert first_round[0].frames[0]["observation"] == first_round[1].frames[0]["observation"]  # group 0 (FrozenLake)
    assert first_round[2].frames[0]["observation"] == first_round[3].frames[0]["observation"]  # group 1 (Sokoban)
    assert [e.seed for e in runs if e.round_index == 1] != [e.seed for e in first_round]  # a new round, new seeds
    batch = episodes_to_batch(runs, pad_id=0)
    assert list(batch.non_tensor_batch["traj_group_id"][:4]) == ["0:0", "0:0", "0:1", "0:1"]
    assert batch.batch["response_mask"].sum().item() == sum(sum(e.mask) for e in runs)

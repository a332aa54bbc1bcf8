"""Real multi-turn episodes (tiny model on hf_infer in this process, real environments): the context is the chat
template's rendering of the conversation, and exactly the sampled tokens are trained."""

from __future__ import annotations

from dataclasses import replace

import pytest
from agentic_fixtures import InProcessGroup, make_setup

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager
from apps.agentic.rollout import TrajectoryRunner, episodes_to_batch, user_turn
from apps.agentic.step_rollout import StepRunner
from apps.common.preflight import fill_model_paths
from apps.common.yaml_config import load_config
from rl_engines.role_worker import RoleWorker
from rl_engines.worker_group import WorkerBase


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The config (max_tokens_per_step 4), actor_infer's strategy in this process and its tokenizer."""
    root = make_setup(tmp_path_factory.mktemp("episodes"))
    config = AgenticConfig.from_dict(load_config(root / "agentic.yaml", ["max_tokens_per_step=4"]))
    fill_model_paths(config.base)
    worker = RoleWorker("actor_infer", 0, 1, "127.0.0.1", WorkerBase.free_port(), {}, config.base.actor_infer)
    worker.initialize()
    return config, worker, worker.strategy.tokenizer


@pytest.fixture(scope="module")
def episodes(setup):
    config, worker, tokenizer = setup
    manager = EnvManager(config, config.train_env_manager, "train")
    # A turn generates at most the smaller of max_tokens_per_step (4) and generating_args.max_new_tokens (3).
    generating = replace(config.base.actor_infer.generating_args, temperature=1.0, max_new_tokens=3)
    runner = TrajectoryRunner(manager, tokenizer, generating, 600, record_frames=True)
    try:
        yield runner.run(InProcessGroup(worker), step=0, rounds=2), tokenizer
    finally:
        manager.close()


class BudgetLog(InProcessGroup):
    """actor_infer in this process, noting each generate call's context lengths and max_new_tokens."""

    def __init__(self, worker: RoleWorker) -> None:
        super().__init__(worker)
        self.calls: list[tuple[list[int], int]] = []

    def call(self, method, batch, args, dispatch):
        self.calls.append((batch.batch["attention_mask"].sum(dim=-1).tolist(), args.max_new_tokens))
        return super().call(method, batch, args, dispatch)


@pytest.mark.parametrize("runner_cls", [TrajectoryRunner, StepRunner])
def test_the_last_turn_generates_what_fits_in_sequence_length_as_rolls_make_decision(setup, runner_cls):
    """ROLL's make_decision: a turn generates at most min(max_tokens_per_step, max_new_tokens, sequence_length -
    context), and the episode stops once its context leaves no room. Here sequence_length leaves the longest first
    prompt 2 tokens of a 3-token turn: that turn is cut to 2, the other env's turns are not cut more than they must."""
    config, worker, tokenizer = setup
    manager = EnvManager(config, config.train_env_manager, "train")
    generating = replace(config.base.actor_infer.generating_args, temperature=1.0, max_new_tokens=3)
    probe = runner_cls(manager, tokenizer, generating, 10**6)
    try:
        observations = manager.reset(manager.seeds(0, 0))
        prompts = [len(probe._start(slot, 0, 0, obs).prompt_ids) for slot, obs in zip(manager.slots, observations)]
        length = max(prompts) + 2
        infer = BudgetLog(worker)
        runs = runner_cls(manager, tokenizer, generating, length).run(infer, step=0)
    finally:
        manager.close()
    budgets = [(context, tokens) for contexts, tokens in infer.calls for context in contexts]
    assert all(tokens == min(3, length - context) for context, tokens in budgets)
    assert (max(prompts), 2) in budgets  # the longest first prompt's turn, cut to what fits
    assert all(e.done for e in runs)
    samples = probe.to_batch(runs)
    assert samples.batch["attention_mask"].sum(dim=-1).max().item() <= length


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

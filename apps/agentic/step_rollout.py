"""Step samples (ROLL's StepEnvManager): every turn of an episode is its own training sample.

A turn's prompt is rebuilt from scratch: the system message and ``agent_template`` filled with the environment's
instructions (``{env_instruction}``; put before the template when it has no such field), the number of turns taken
(``{step_count}``), the current observation (``{current_observation}``, also ``{observation}``), the 1-based turn
(``{current_step}``, also ``{turn_idx}``) and a window of earlier turns (``{history}``, ``{history_length}``): with
``custom_envs.<tag>.history_length`` h, the last h - 1 turns (ROLL counts the current turn in the window), each as
``(step: n, observation: ..., action: ..., reward: r)`` joined by ", "; an invalid action shows the response with
ROLL's tip to follow the format. ROLL's current StepEnvManager lists only the invalid turns (an indentation slip in
its loop); here every turn of the window is listed, as its template text ("the most recent ... observations, and
your responses") says.

A sample is that prompt and the turn's sampled tokens (all of them trained); ``scores`` is the turn's own reward.
Columns: ``traj_id`` (the episode), ``traj_group_id`` (its env group), ``step`` (0-based turn), ``state_hash``
(ROLL's hash of the observation the turn acted on: GiGPO's anchor state), ``step_scores`` (the turn's reward),
``episode_scores`` (the episode's summed rewards) and the per-episode columns of whole-episode samples.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Sequence
from typing import Any

from apps.agentic.env_sections import EnvSpec
from apps.agentic.rollout import (
    Episode,
    Sample,
    TrajectoryRunner,
    Turn,
    env_suffix,
    episode_columns,
    samples_to_batch,
)
from rl_core.batch import RolloutBatch

INVALID_TIP = (
    "(IMPORTANT TIPS: this action is not valid, your new response *must* strictly adhere to the format according "
    "to env instructions.)"
)
"""ROLL's note after an invalid action in the history."""


def state_key(observation: str) -> str:
    """ROLL's ``state_hash`` of a text observation: SHA-256 of ``b"str:"`` + its UTF-8 bytes, in hex."""
    return hashlib.sha256(b"str:" + observation.encode("utf-8")).hexdigest()


def history_window(turns: Sequence[Turn], history_length: int | None) -> str:
    """The ``{history}`` text: the last ``history_length - 1`` turns (none when null or 1), numbered from 1."""
    shown = list(turns[max(len(turns) - (history_length - 1), 0) :]) if history_length and history_length > 1 else []
    first = len(turns) - len(shown) + 1
    entries = []
    for number, turn in enumerate(shown, start=first):
        action = turn.action if turn.action is not None else turn.response + INVALID_TIP
        entries.append(f"(step: {number}, observation: {turn.observation}, action: {action}, reward: {turn.reward})")
    return ", ".join(entries)


def template_fields(template: str) -> set[str]:
    """The field names a format string uses."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def step_user_message(spec: EnvSpec, instructions: str, turns: Sequence[Turn], observation: str,
                      suffix: str = "") -> str:  # fmt: skip
    """The user message of the turn after ``turns`` (the module docstring's fields), acting on ``observation``;
    ``suffix``: the environment's prompt for the next move."""
    taken = len(turns)
    shown = min(taken, max((spec.history_length or 1) - 1, 0))
    user = spec.agent_template.format(
        env_instruction=instructions, step_count=taken, history_length=shown,
        history=history_window(turns, spec.history_length), current_step=taken + 1, current_observation=observation,
        turn_idx=taken + 1, observation=observation, actions_left=spec.max_steps - taken,
        max_response_length=spec.max_tokens_per_step, suffix=suffix,
    )  # fmt: skip
    if instructions and "env_instruction" not in template_fields(spec.agent_template):
        user = f"{instructions}\n{user}"
    return user


class StepRunner(TrajectoryRunner):
    """Runs episodes like ``TrajectoryRunner`` but prompts every turn afresh and keeps each turn as a sample."""

    def _first_prompt(self, episode: Episode) -> list[int]:
        return self._step_prompt(episode)

    def _keep(self, episode: Episode, ids: list[int], log_probs: list[float], text: str, result: Any) -> None:
        action = result.info.get("action") if result.info.get("action_is_valid", False) else None
        turn = Turn(episode.prompt_ids, list(ids), list(log_probs), float(result.reward), episode.observation, text,
                    None if action is None else str(action))  # fmt: skip
        episode.turns.append(turn)

    def _next_context(self, episode: Episode, ids: list[int], turn: int) -> None:
        prompt = self._step_prompt(episode)
        if len(prompt) >= self.sequence_length:
            episode.done = True  # the next turn's prompt leaves no room for a response: finish stays "length"
            return
        episode.prompt_ids = prompt

    def _step_prompt(self, episode: Episode) -> list[int]:
        """The chat-templated prompt of the episode's next turn."""
        env, spec = episode.slot.env, episode.slot.spec
        user = step_user_message(spec, env.instructions, episode.turns, episode.observation, env_suffix(env))
        return self.formatters[episode.slot.tag].first_prompt(user)

    def to_batch(self, episodes: Sequence[Episode]) -> RolloutBatch:
        """One sample per turn (the module docstring's layout)."""
        return turns_to_batch(episodes, self.pad_id)


def turns_to_batch(episodes: Sequence[Episode], pad_id: int) -> RolloutBatch:
    """Step samples of finished episodes, in episode then turn order."""
    rows = [(episode, index, turn) for episode in episodes for index, turn in enumerate(episode.turns)]
    samples = [Sample(t.prompt_ids, t.response_ids, [True] * len(t.response_ids), t.log_probs, t.reward)
               for _, _, t in rows]  # fmt: skip
    per_episode = episode_columns(episodes)
    position = {id(episode): i for i, episode in enumerate(episodes)}
    columns = {name: [values[position[id(e)]] for e, _, _ in rows] for name, values in per_episode.items()}
    columns.update(
        traj_id=[f"{e.round_index}:{e.slot.index}" for e, _, _ in rows],
        step=[index for _, index, _ in rows],
        state_hash=[state_key(t.observation) for _, _, t in rows],
        step_scores=[t.reward for _, _, t in rows],
        episode_scores=[float(sum(e.rewards)) for e, _, _ in rows],
    )
    return samples_to_batch(samples, columns, pad_id)


class NativeRunner(StepRunner):
    """ROLL's AgentNativeStepEnvManager: step samples whose prompt is the chat-templated conversation the environment
    keeps (``env.messages``; e.g. ``sokoban_native_env``), rendered afresh each turn (no agent_template, no history
    window). A turn's anchor state for GiGPO is that whole conversation."""

    def _step_prompt(self, episode: Episode) -> list[int]:
        messages = episode.slot.env.messages  # type: ignore[attr-defined]  # checked: keeps_conversation
        episode.observation = json.dumps(messages, sort_keys=True, ensure_ascii=False)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  enable_thinking=False)  # fmt: skip
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def concat_user_message(spec: EnvSpec, turns: Sequence[Turn], observation: str, suffix: str) -> str:
    """ROLL's StepConcatEnvManager prompt (GEM's observation-concatenating wrapper): ``agent_template`` with
    ``{history}``, the observations the last ``history_length - 1`` turns acted on, one per line (none without
    ``history_length``), and ``{current_observation}``, the observation, a newline and the environment's suffix."""
    window = (spec.history_length or 1) - 1
    shown = turns[max(len(turns) - window, 0) :] if window > 0 else []
    history = "\n".join(turn.observation for turn in shown)
    return spec.agent_template.format(history=history, current_observation=f"{observation}\n{suffix}")


class ConcatRunner(StepRunner):
    """ROLL's StepConcatEnvManager: step samples whose prompt is :func:`concat_user_message` (no instructions, no
    actions: a GEM environment's first observation holds its rules). A turn's anchor state for GiGPO is the
    observation it acted on (ROLL hashes it with the suffix, which GEM's games keep the same all episode)."""

    def _step_prompt(self, episode: Episode) -> list[int]:
        user = concat_user_message(episode.slot.spec, episode.turns, episode.observation, env_suffix(episode.slot.env))
        return self.formatters[episode.slot.tag].first_prompt(user)

"""Multi-turn episodes against the inference role, and their training samples.

Every turn, the contexts of all running episodes go to ``actor_infer`` as one batch (so N environments cost one
generate call per turn, not N); each response is decoded and stepped in its environment, and the episode's
context grows by the sampled tokens and the next user turn (``apps.agentic.chat``). An episode ends when its
environment terminates or truncates, after ``custom_envs.<tag>.max_steps`` turns, or when the context fills
``sequence_length``. As ROLL's ``make_decision``, a turn generates at most the env's ``max_tokens_per_step``,
``generating_args.max_new_tokens`` and the room the context leaves in ``sequence_length``: the last turn's budget is
cut to what fits, and the episode ends once the next user turn leaves no room at all.

A finished episode is one training sample: ``prompts`` = the first prompt (left-padded), ``responses`` =
everything after it (right-padded), ``response_mask`` = the tokens the model sampled (environment text and
template tokens stay out of the loss), ``rollout_log_probs`` = the engine's log-probs of those tokens, ``scores`` =
the episode's summed rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import groupby
from typing import Any

import numpy as np
import torch

from apps.agentic.chat import TurnFormatter
from apps.agentic.env_manager import SPLITS, EnvManager, EnvSlot
from apps.agentic.env_sections import EnvSpec
from apps.common.padding import padded_indices
from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs
from rl_engines.strategies.model_io import position_ids_from_mask


@dataclass(frozen=True)
class Turn:
    """One turn as a step sample: the prompt it was generated from, what was sampled, and what it earned."""

    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    reward: float
    observation: str
    """The observation the turn acted on (its anchor state)."""
    response: str
    action: str | None
    """The parsed action (None when the response held no valid one)."""


@dataclass
class Episode:
    """One environment's trajectory as tokens, with its turns' rewards and outcome."""

    slot: EnvSlot
    seed: int
    round_index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    """Everything after the first prompt: responses and the user turns between them."""
    mask: list[bool] = field(default_factory=list)
    """True on the tokens the model sampled."""
    log_probs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Reward of each turn (format penalties included)."""
    valid_actions: int = 0
    done: bool = False
    success: bool = False
    finish: str = "length"
    """``stop``: the environment ended the episode; ``length``: turns or sequence_length ran out."""
    frames: list[dict[str, Any]] = field(default_factory=list)
    """With ``record_frames``: the observation, response, action and reward of each turn (and images)."""
    observation: str = ""
    """The observation the next turn acts on."""
    turns: list[Turn] = field(default_factory=list)
    """Step samples (StepEnvManager): each turn's own prompt and response."""
    pictures: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """VLTrajEnvManager: the visual inputs of the pictures in the context, in order (``apps.agentic.vision``)."""
    tool_message: bool = False
    """The next observation is a tool's result (a tool-wrapped environment, ``apps.agentic.envs.tools``): it goes to
    the model as a ``tool`` message as it is, not through the agent template."""
    tool_counts: tuple[int, int] | None = None
    """A tool-wrapped environment's tool calls and clean runs so far (None: no tools)."""

    @property
    def context(self) -> list[int]:
        """What the model reads next: the first prompt and everything since."""
        return self.prompt_ids + self.tokens


def user_turn(spec: EnvSpec, observation: str, turn: int, suffix: str = "") -> str:
    """The user message of turn ``turn`` (1-based) from the tag's agent_template; ``suffix``: the environment's
    prompt for the next move (:func:`env_suffix`)."""
    return spec.agent_template.format(turn_idx=turn, observation=observation, actions_left=spec.max_steps - turn + 1,
                                      max_response_length=spec.max_tokens_per_step, suffix=suffix)  # fmt: skip


def env_suffix(env: Any) -> str:
    """The environment's prompt for its next move (``suffix``: GEM's ``info["suffix"]``), empty when it has none."""
    return str(getattr(env, "suffix", ""))


def turn_seed(seed: int, split: str, step: int, round_index: int, turn: int) -> int:
    """Sampling seed of one turn's generate call (deterministic, 31 bits)."""
    state = np.random.SeedSequence([seed, SPLITS[split], step, round_index, turn, 7]).generate_state(1)[0]
    return int(state & 0x7FFFFFFF)


class TrajectoryRunner:
    """Runs the episodes of one env manager with ``actor_infer`` (a worker group with ``call`` and ``world_size``)."""

    def __init__(self, manager: EnvManager, tokenizer: Any, generating: GeneratingArgs, sequence_length: int,
                 record_frames: bool = False) -> None:  # fmt: skip
        self.manager, self.tokenizer, self.generating = manager, tokenizer, generating
        self.sequence_length, self.record_frames = sequence_length, record_frames
        self.formatters = {
            slot.tag: TurnFormatter(tokenizer, slot.spec.agent_system_template) for slot in manager.slots
        }
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))

    def run(self, infer: Any, step: int, rounds: int = 1) -> list[Episode]:
        """``rounds`` rounds of one episode per environment; episodes in (round, slot) order."""
        return [episode for r in range(rounds) for episode in self._round(infer, step, r)]

    def _round(self, infer: Any, step: int, round_index: int) -> list[Episode]:
        seeds = self.manager.seeds(step, round_index)
        observations = self.manager.reset(seeds)
        episodes = [self._start(slot, seeds[slot.index], round_index, obs)
                    for slot, obs in zip(self.manager.slots, observations, strict=True)]  # fmt: skip
        turn = 1
        while running := [e for e in episodes if not e.done]:
            self._turn(infer, running, step, round_index, turn)
            turn += 1
        return episodes

    def _start(self, slot: EnvSlot, seed: int, round_index: int, observation: str) -> Episode:
        episode = Episode(slot, seed, round_index, [], observation=observation)
        episode.prompt_ids = self._first_prompt(episode)
        if len(episode.prompt_ids) >= self.sequence_length:
            raise ValueError(
                f"the first prompt of a {slot.tag} episode is {len(episode.prompt_ids)} tokens, which leaves no room "
                f"for a response in sequence_length={self.sequence_length}. Raise sequence_length or shorten "
                f"custom_envs.{slot.tag}'s templates."
            )
        if self.record_frames:
            episode.frames.append(self._frame(slot, observation))
        return episode

    def _first_prompt(self, episode: Episode) -> list[int]:
        """System message, the environment's instructions and the first observation, chat-templated."""
        user, episode.pictures = self._user_text(episode, 1)
        return self.formatters[episode.slot.tag].first_prompt(user)

    def _user_text(self, episode: Episode, turn: int) -> tuple[str, list[dict[str, torch.Tensor]]]:
        """The user message of turn ``turn`` (the first one opens with the environment's instructions) and the
        visual inputs of the pictures it holds (none here)."""
        user = user_turn(episode.slot.spec, episode.observation, turn, env_suffix(episode.slot.env))
        instructions = episode.slot.env.instructions if turn == 1 else ""
        return (f"{instructions}\n{user}" if instructions else user), []

    def _turn(self, infer: Any, running: list[Episode], step: int, round_index: int, turn: int) -> None:
        """Generate one response per running episode, step the environments, extend the contexts."""
        split = self.manager.split
        seed = self.generating.seed if self.generating.seed is not None else self.manager.seed
        responses: dict[int, tuple[list[int], list[float]]] = {}
        by_limit = sorted(running, key=self._turn_limit)
        for limit, members in groupby(by_limit, key=self._turn_limit):
            group = list(members)
            args = replace(self.generating, max_new_tokens=limit, num_return_sequences=1,
                           seed=turn_seed(seed, split, step, round_index, turn))  # fmt: skip
            for episode, answer in zip(group, self._generate(infer, group, args), strict=True):
                responses[episode.slot.index] = answer
        texts = {index: self.tokenizer.decode(ids, skip_special_tokens=True) for index, (ids, _) in responses.items()}
        results = self.manager.step(texts)
        for episode in running:
            ids, log_probs = responses[episode.slot.index]
            self._record(episode, ids, log_probs, texts[episode.slot.index], results[episode.slot.index], turn)

    def _turn_limit(self, episode: Episode) -> int:
        """Tokens the episode's next turn may generate: the env's max_tokens_per_step, at most
        generating_args.max_new_tokens and the room its context leaves in sequence_length (ROLL's make_decision)."""
        room = self.sequence_length - len(episode.context)
        return min(episode.slot.spec.max_tokens_per_step, self.generating.max_new_tokens, room)

    def _generate(
        self, infer: Any, episodes: list[Episode], args: GeneratingArgs
    ) -> list[tuple[list[int], list[float]]]:
        """One batched generate call; the rows are padded to the inference world size (padding dropped)."""
        rows = padded_indices(list(range(len(episodes))), infer.world_size)
        contexts = [episodes[i].context for i in rows]
        width = max(len(c) for c in contexts)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context) :] = torch.tensor(context)
            attention_mask[row, width - len(context) :] = 1
        batch = RolloutBatch.from_dict({"input_ids": input_ids, "attention_mask": attention_mask},
                                       self._context_columns([episodes[i] for i in rows]))  # fmt: skip
        out = infer.call("generate", batch, args, dispatch="dp_split")
        lengths = out.batch["response_mask"].sum(dim=-1).tolist()
        return [(out.batch["responses"][row, : int(n)].tolist(), out.batch["rollout_log_probs"][row, : int(n)].tolist())
                for row, n in enumerate(lengths[: len(episodes)])]  # fmt: skip

    def _record(self, episode: Episode, ids: list[int], log_probs: list[float], text: str, result: Any,
                turn: int) -> None:  # fmt: skip
        self._keep(episode, ids, log_probs, text, result)
        episode.tool_message = bool(result.info.get("use_tool", False))
        if "tool_use_counter" in result.info:
            episode.tool_counts = (int(result.info["tool_use_counter"]), int(result.info["tool_success_counter"]))
        episode.rewards.append(float(result.reward))
        episode.valid_actions += int(bool(result.info.get("action_is_valid", False)))
        episode.success = bool(result.info.get("success", False))
        if self.record_frames:
            frame = self._frame(episode.slot, result.observation)
            frame.update(response=text, action=result.info.get("action"), reward=float(result.reward))
            episode.frames.append(frame)
        if result.terminated or result.truncated or turn >= episode.slot.spec.max_steps:
            episode.done, episode.finish = True, "stop" if result.terminated else "length"
            return
        episode.observation = result.observation
        self._next_context(episode, ids, turn)

    def _keep(self, episode: Episode, ids: list[int], log_probs: list[float], text: str, result: Any) -> None:
        """The sampled tokens join the episode's one sample."""
        episode.tokens += ids
        episode.mask += [True] * len(ids)
        episode.log_probs += log_probs

    def _next_context(self, episode: Episode, ids: list[int], turn: int) -> None:
        """Extend the conversation by the next user turn, or end the episode when that turn leaves no room for a
        response in sequence_length (ROLL: a context of sequence_length tokens or more stops the episode, its last
        user turn left out of the sample)."""
        eos_text = self.tokenizer.decode(ids[-1:]) if ids and ids[-1] in self.eos_ids else ""
        formatter = self.formatters[episode.slot.tag]
        if episode.tool_message:
            pictures: list[dict[str, torch.Tensor]] = []
            following = formatter.continuation(eos_text, episode.observation, role="tool")
        else:
            user, pictures = self._user_text(episode, turn + 1)
            following = formatter.continuation(eos_text, user)
        if len(episode.context) + len(following) >= self.sequence_length:
            episode.done = True  # no room for the next response: truncated, finish stays "length"
            return
        episode.pictures += pictures
        episode.tokens += following
        episode.mask += [False] * len(following)
        episode.log_probs += [0.0] * len(following)

    def _context_columns(self, episodes: Sequence[Episode]) -> dict[str, list[Any]]:
        """Non-tensor columns of the contexts sent to generation (a VL runner's pictures; none here)."""
        return {}

    def _frame(self, slot: EnvSlot, observation: str) -> dict[str, Any]:
        return {"observation": observation, "image": slot.env.render("rgb_array")}

    def to_batch(self, episodes: Sequence[Episode]) -> RolloutBatch:
        """The training samples of finished episodes: one per episode."""
        return episodes_to_batch(episodes, self.pad_id)


@dataclass(frozen=True)
class Sample:
    """One training row: a left-padded prompt and a right-padded continuation."""

    prompt: list[int]
    tokens: list[int]
    mask: list[bool]
    """True on the continuation tokens the model sampled."""
    log_probs: list[float]
    score: float


def samples_to_batch(samples: Sequence[Sample], columns: dict[str, list[Any]], pad_id: int) -> RolloutBatch:
    """Rows of ``samples`` as a rollout batch (layout of the module docstring) with the non-tensor ``columns``."""
    prompt_width = max(len(s.prompt) for s in samples)
    response_width = max(max(len(s.tokens) for s in samples), 1)
    rows = len(samples)
    prompts = torch.full((rows, prompt_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
    responses = torch.full((rows, response_width), pad_id, dtype=torch.long)
    real = torch.zeros((rows, response_width), dtype=torch.long)
    response_mask = torch.zeros((rows, response_width), dtype=torch.bool)
    log_probs = torch.zeros((rows, response_width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        prompts[row, prompt_width - len(sample.prompt) :] = torch.tensor(sample.prompt)
        prompt_mask[row, prompt_width - len(sample.prompt) :] = 1
        n = len(sample.tokens)
        responses[row, :n] = torch.tensor(sample.tokens, dtype=torch.long)
        real[row, :n] = 1
        response_mask[row, :n] = torch.tensor(sample.mask, dtype=torch.bool)
        log_probs[row, :n] = torch.tensor(sample.log_probs, dtype=torch.float32)
    attention_mask = torch.cat([prompt_mask, real], dim=1)
    tensors = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask),
        "response_mask": response_mask, "rollout_log_probs": log_probs,
        "scores": torch.tensor([s.score for s in samples], dtype=torch.float32),
    }  # fmt: skip
    return RolloutBatch.from_dict(tensors, columns)


def episode_columns(episodes: Sequence[Episode]) -> dict[str, list[Any]]:
    """Per-episode non-tensor columns (one entry per episode); with tool-wrapped environments also each episode's
    tool calls and clean runs (0 for an environment without tools)."""
    columns: dict[str, list[Any]] = {
        "traj_group_id": [f"{e.round_index}:{e.slot.group}" for e in episodes],
        "tag": [e.slot.tag for e in episodes],
        "env_seed": [e.seed for e in episodes],
        "success": [e.success for e in episodes],
        "num_turns": [len(e.rewards) for e in episodes],
        "valid_actions": [e.valid_actions for e in episodes],
        "finish_reasons": [e.finish for e in episodes],
    }
    if any(e.tool_counts is not None for e in episodes):  # a tool-wrapped environment reports counts every step
        counts = [e.tool_counts or (0, 0) for e in episodes]
        columns.update(tool_use_counter=[c[0] for c in counts], tool_success_counter=[c[1] for c in counts])
    return columns


def episodes_to_batch(episodes: Sequence[Episode], pad_id: int) -> RolloutBatch:
    """Training samples of finished episodes, one per episode, ``scores`` = the summed rewards."""
    samples = [Sample(e.prompt_ids, e.tokens, e.mask, e.log_probs, sum(e.rewards)) for e in episodes]
    return samples_to_batch(samples, episode_columns(episodes), pad_id)


def episode_rows(rollout: RolloutBatch) -> list[int]:
    """One row per episode: every row of a batch of whole episodes, the first turn of each episode of step samples."""
    columns = rollout.non_tensor_batch
    if "traj_id" not in columns:
        return list(range(len(rollout)))
    first: dict[Any, int] = {}
    for row, traj in enumerate(columns["traj_id"]):
        first.setdefault(traj, row)
    return list(first.values())


def episode_metrics(rollout: RolloutBatch, prefix: str) -> dict[str, float]:
    """Success rate (overall and per tag), turns, valid-action rate and episode reward of a rollout's episodes."""
    columns, rows = rollout.non_tensor_batch, episode_rows(rollout)

    def column(name: str) -> np.ndarray:
        return np.asarray([columns[name][row] for row in rows])

    success, turns = column("success").astype(np.float64), column("num_turns").astype(np.float64)
    valid = column("valid_actions").astype(np.float64)
    rewards = column("episode_scores") if "episode_scores" in columns else rollout.batch["scores"].numpy()[rows]
    metrics = {
        f"{prefix}/success_rate": float(success.mean()),
        f"{prefix}/num_turns/mean": float(turns.mean()),
        f"{prefix}/action_valid_rate": float(valid.sum() / max(turns.sum(), 1.0)),
        f"{prefix}/episode_reward/mean": float(np.asarray(rewards, dtype=np.float64).mean()),
        f"{prefix}/truncated_rate": float((column("finish_reasons") == "length").mean()),
    }
    tags = column("tag")
    for tag in sorted(set(tags.tolist())):
        metrics[f"{prefix}/{tag}/success_rate"] = float(success[tags == tag].mean())
        for name in ("tool_use_counter", "tool_success_counter"):  # ROLL's env/<tag>/ tool metrics, per episode
            if name in columns:
                metrics[f"{prefix}/{tag}/{name}"] = float(column(name).astype(np.float64)[tags == tag].mean())
    return metrics

"""The agentic CPU demo's model: a tiny Qwen2 and tokenizer built locally, warmed up on FrozenLake conversations.

The warm-up is a short supervised pass over multi-turn episodes played by a noisy expert (the shortest-path move
with probability ``expert``, a uniformly random move otherwise), formatted exactly as the pipeline formats them
(same templates, same token bookkeeping), with the loss on the answer tokens only. It teaches the answer format and
leaves the model solving the lake some of the time, so that RL has something to sharpen. Cached under
``cache_dir`` and rebuilt only when the recipe or the environment spec changes.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from apps.agentic.chat import TurnFormatter
from apps.agentic.config import EnvSpec
from apps.agentic.envs import make_env
from apps.agentic.rollout import user_turn
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

ACTIONS = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
LAKE_4X4 = ("SFFF", "FHFH", "FFFH", "HFFG")
"""gymnasium's ``map_name: 4x4`` map (S start, F frozen, H hole, G goal)."""


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes the cached model; a change rebuilds it."""

    version: int = 3
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    episodes: int = 256
    expert: float = 0.75
    sft_steps: int = 160
    batch: int = 16
    lr: float = 1e-3
    seed: int = 0


RECIPE = Recipe()


def _move(cell: tuple[int, int], action: str) -> tuple[int, int]:
    dr, dc = ACTIONS[action]
    return min(max(cell[0] + dr, 0), 3), min(max(cell[1] + dc, 0), 3)


def expert_moves() -> dict[tuple[int, int], str]:
    """The first move of a shortest hole-free path to the goal, for every cell that has one (BFS from G)."""
    goal = next((r, c) for r, row in enumerate(LAKE_4X4) for c, x in enumerate(row) if x == "G")
    best: dict[tuple[int, int], str] = {}
    distance = {goal: 0}
    queue = deque([goal])
    while queue:
        cell = queue.popleft()
        for r in range(4):
            for c in range(4):
                if (r, c) in distance or LAKE_4X4[r][c] == "H":
                    continue
                for action in ACTIONS:
                    if _move((r, c), action) == cell:
                        distance[(r, c)], best[(r, c)] = distance[cell] + 1, action
                        queue.append((r, c))
                        break
    return best


def _episode(spec: EnvSpec, chat: TurnFormatter, tokenizer: Any, rng: random.Random) -> tuple[list[int], list[bool]]:
    """Tokens of one noisy-expert episode and the mask of the answer tokens."""
    env = make_env(spec.env_type, spec.env_config)
    observation, cell, moves = env.reset(rng.randrange(1 << 30)), (0, 0), expert_moves()
    tokens = chat.first_prompt(f"{env.instructions}\n{user_turn(spec, observation, 1)}")
    mask = [False] * len(tokens)
    for turn in range(1, spec.max_steps + 1):
        action = moves[cell] if rng.random() < RECIPE.expert else rng.choice(list(ACTIONS))
        answer = list(tokenizer(f"<answer>{action}</answer>", add_special_tokens=False)["input_ids"])
        answer.append(tokenizer.eos_token_id)
        tokens, mask = tokens + answer, mask + [True] * len(answer)
        result = env.step(f"<answer>{action}</answer>")
        cell = _move(cell, action)
        if result.terminated or result.truncated or turn == spec.max_steps:
            break
        following = chat.continuation("<|im_end|>", user_turn(spec, result.observation, turn + 1))
        tokens, mask = tokens + following, mask + [False] * len(following)
    env.close()
    return tokens, mask


def _corpus(spec: EnvSpec) -> list[str]:
    """Texts the tokenizer is trained on: instructions, templates, observations of every cell, the answers."""
    env = make_env(spec.env_type, spec.env_config)
    texts = [env.instructions, spec.agent_system_template, *(f"<answer>{a}</answer>" for a in ACTIONS)]
    for seed in range(8):
        observation = env.reset(seed)
        for turn, action in enumerate(["Right", "Right", "Down", "Down", "Down", "Right"], start=1):
            texts.append(user_turn(spec, observation, turn))
            result = env.step(f"<answer>{action}</answer>")
            if result.terminated or result.truncated:
                break
            observation = result.observation
    env.close()
    return texts


def demo_model(cache_dir: Path, spec: EnvSpec, log: Callable[[str], None] = print) -> Path:
    """The warmed-up model folder for episodes of ``spec`` (built and cached on first use)."""
    folder = cache_dir / "warm"
    stamp_file = folder / "recipe.json"
    stamp = {**asdict(RECIPE), "spec": hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()}
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(folder, _corpus(spec), vocab_size=1000)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    build_tiny_causal_lm(folder, vocab_size=len(tokenizer), hidden_size=RECIPE.hidden,
                         intermediate_size=4 * RECIPE.hidden, num_hidden_layers=RECIPE.layers,
                         num_attention_heads=RECIPE.heads, num_key_value_heads=RECIPE.kv_heads, seed=RECIPE.seed,
                         max_position_embeddings=1024)  # fmt: skip
    rng = random.Random(RECIPE.seed)
    chat = TurnFormatter(tokenizer, spec.agent_system_template)
    rows = [_episode(spec, chat, tokenizer, rng) for _ in range(RECIPE.episodes)]
    _warm_up(folder, rows, tokenizer.pad_token_id, log)
    stamp_file.write_text(json.dumps(stamp))
    return folder


def _warm_up(folder: Path, rows: list[tuple[list[int], list[bool]]], pad_id: int, log: Callable[[str], None]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    rng = random.Random(RECIPE.seed)
    torch.manual_seed(RECIPE.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE.lr)
    model.train()
    for step in range(RECIPE.sft_steps):
        batch = rng.sample(rows, RECIPE.batch)
        width = max(len(tokens) for tokens, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (tokens, mask) in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            attention[row, : len(tokens)] = 1
            trained = torch.tensor(mask)
            labels[row, : len(tokens)] = torch.where(trained, torch.tensor(tokens), torch.tensor(-100))
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 40 == 0:
            log(f"[demo] warm-up step {step}: loss {loss.item():.3f}")
    model.save_pretrained(str(folder))

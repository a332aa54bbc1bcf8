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
from apps.agentic.env_sections import EnvSpec
from apps.agentic.envs import make_env
from apps.agentic.rollout import Turn, user_turn
from apps.agentic.step_rollout import step_user_message
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

ACTIONS = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
LAKE_4X4 = ("SFFF", "FHFH", "FFFH", "HFFG")
"""gymnasium's ``map_name: 4x4`` map (S start, F frozen, H hole, G goal)."""


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes the cached model; a change rebuilds it."""

    version: int = 6
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    episodes: int = 256
    expert: float = 0.75
    sft_steps: int = 600
    """At most this many supervised steps ..."""
    check_every: int = 10
    """... checking the greedy path every this many ..."""
    target: float = 0.75
    """... and stopping once the expert's move has at least this probability at every turn of its path."""
    batch: int = 16
    lr: float = 3e-3
    seed: int = 0


RECIPE = Recipe()
Specs = dict[str, EnvSpec]
"""The spec of each sample layout the warm-up trains on: ``trajectory`` (always) and ``step``."""


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


def noisy_expert(rng: random.Random) -> Callable[[tuple[int, int]], str]:
    """The warm-up's teacher: the shortest-path move with probability ``RECIPE.expert``, else a uniform move."""
    moves = expert_moves()
    return lambda cell: moves[cell] if cell in moves and rng.random() < RECIPE.expert else rng.choice(list(ACTIONS))


@dataclass(frozen=True)
class PlayedTurn:
    """One turn of a scripted episode: what was seen, what was answered, what it earned."""

    observation: str
    action: str
    reward: float


def play(spec: EnvSpec, choose: Callable[[tuple[int, int]], str], seed: int = 0) -> tuple[str, list[PlayedTurn]]:
    """The environment's instructions and the turns of one episode whose move in each cell is ``choose(cell)``."""
    env = make_env(spec.env_type, spec.env_config)
    observation, cell, turns = env.reset(seed), (0, 0), []
    for turn in range(1, spec.max_steps + 1):
        action = choose(cell)
        result = env.step(f"<answer>{action}</answer>")
        turns.append(PlayedTurn(observation, action, float(result.reward)))
        cell, observation = _move(cell, action), result.observation
        if result.terminated or result.truncated or turn == spec.max_steps:
            break
    instructions = env.instructions
    env.close()
    return instructions, turns


def _answer(tokenizer: Any, action: str) -> list[int]:
    return [*tokenizer(f"<answer>{action}</answer>", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def episode_tokens(spec: EnvSpec, chat: TurnFormatter, tokenizer: Any, choose: Callable[[tuple[int, int]], str],
                   seed: int = 0) -> tuple[list[int], list[bool]]:  # fmt: skip
    """Tokens of one episode whose move in each cell is ``choose(cell)``, formatted as the pipeline formats it
    (``apps.agentic.rollout``: first prompt, answer + end of turn, continuation), and the mask of the answers."""
    return trajectory_row(spec, chat, tokenizer, *play(spec, choose, seed))


def trajectory_row(spec: EnvSpec, chat: TurnFormatter, tokenizer: Any, instructions: str,
                   turns: list[PlayedTurn]) -> tuple[list[int], list[bool]]:  # fmt: skip
    """A played episode as one conversation (whole-episode samples) and the mask of its answers."""
    tokens = chat.first_prompt(f"{instructions}\n{user_turn(spec, turns[0].observation, 1)}")
    mask = [False] * len(tokens)
    for number, turn in enumerate(turns, start=1):
        answer = _answer(tokenizer, turn.action)
        tokens, mask = tokens + answer, mask + [True] * len(answer)
        if number < len(turns):
            following = chat.continuation(tokenizer.eos_token, user_turn(spec, turns[number].observation, number + 1))
            tokens, mask = tokens + following, mask + [False] * len(following)
    return tokens, mask


def step_rows(spec: EnvSpec, chat: TurnFormatter, tokenizer: Any, instructions: str,
              turns: list[PlayedTurn]) -> list[tuple[list[int], list[bool]]]:  # fmt: skip
    """A played episode as step samples (``apps.agentic.step_rollout``): each turn's prompt and its answer."""
    rows: list[tuple[list[int], list[bool]]] = []
    done: list[Turn] = []
    for turn in turns:
        prompt = chat.first_prompt(step_user_message(spec, instructions, done, turn.observation))
        answer = _answer(tokenizer, turn.action)
        rows.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
        done.append(Turn([], [], [], turn.reward, turn.observation, f"<answer>{turn.action}</answer>", turn.action))
    return rows


def _corpus(specs: Specs) -> list[str]:
    """Texts the tokenizer is trained on: instructions, templates, observations of every cell, the answers."""
    spec = specs["trajectory"]
    env = make_env(spec.env_type, spec.env_config)
    texts = [env.instructions, spec.agent_system_template or "", *(f"<answer>{a}</answer>" for a in ACTIONS)]
    for seed in range(8):
        observation = env.reset(seed)
        for turn, action in enumerate(["Right", "Right", "Down", "Down", "Down", "Right"], start=1):
            texts.append(user_turn(spec, observation, turn))
            result = env.step(f"<answer>{action}</answer>")
            if result.terminated or result.truncated:
                break
            observation = result.observation
    env.close()
    if "step" in specs:
        path = iter(["Right", "Right", "Down", "Down", "Down", "Right"])
        instructions, turns = play(specs["step"], lambda cell: next(path))
        done = [Turn([], [], [], t.reward, t.observation, "", t.action) for t in turns]
        texts += [step_user_message(specs["step"], instructions, done[:i], t.observation) for i, t in enumerate(turns)]
    return texts


def demo_model(cache_dir: Path, spec: EnvSpec, log: Callable[[str], None] = print,
               step_spec: EnvSpec | None = None) -> Path:  # fmt: skip
    """The warmed-up model folder for episodes of ``spec`` as whole conversations and, with ``step_spec``, also as
    StepEnvManager's per-turn prompts of ``step_spec`` (built and cached on first use).

    The cache is reused only when its stamp matches the recipe, the tokenizer's corpus and the warm-up rows rebuilt
    with the cached tokenizer: a change to the templates, the environment's text or the episode format rebuilds it.
    """
    folder = cache_dir / "warm"
    stamp_file = folder / "recipe.json"
    specs: Specs = {"trajectory": spec} if step_spec is None else {"trajectory": spec, "step": step_spec}
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == _stamp(folder, specs):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(folder, _corpus(specs), vocab_size=1000)
    tokenizer = _tokenizer(folder)
    build_tiny_causal_lm(folder, vocab_size=len(tokenizer), hidden_size=RECIPE.hidden,
                         intermediate_size=4 * RECIPE.hidden, num_hidden_layers=RECIPE.layers,
                         num_attention_heads=RECIPE.heads, num_key_value_heads=RECIPE.kv_heads, seed=RECIPE.seed,
                         max_position_embeddings=1024)  # fmt: skip
    # Read the tokenizer again now that config.json is there: transformers resolves AutoTokenizer through the
    # model's config when it exists, and the pipeline loads it that way.
    tokenizer = _tokenizer(folder)
    _warm_up(folder, warm_up_rows(specs, tokenizer), tokenizer, specs, log)
    stamp_file.write_text(json.dumps(_stamp(folder, specs)))
    return folder


def warm_up_rows(specs: Specs, tokenizer: Any) -> list[tuple[list[int], list[bool]]]:
    """The warm-up's training rows: ``RECIPE.episodes`` noisy-expert episodes (tokens, answer mask), each in every
    layout of ``specs``."""
    rng = random.Random(RECIPE.seed)
    spec = specs["trajectory"]
    chat, teacher = TurnFormatter(tokenizer, spec.agent_system_template), noisy_expert(rng)
    rows = []
    for _ in range(RECIPE.episodes):
        instructions, turns = play(spec, teacher, rng.randrange(1 << 30))
        rows.append(trajectory_row(spec, chat, tokenizer, instructions, turns))
        if "step" in specs:
            rows += step_rows(specs["step"], chat, tokenizer, instructions, turns)
    return rows


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _stamp(folder: Path, specs: Specs) -> dict[str, Any]:
    """What the cached model was built from: recipe, specs (one per layout), tokenizer corpus and training rows."""
    stamp: dict[str, Any] = {**asdict(RECIPE), "corpus": _digest(_corpus(specs)),
                             **{f"spec/{layout}": _digest(asdict(spec)) for layout, spec in specs.items()}}  # fmt: skip
    if (folder / "tokenizer.json").exists():
        stamp["rows"] = _digest(warm_up_rows(specs, _tokenizer(folder)))
    return stamp


def expert_path_probabilities(model: Any, tokenizer: Any, spec: EnvSpec, layout: str = "trajectory") -> list[float]:
    """The model's probability of the expert's move at each turn of the expert's episode in ``layout``
    (teacher-forced): all above 0.5 means the greedy policy walks the shortest path to the goal."""
    moves = expert_moves()
    chat = TurnFormatter(tokenizer, spec.agent_system_template)
    instructions, turns = play(spec, lambda cell: moves[cell])
    if layout == "step":
        rows = step_rows(spec, chat, tokenizer, instructions, turns)
    else:
        rows = [trajectory_row(spec, chat, tokenizer, instructions, turns)]
    offset = len(tokenizer("<answer>", add_special_tokens=False)["input_ids"])
    found = []
    for tokens, mask in rows:
        starts = [i for i in range(len(mask)) if mask[i] and not mask[i - 1]]
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([tokens])).logits[0], dim=-1)
        found += [float(log_probs[i + offset - 1, tokens[i + offset]].exp()) for i in starts]
    return found


def _warm_up(folder: Path, rows: list[tuple[list[int], list[bool]]], tokenizer: Any, specs: Specs,
             log: Callable[[str], None]) -> None:  # fmt: skip
    """Supervised steps on random batches of ``rows`` until the greedy policy walks the expert's path with some
    margin (checked every ``RECIPE.check_every`` steps), at most ``RECIPE.sft_steps``."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(folder))
    rng = random.Random(RECIPE.seed)
    torch.manual_seed(RECIPE.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE.lr)
    for step in range(1, RECIPE.sft_steps + 1):
        model.train()
        loss = _sft_loss(model, rng.sample(rows, RECIPE.batch), tokenizer.pad_token_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % RECIPE.check_every == 0:
            model.eval()
            path = _paths(model, tokenizer, specs)
            log(f"[demo] warm-up step {step}: loss {loss.item():.3f}, p(expert move) along the path "
                f"{' '.join(f'{p:.2f}' for p in path)}")  # fmt: skip
            if min(path) >= RECIPE.target:
                model.save_pretrained(str(folder))
                _check_saved(folder, specs, path)
                return
    raise RuntimeError(
        f"the agentic demo's warm-up did not reach p(expert move) >= {RECIPE.target} along the expert's path in "
        f"{RECIPE.sft_steps} steps; raise Recipe.sft_steps in {__file__}."
    )


def _paths(model: Any, tokenizer: Any, specs: Specs) -> list[float]:
    """p(expert move) along the expert's path in every layout of ``specs``."""
    return [p for layout, spec in specs.items() for p in expert_path_probabilities(model, tokenizer, spec, layout)]


def _check_saved(folder: Path, specs: Specs, path: list[float]) -> None:
    """The folder read back as the pipeline reads it (model and tokenizer) must pass the check as trained."""
    from transformers import AutoModelForCausalLM

    saved: Any = AutoModelForCausalLM.from_pretrained(str(folder))
    saved.eval()
    again = _paths(saved, _tokenizer(folder), specs)
    if max(abs(a - b) for a, b in zip(again, path, strict=True)) > 1e-4:
        raise RuntimeError(
            f"the warm-up model saved to {folder} reads back different: p(expert move) {again} vs {path}"
        )


def _sft_loss(model: Any, batch: list[tuple[list[int], list[bool]]], pad_id: int) -> Any:
    """Next-token loss on the answer tokens of ``batch`` (right-padded)."""
    width = max(len(tokens) for tokens, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (tokens, mask) in enumerate(batch):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
        labels[row, : len(tokens)] = torch.where(torch.tensor(mask), torch.tensor(tokens), torch.tensor(-100))
    return model(input_ids=ids, attention_mask=attention, labels=labels).loss

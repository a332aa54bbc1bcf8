"""The CPU demo's model: a tiny Qwen2 and tokenizer built locally, warmed up on single-digit addition.

The warm-up is a short supervised pass (loss on the answer tokens only) that leaves the model right some of the time,
so that RL has something to sharpen; it is cached under ``cache_dir`` and rebuilt only when the recipe changes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes the cached model; a change rebuilds it."""

    version: int = 3
    hidden: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    sft_steps: int = 150
    lr: float = 1e-3
    seed: int = 0


RECIPE = Recipe()


def problems() -> list[tuple[str, str]]:
    """(prompt, answer) for every single-digit addition: ``("3+5=", "8")``."""
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def demo_model(
    cache_dir: Path,
    log: Callable[[str], None] = print,
    rows: Callable[[], list[tuple[str, str]]] = problems,
    recipe: Recipe = RECIPE,
) -> Path:
    """The model folder warmed up by ``recipe`` on ``rows()`` (prompt, answer) pairs; built and cached on first
    use, rebuilt when either changes."""
    folder = cache_dir / "warm"
    stamp = folder / "recipe.json"
    made_of = asdict(recipe) if rows is problems else json.loads(json.dumps({**asdict(recipe), "rows": rows()}))
    if stamp.exists() and json.loads(stamp.read_text()) == made_of:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    corpus = [f"{p}{a}" for p, a in rows()] + ["<answer></answer> the answer is"]
    build_tiny_tokenizer(folder, corpus, vocab_size=300)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(folder)))
    build_tiny_causal_lm(folder, vocab_size=vocab, hidden_size=recipe.hidden, intermediate_size=4 * recipe.hidden,
                         num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
                         num_key_value_heads=recipe.kv_heads, seed=recipe.seed)  # fmt: skip
    _warm_up(folder, log, rows(), recipe)
    stamp.write_text(json.dumps(made_of))
    return folder


def _examples(tokenizer: Any, pairs: list[tuple[str, str]] | None = None) -> list[tuple[list[int], int]]:
    """Token ids of prompt + answer + end-of-turn, and where the answer starts."""
    rows = []
    for prompt, answer in pairs or problems():
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        prefix = tokenizer(text, add_special_tokens=False)["input_ids"]
        target = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((prefix + target, len(prefix)))
    return rows


def _warm_up(folder: Path, log: Callable[[str], None], pairs: list[tuple[str, str]], recipe: Recipe) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    rows = _examples(tokenizer, pairs)
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    model.train()
    for step in range(recipe.sft_steps):
        batch = rng.sample(rows, 32)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (tokens, start) in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            labels[row, start : len(tokens)] = torch.tensor(tokens[start:])
            mask[row, : len(tokens)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            log(f"[demo] warm-up step {step}: loss {loss.item():.3f}")
    model.save_pretrained(str(folder))


@dataclass(frozen=True)
class PolicyScore:
    """How well a model folder adds, over every problem: what the demo promises and its tests check."""

    greedy_accuracy: float
    """Fraction of problems whose greedy answer is the sum."""
    answer_probability: float
    """Mean probability of the exact answer (sum, then end of turn): the expected reward of sampling at T=1."""


def score_policy(folder: Path) -> PolicyScore:
    """Greedy accuracy and mean answer probability of the model in ``folder`` (teacher-forced, in this process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder))
    model.eval()
    correct, probability = 0, 0.0
    with torch.no_grad():
        for (tokens, start), (_, answer) in zip(_examples(tokenizer), problems(), strict=True):
            prompt = torch.tensor([tokens[:start]])
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(tokens) - start,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            correct += int(str(tokenizer.decode(out[0, start:], skip_special_tokens=True)).strip() == answer)
            log_probs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, start - 1 : -1], dim=-1)
            probability += float(log_probs.gather(1, torch.tensor(tokens[start:])[:, None]).sum().exp())
    return PolicyScore(correct / len(problems()), probability / len(problems()))

"""The vision-language CPU demo: a tiny Qwen2.5-VL learns, by GRPO alone, to count the red squares in a picture.

``python -m apps.rlvr.demo_vl [key=value ...]`` builds (once, cached in ``.cache/rlvr_demo_vl``) a tiny Qwen2.5-VL
warmed up to answer every picture with a count of 1, 2 or 3 *at random* (its warm-up labels ignore the picture, so
it starts at chance, 1/3), draws the pictures (56 x 56, one to three of its four 28-pixel quarters red, the others
white: each quarter is one image token after the 2 x 2 merge), runs ``apps/rlvr/configs/rlvr_cpu_demo_vl.yaml`` and
prints the mean reward of the first and last steps. Only the reward tells the model which count is right, and only
the picture tells it the count.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from rl_engines.vision import token_types

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "configs" / "rlvr_cpu_demo_vl.yaml"
QUESTION = "<image>How many red squares?"
COUNTS = (1, 2, 3)
SIDE, CELL = 56, 28
WINDOW = 5


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes the cached model; a change rebuilds it."""

    version: int = 3
    hidden: int = 64
    layers: int = 2
    vision_depth: int = 2
    sft_steps: int = 40
    lr: float = 2e-3
    seed: int = 0


RECIPE = Recipe()


def picture(count: int, seed: int) -> Any:
    """A white 56 x 56 picture with ``count`` red squares, each filling one of its four 28-pixel quarters (chosen by
    ``seed``)."""
    from PIL import Image

    pixels = np.full((SIDE, SIDE, 3), 255, dtype=np.uint8)
    cells = random.Random(seed).sample(range((SIDE // CELL) ** 2), count)
    for cell in cells:
        row, col = divmod(cell, SIDE // CELL)
        pixels[row * CELL : (row + 1) * CELL, col * CELL : (col + 1) * CELL] = (220, 20, 20)
    return Image.fromarray(pixels)


def tasks(size: int = 48, seed: int = 0) -> list[tuple[int, int]]:
    """``size`` (count, picture seed) pairs, the counts balanced."""
    return [(COUNTS[i % len(COUNTS)], seed * 1000 + i) for i in range(size)]


def write_data(folder: Path, rows: Sequence[tuple[int, int]]) -> Path:
    """The pictures as PNG files and a jsonl of ROLL-style records (chat ``messages``, ``images``, ``ground_truth``)."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for count, seed in rows:
        path = folder / "images" / f"{seed}.png"
        picture(count, seed).save(path)
        lines.append(json.dumps({"messages": [{"role": "user", "content": QUESTION}], "images": [str(path)],
                                 "ground_truth": str(count)}))  # fmt: skip
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "train.jsonl"


def demo_vl_model(cache_dir: Path, log: Callable[[str], None] = print, recipe: Recipe = RECIPE) -> Path:
    """The tiny Qwen2.5-VL warmed up by ``recipe``: it answers a digit 1 to 3 and stops, whatever the picture."""
    from rl_engines.tiny_model import build_tiny_vl_model

    folder = cache_dir / "warm"
    stamp = folder / "recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(recipe):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    build_tiny_vl_model(folder, [QUESTION, "1 2 3 red squares"], hidden_size=recipe.hidden,
                        num_hidden_layers=recipe.layers, vision_depth=recipe.vision_depth,
                        seed=recipe.seed)  # fmt: skip
    _warm_up(folder, log, recipe)
    stamp.write_text(json.dumps(asdict(recipe)))
    return folder


def _examples(folder: Path, rows: Sequence[tuple[int, int]], answers: Sequence[int]) -> list[dict[str, Any]]:
    """Teacher-forcing inputs: prompt + answer digit + end of turn, with the picture's visual inputs."""
    from transformers import AutoTokenizer

    from rl_engines.vision import encode_prompt, load_image_processor

    tokenizer, processor = AutoTokenizer.from_pretrained(str(folder)), load_image_processor(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    out = []
    for (count, seed), answer in zip(rows, answers, strict=True):
        prompt, visual = encode_prompt(str(text), [picture(count, seed)], tokenizer, processor)
        target = tokenizer(f"{answer}<|im_end|>", add_special_tokens=False)["input_ids"]
        out.append({"ids": torch.tensor([prompt + target]), "start": len(prompt), "visual": visual})
    return out


def _warm_up(folder: Path, log: Callable[[str], None], recipe: Recipe) -> None:
    from transformers import AutoModelForImageTextToText

    rng = random.Random(recipe.seed)
    rows = tasks(96, seed=7)
    examples = _examples(folder, rows, [rng.choice(COUNTS) for _ in rows])  # labels blind to the picture
    model = AutoModelForImageTextToText.from_pretrained(str(folder))
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    model.train()
    for step in range(recipe.sft_steps):
        batch = rng.sample(examples, 16)  # one question, same-size pictures: the rows have one length
        ids, start = torch.cat([example["ids"] for example in batch]), batch[0]["start"]
        visual = {key: torch.cat([example["visual"][key] for example in batch]) for key in batch[0]["visual"]}
        types = token_types(ids, model.config)  # the token types give the pictures' tokens their 3-D positions
        logits = model(input_ids=ids, mm_token_type_ids=types, **visual).logits[:, start - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, start:].flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0:
            log(f"[demo-vl] warm-up step {step}: loss {loss.item():.3f}")
    model.save_pretrained(str(folder))


def count_probability(folder: Path, rows: Sequence[tuple[int, int]]) -> float:
    """Mean probability of the right count among the counts' digits (the first answer token, renormalised over the
    three). A model blind to the picture gives every picture the same three probabilities, so on balanced counts it
    scores exactly 1 / 3; reading the pictures raises it smoothly towards 1."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    digits = [tokenizer(str(count), add_special_tokens=False)["input_ids"][0] for count in COUNTS]
    model: Any = AutoModelForImageTextToText.from_pretrained(str(folder))
    model.eval()
    total = 0.0
    with torch.no_grad():
        for example, (count, _) in zip(_examples(folder, rows, [c for c, _ in rows]), rows, strict=True):
            types = token_types(example["ids"], model.config)
            logits = model(input_ids=example["ids"], mm_token_type_ids=types, **example["visual"]).logits[0]
            logits = logits[example["start"] - 1]
            total += float(torch.softmax(logits[digits], dim=-1)[COUNTS.index(count)])
    return total / len(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 0."""
    from apps.rlvr.pipeline import RLVRPipeline

    start = time.perf_counter()
    args = list(argv or [])
    model = demo_vl_model(ROOT / ".cache" / "rlvr_demo_vl")
    output = Path(load_config(CONFIG, args)["output_dir"])
    data = write_data(output, tasks())
    overrides = [f"pretrain={model}", f"actor_train.data_args.file_name={data}", *args]
    history = RLVRPipeline(RLVRConfig.from_dict(load_config(CONFIG, overrides))).run()
    scores = [step["critic/score/mean"] for step in history]
    window = min(WINDOW, max(len(scores) // 2, 1))
    first, last = sum(scores[:window]) / window, sum(scores[-window:]) / window
    print(f"[demo-vl] mean reward (fraction of right counts): first {window} steps {first:.3f} -> last {window} "
          f"steps {last:.3f}; metrics in {output / 'metrics.jsonl'}; {time.perf_counter() - start:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Multi-domain RLVR on a CPU: math, code and multiple choice in every batch, each graded by its own reward.

``python -m apps.rlvr.demo_multidomain [key=value ...]`` builds (once, cached in ``.cache/rlvr_multidomain``) a tiny
model warmed up on the three formats of single-digit addition, writes the prompts, runs
``apps/rlvr/configs/rlvr_cpu_multidomain.yaml`` and prints each domain's mean score over the first and last steps:

- ``math`` (``math_rule``): ``"3+5="`` -> ``8``;
- ``code`` (``code_sandbox``): ``"print 3+5"`` -> a program, run in the sandbox, that must print ``8``;
- ``mc`` (``crossthinkqa``, soft): ``"3+5? A:9 B:8"`` -> the letter of the sum.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.demo_model import RECIPE, demo_model

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "configs" / "rlvr_cpu_multidomain.yaml"
DOMAINS = {"math": "math_rule", "code": "code_sandbox", "mc": "crossthinkqa"}
"""Data tag -> reward section (its tag_included)."""
WINDOW = 5
WARM_UP = replace(RECIPE, sft_steps=300)
"""Three formats to learn: twice the addition demo's supervised steps."""


def records() -> list[dict[str, Any]]:
    """Every single-digit addition in each domain's format (the question as a one-turn chat, which the config's
    template formats), with what its reward grades against."""
    rows: list[dict[str, Any]] = []
    for a in range(10):
        for b in range(10):
            total = a + b
            rows.append({"tag": "math", **_asked(f"{a}+{b}="), "ground_truth": str(total), "answer": str(total)})
            rows.append({"tag": "code", **_asked(f"print {a}+{b}"), "case_type": "input", "answer": f"print({total})",
                         "test_cases": json.dumps([{"stdin": "", "expected_stdout": str(total)}])})  # fmt: skip
            wrong = total + 1 if (7 * a + b) % 2 or total == 0 else total - 1
            right_first = (a + 3 * b) % 2 == 0
            options = (total, wrong) if right_first else (wrong, total)
            letter = "A" if right_first else "B"
            rows.append({"tag": "mc", **_asked(f"{a}+{b}? A:{options[0]} B:{options[1]}"), "ground_truth": letter,
                         "answer": letter})  # fmt: skip
    return rows


def _asked(question: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}]}


def warm_up_pairs() -> list[tuple[str, str]]:
    """(question, answer) of every record: what the warm-up teaches."""
    return [(row["messages"][0]["content"], row["answer"]) for row in records()]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 0."""
    from apps.rlvr.pipeline import RLVRPipeline

    start = time.perf_counter()
    model = demo_model(ROOT / ".cache" / "rlvr_multidomain", rows=warm_up_pairs, recipe=WARM_UP)
    output = Path(load_config(CONFIG, list(argv or []))["output_dir"])
    data = output / "train.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("\n".join(json.dumps(row) for row in records()) + "\n")
    overrides = [f"pretrain={model}", f"actor_train.data_args.file_name={data}", *(argv or [])]
    history = RLVRPipeline(RLVRConfig.from_dict(load_config(CONFIG, overrides))).run()
    window = min(WINDOW, max(len(history) // 2, 1))
    for tag, section in DOMAINS.items():
        scores = [step[f"{section}/critic/score/mean"] for step in history]
        first, last = sum(scores[:window]) / window, sum(scores[-window:]) / window
        seconds = sum(step[f"time/reward/{section}"] for step in history) / len(history)
        validated = [(i, step[f"val/score/{section}"]) for i, step in enumerate(history) if "val/score/mean" in step]
        greedy = f"; greedy step {validated[0][0]} {validated[0][1]:.2f} -> step {validated[-1][0]} " \
                 f"{validated[-1][1]:.2f}" if len(validated) > 1 else ""  # fmt: skip
        print(f"[demo] {tag:4s} ({section}): mean score first {window} steps {first:.3f} -> last {window} steps "
              f"{last:.3f}{greedy}; grading {seconds:.2f} s/step")  # fmt: skip
    print(f"[demo] metrics in {output / 'metrics.jsonl'}, timeline in {output}; {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

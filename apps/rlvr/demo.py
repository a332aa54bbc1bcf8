"""The README's first job: RLVR with GRPO on a CPU, visibly learning single-digit addition.

``python -m apps.rlvr.demo [--lora] [key=value ...]`` builds (once, cached in ``.cache/rlvr_demo``) a tiny model
warmed up on the task, writes the prompts, runs ``apps/rlvr/configs/rlvr_cpu_demo.yaml`` (``--lora``:
``rlvr_cpu_demo_lora.yaml``, the same run training LoRA adapters) and prints the mean reward of the first and last
steps. Overrides go to the config (e.g. ``max_steps=10``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.demo_model import demo_model, problems

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "configs" / "rlvr_cpu_demo.yaml"
LORA_CONFIG = CONFIG.with_name("rlvr_cpu_demo_lora.yaml")
WINDOW = 5


def write_prompts(path: Path) -> Path:
    """Every single-digit addition as a jsonl row (the question as a one-turn chat, which the config's template
    formats) with its ground truth."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = ({"messages": [{"role": "user", "content": p}], "ground_truth": a} for p, a in problems())
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 0."""
    from apps.rlvr.pipeline import RLVRPipeline

    start = time.perf_counter()
    args = list(argv or [])
    config_file = LORA_CONFIG if "--lora" in args else CONFIG
    args = [arg for arg in args if arg != "--lora"]
    model = demo_model(ROOT / ".cache" / "rlvr_demo")
    output = Path(load_config(config_file, args)["output_dir"])
    data = write_prompts(output / "train.jsonl")
    overrides = [f"pretrain={model}", f"actor_train.data_args.file_name={data}", *args]
    config = RLVRConfig.from_dict(load_config(config_file, overrides))
    history = RLVRPipeline(config).run()
    scores = [step["critic/score/mean"] for step in history]
    window = min(WINDOW, max(len(scores) // 2, 1))
    first, last = sum(scores[:window]) / window, sum(scores[-window:]) / window
    print(f"[demo] mean reward (fraction of correct sums): first {window} steps {first:.3f} -> last {window} "
          f"steps {last:.3f}; metrics in {output / 'metrics.jsonl'}; {time.perf_counter() - start:.0f} s")  # fmt: skip
    validation = [(i, step["val/score/mean"]) for i, step in enumerate(history) if "val/score/mean" in step]
    if len(validation) > 1:
        print(f"[demo] greedy accuracy on all prompts: step {validation[0][0]} {validation[0][1]:.3f} -> step "
              f"{validation[-1][0]} {validation[-1][1]:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

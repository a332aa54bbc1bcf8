"""The agentic CPU demo: GRPO on FrozenLake 4x4 with a tiny model, success rate rising over the run.

``python -m apps.agentic.demo [key=value ...]`` builds (once, cached in ``.cache/agentic_demo``) a tiny model warmed
up on noisy-expert FrozenLake episodes, runs ``apps/agentic/configs/agentic_frozen_lake_cpu_demo.yaml`` and prints the
success rate of the first and last steps. Overrides go to the config (e.g. ``max_steps=10``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from apps.agentic.config import AgenticConfig
from apps.agentic.demo_model import demo_model
from apps.common.yaml_config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "configs" / "agentic_frozen_lake_cpu_demo.yaml"
WINDOW = 5


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 0."""
    from apps.agentic.pipeline import AgenticPipeline

    start = time.perf_counter()
    overrides = list(argv or [])
    spec = AgenticConfig.from_dict(load_config(CONFIG, overrides)).env_spec("FrozenLake")
    model = demo_model(ROOT / ".cache" / "agentic_demo", spec)
    config = AgenticConfig.from_dict(load_config(CONFIG, [f"pretrain={model}", *overrides]))
    history = AgenticPipeline(config).run()
    rates = [step["env/success_rate"] for step in history]
    window = min(WINDOW, max(len(rates) // 2, 1))
    first, last = sum(rates[:window]) / window, sum(rates[-window:]) / window
    metrics = Path(config.base.output_dir) / "metrics.jsonl"
    print(f"[demo] FrozenLake success rate: first {window} steps {first:.3f} -> last {window} steps {last:.3f}; "
          f"metrics in {metrics}; {time.perf_counter() - start:.0f} s")  # fmt: skip
    validation = [(i, step["val/success_rate"]) for i, step in enumerate(history) if "val/success_rate" in step]
    if len(validation) > 1:
        print(f"[demo] greedy success on held-out seeds: step {validation[0][0]} {validation[0][1]:.3f} -> step "
              f"{validation[-1][0]} {validation[-1][1]:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

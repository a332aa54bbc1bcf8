"""GiGPO on step samples next to trajectory-level GRPO on the CPU: FrozenLake 4x4, one tiny model, one budget.

``python -m apps.agentic.demo_gigpo [key=value ...]`` builds (once, cached in ``.cache/agentic_gigpo_demo``) a tiny
model warmed up on noisy-expert episodes in both sample layouts (whole conversations and per-turn prompts), then
runs ``apps/agentic/configs/agentic_frozen_lake_gigpo_cpu_demo.yaml`` twice with the same seeds, environments and
number of episodes: as it is (gigpo, StepEnvManager) and as trajectory-level GRPO (TrajEnvManager, one sample per
episode, episode scores normalised within their env group). It prints both success-rate curves and plots them
into ``<output_dir>/gigpo_vs_grpo.png``. Overrides go to both runs (e.g. ``max_steps=10``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from apps.agentic.config import AgenticConfig
from apps.agentic.demo_model import demo_model
from apps.common.plots import plot_runs
from apps.common.yaml_config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "configs" / "agentic_frozen_lake_gigpo_cpu_demo.yaml"
WINDOW = 5
RUNS = {
    "gigpo (step samples)": [],
    "grpo (whole episodes)": ["adv_estimator=grpo",
                              "custom_envs.FrozenLake.env_manager_cls=roll.pipeline.agentic.env_manager."
                              "traj_env_manager.TrajEnvManager"],
}  # fmt: skip


def _curve(history: list[dict[str, float]]) -> str:
    """Success rate averaged over windows of ``WINDOW`` steps."""
    rates = [step["env/success_rate"] for step in history]
    windows = [rates[i : i + WINDOW] for i in range(0, len(rates), WINDOW)]
    return " ".join(f"{sum(w) / len(w):.3f}" for w in windows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run both; returns 0."""
    from apps.agentic.pipeline import AgenticPipeline

    start = time.perf_counter()
    overrides = list(argv or [])
    spec = AgenticConfig.from_dict(load_config(CONFIG, overrides)).env_spec("FrozenLake")
    model = demo_model(ROOT / ".cache" / "agentic_gigpo_demo", spec, layouts=("trajectory", "step"))
    output = Path(AgenticConfig.from_dict(load_config(CONFIG, overrides)).base.output_dir)
    metrics, lines = {}, []
    for label, changes in RUNS.items():
        folder = output / label.split()[0]
        config = AgenticConfig.from_dict(
            load_config(CONFIG, [f"pretrain={model}", *changes, *overrides, f"output_dir={folder}"])
        )
        history = AgenticPipeline(config).run()
        metrics[label] = folder / "metrics.jsonl"
        validation = [f"{step['val/success_rate']:.3f}" for step in history if "val/success_rate" in step]
        lines.append(f"[demo] {label}: success rate per {WINDOW} steps {_curve(history)}; greedy on held-out seeds "
                     f"{' '.join(validation)}; samples per step {_samples(history)}")  # fmt: skip
    png = plot_runs(metrics, "env/success_rate", "FrozenLake success rate", output / "gigpo_vs_grpo.png")
    for line in lines:
        print(line)
    print(f"[demo] curves in {png}; {time.perf_counter() - start:.0f} s")
    return 0


def _samples(history: list[dict[str, float]]) -> str:
    """Mean trained samples per step (step samples after batch_adjust_mode, or episodes)."""
    counts = [step.get("system/step_samples", 0.0) + step.get("system/batch_add_count", 0.0) for step in history]
    return f"{sum(counts) / len(counts):.0f}" if any(counts) else "one per episode"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

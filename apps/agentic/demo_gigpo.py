"""GiGPO on step samples next to trajectory-level GRPO on the CPU: FrozenLake 4x4, one tiny model, one budget.

``python -m apps.agentic.demo_gigpo [key=value ...]`` builds (once, cached in ``.cache/agentic_gigpo_demo``) a tiny
model warmed up on noisy-expert episodes in both sample layouts (whole conversations, and per-turn prompts with
every earlier turn in their history window), then runs ``apps/agentic/configs/agentic_frozen_lake_gigpo_cpu_demo.yaml``
twice with the same seeds, environments and number of episodes: as it is (gigpo, StepEnvManager) and as
trajectory-level GRPO (TrajEnvManager, one sample per episode, episode scores normalised within their env group, the
same user turn without the history window). It prints both success-rate curves and plots them into
``<output_dir>/gigpo_vs_grpo.png``. Overrides go to both runs (e.g. ``max_steps=10``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from apps.agentic.config import AgenticConfig
from apps.agentic.demo_model import demo_model
from apps.common.plots import plot_runs
from apps.common.yaml_config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "configs" / "agentic_frozen_lake_gigpo_cpu_demo.yaml"
WINDOW = 5
TRAJECTORY = "roll.pipeline.agentic.env_manager.traj_env_manager.TrajEnvManager"
TRAJECTORY_TEMPLATE = "{observation}\nTurn {turn_idx}, {actions_left} left:"
"""The GRPO run's user turn: the step template without the history window (its conversation holds the turns)."""


def as_trajectory_grpo(raw: dict[str, Any]) -> dict[str, Any]:
    """The demo config as trajectory-level GRPO: whole episodes, scores normalised within their env group."""
    raw["adv_estimator"] = "grpo"
    raw["custom_envs"]["FrozenLake"].update(env_manager_cls=TRAJECTORY, agent_template=TRAJECTORY_TEMPLATE,
                                            history_length=None)  # fmt: skip
    return raw


RUNS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "gigpo (step samples)": lambda raw: raw,
    "grpo (whole episodes)": as_trajectory_grpo,
}


def _config(overrides: list[str], run: Callable[[dict[str, Any]], dict[str, Any]]) -> AgenticConfig:
    return AgenticConfig.from_dict(run(load_config(CONFIG, overrides)))


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
    step_spec = _config(overrides, RUNS["gigpo (step samples)"]).env_spec("FrozenLake")
    spec = _config(overrides, as_trajectory_grpo).env_spec("FrozenLake")
    model = demo_model(ROOT / ".cache" / "agentic_gigpo_demo", spec, step_spec=step_spec)
    output = Path(_config(overrides, RUNS["gigpo (step samples)"]).base.output_dir)
    metrics, lines = {}, []
    for label, run in RUNS.items():
        folder = output / label.split()[0]
        config = _config([f"pretrain={model}", *overrides, f"output_dir={folder}"], run)
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

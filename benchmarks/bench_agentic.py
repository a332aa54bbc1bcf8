"""Benchmark: the agentic pipeline's environments, rollouts and async steps (CPU, the agentic demo's model).

1. Environment steps per second: ``reset`` + ``step`` of FrozenLake 4x4 and Sokoban 6x6 (one box) with valid
   random actions, one environment in a loop, then N environments stepped through an ``EnvManager`` (its worker
   threads) per batch of actions. Baseline: the single environment loop.
2. Rollout throughput with N concurrent environments: ``TrajectoryRunner`` episodes on FrozenLake against
   ``hf_infer`` built in this process (one torch thread), N = 1, 4, 16, 32 environments per round. Every turn of
   every running environment is one generate call, so N environments share each call. Reported: episodes/s and
   sampled tokens/s; speed-up vs N = 1 measured in the same run.
3. Async vs sync step time: the demo config on Ray, train on slot 0 and infer on slot 1, ``async_generation_ratio``
   0 vs 1; median step time, and overlap efficiency = (sync - async) / (sync - ideal) with ideal =
   max(rollout, rest) + weight sync, as bench_rlvr.

Run: python benchmarks/bench_agentic.py [--steps 8] [--skip-envs] [--skip-rollout] [--skip-async]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # apps/ lives at the repository root

import torch
from bench_rlvr import LocalGroup

from apps.agentic.config import AgenticConfig, EnvManagerConfig
from apps.agentic.demo import CONFIG, ROOT
from apps.agentic.demo_model import demo_model
from apps.agentic.env_manager import EnvManager
from apps.agentic.envs import make_env
from apps.agentic.pipeline import AgenticPipeline
from apps.agentic.rollout import TrajectoryRunner
from apps.common.preflight import fill_model_paths
from apps.common.yaml_config import load_config
from rl_engines.role_worker import RoleWorker
from rl_engines.worker_group import WorkerBase

ENVS = {"FrozenLake": ("frozen_lake", {"map_name": "4x4"}, ["Left", "Down", "Right", "Up"]),
        "Sokoban": ("sokoban", {"dim_room": [6, 6], "num_boxes": 1}, ["Up", "Down", "Left", "Right"])}  # fmt: skip
ONE_THREAD = ["+system_envs.OMP_NUM_THREADS='1'", "+system_envs.MKL_NUM_THREADS='1'"]


def bench_config(folder: Path, overrides: list[str]) -> AgenticConfig:
    """The demo config with its model, no validation / checkpoints, plus ``overrides``."""
    spec = AgenticConfig.from_dict(load_config(CONFIG)).env_spec("FrozenLake")
    model = demo_model(ROOT / ".cache" / "agentic_demo", spec)
    base = [f"pretrain={model}", f"output_dir={folder}", "eval_steps=0", "save_steps=100000", "render_save_dir=null",
            *ONE_THREAD]  # fmt: skip
    config = AgenticConfig.from_dict(load_config(CONFIG, [*base, *overrides]))
    fill_model_paths(config.base)
    return config


def env_loop(kind: str, env_config: dict[str, Any], actions: list[str], seconds: float) -> float:
    """Steps per second of one environment (resets included, counted as steps)."""
    env, rng, steps = make_env(kind, env_config), random.Random(0), 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        env.reset(steps)
        done = False
        while not done:
            result = env.step(f"<answer>{rng.choice(actions)}</answer>")
            done, steps = result.terminated or result.truncated, steps + 1
    return steps / (time.perf_counter() - start)


def managed_steps(config: AgenticConfig, tag: str, envs: int, per_worker: int, seconds: float) -> float:
    """Steps per second of ``envs`` environments stepped in batches by one EnvManager."""
    section = EnvManagerConfig.from_dict({"num_env_groups": envs, "tags": [tag], "max_env_num_per_worker": per_worker},
                                         "bench")  # fmt: skip
    manager, rng, steps, round_index = EnvManager(config, section, "train"), random.Random(0), 0, 0
    actions = ENVS["FrozenLake" if "Frozen" in tag else "Sokoban"][2]
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        manager.reset(manager.seeds(0, round_index))
        running = set(range(envs))
        while running:
            results = manager.step({i: f"<answer>{rng.choice(actions)}</answer>" for i in running})
            steps += len(results)
            running = {i for i, r in results.items() if not (r.terminated or r.truncated)}
        round_index += 1
    manager.close()
    return steps / (time.perf_counter() - start)


def bench_envs(folder: Path) -> None:
    config = bench_config(folder, ["+custom_envs.Sokoban.env_type=sokoban",
                                   "+custom_envs.Sokoban.env_config.dim_room=[6,6]",
                                   "+custom_envs.Sokoban.env_config.max_steps=8"])  # fmt: skip
    print("\n== environment steps per second (valid random actions; resets count as steps) ==")
    for name, (kind, env_config, actions) in ENVS.items():
        tag = "FrozenLake" if name == "FrozenLake" else "Sokoban"
        single = env_loop(kind, {**env_config, "max_steps": 8}, actions, seconds=2.0)
        line = f"{name:<11} one env {single:>9.0f}/s"
        for envs, per_worker in ((16, 0), (64, 0), (64, 16)):
            rate = managed_steps(config, tag, envs, per_worker, seconds=2.0)
            workers = 1 if per_worker == 0 else envs // per_worker
            line += f" | {envs} envs, {workers} worker(s) {rate:>8.0f}/s ({rate / single:.2f}x)"
        print(line)


def local_infer(config: AgenticConfig) -> LocalGroup:
    worker = RoleWorker("actor_infer", 0, 1, "127.0.0.1", WorkerBase.free_port(), {}, config.base.actor_infer)
    worker.initialize()
    return LocalGroup(worker)


def bench_rollout(folder: Path) -> None:
    torch.set_num_threads(1)
    print("\n== rollout throughput: FrozenLake episodes against hf_infer in this process (1 thread) ==")
    baseline = None
    for envs in (1, 4, 16, 32):
        config = bench_config(folder, [f"train_env_manager.num_env_groups={envs}", "train_env_manager.group_size=1",
                                       f"rollout_batch_size={envs}"])  # fmt: skip
        infer, manager = local_infer(config), EnvManager(config, config.train_env_manager, "train")
        runner = TrajectoryRunner(manager, infer.worker.strategy.tokenizer, config.base.actor_infer.generating_args,
                                  config.sequence_length)  # fmt: skip
        rounds = max(1, 32 // envs)
        start = time.perf_counter()
        episodes = runner.run(infer, step=0, rounds=rounds)
        elapsed = time.perf_counter() - start
        tokens = sum(sum(e.mask) for e in episodes)
        rate = len(episodes) / elapsed
        baseline = baseline or rate
        print(f"{envs:>3} concurrent envs: {len(episodes)} episodes in {elapsed:6.2f} s = {rate:6.2f} episodes/s, "
              f"{tokens / elapsed:7.1f} sampled tokens/s ({rate / baseline:.2f}x vs 1 env)")  # fmt: skip
        manager.close()


def median(history: list[dict[str, float]], key: str) -> float:
    return statistics.median(row.get(key, 0.0) for row in history)


def bench_async(folder: Path, steps: int) -> None:
    separate = ["actor_train.device_mapping=[0]", "actor_infer.device_mapping=[1]",
                "actor_train.training_args.per_device_train_batch_size=32"]  # fmt: skip
    runs = {}
    for ratio in (0, 1):
        config = bench_config(folder / f"ratio{ratio}", [*separate, f"async_generation_ratio={ratio}"])
        pipeline = AgenticPipeline(config, log=lambda line: None)
        pipeline.start()
        try:
            runs[ratio] = [pipeline.step(step) for step in range(steps)][1:]
        finally:
            pipeline.stop()
    rollout, sync = median(runs[0], "time/generate_wait"), median(runs[0], "time/sync")
    sync_step, async_step = median(runs[0], "time/step"), median(runs[1], "time/step")
    rest = sync_step - rollout - sync
    ideal = max(rollout, rest) + sync
    efficiency = (sync_step - async_step) / (sync_step - ideal)
    print(f"\n== async_generation_ratio 1 vs 0, train and infer on separate CPU slots, median of {steps - 1} steps ==")
    print(f"sync step {sync_step:.3f} s = rollout {rollout:.3f} + rest {rest:.3f} + weight sync {sync:.3f}")
    print(f"async step {async_step:.3f} s (sync wait {median(runs[1], 'time/sync_wait'):.3f}); ideal {ideal:.3f} s; "
          f"speed-up {sync_step / async_step:.2f}x; overlap efficiency {efficiency:.1%} of the ideal saving; "
          f"staleness {median(runs[1], 'async/staleness/mean'):.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-envs", action="store_true")
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument("--skip-async", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_agentic_") as tmp:
        if not args.skip_envs:
            bench_envs(Path(tmp))
        if not args.skip_rollout:
            bench_rollout(Path(tmp))
        if not args.skip_async:
            bench_async(Path(tmp), args.steps)


if __name__ == "__main__":
    main()

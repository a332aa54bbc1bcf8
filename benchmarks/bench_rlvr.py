"""Benchmark: the RLVR pipeline's step, against baselines measured in the same run (CPU, the demo's model).

1. Per-step breakdown and framework overhead. The same ``RLVRPipeline.step`` runs twice: on Ray workers
   (train and infer colocated on one CPU slot, as the demo) and on the same strategies built in this process,
   called directly (no Ray, no dispatch, no serialisation; weight sync = one in-memory ``load_weights``). Both
   use one torch thread per worker and identical configs. Overhead = (Ray step - in-process step) / Ray step,
   from the median step times. Goal: <= 10%. The table lists generate, reward, logprobs, advantages, train
   and sync of both runs.
2. Async generation. Train on slot 0, infer on slot 1 (one thread each). The synchronous run gives generate
   ``g`` (``time/generate_wait``) and the rest ``r`` (everything else but the weight sync ``s``); the ideal
   async step is ``max(g, r) + s``. Overlap efficiency = (sync step - async step) / (sync step - ideal) with
   ``async_generation_ratio: 1``. Goal: >= 90%.

Run: python benchmarks/bench_rlvr.py [--steps 12] [--skip-overhead] [--skip-async] [--response-length 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the driver and in-process baseline: one thread, as each worker
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # apps/ lives at the repository root

import torch

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.demo import CONFIG, ROOT, write_prompts
from apps.rlvr.demo_model import demo_model
from apps.rlvr.pipeline import RLVRPipeline
from rl_core.batch import RolloutBatch
from rl_engines.role_worker import RoleWorker
from rl_engines.worker_group import WorkerBase

PHASES = ("rollout", "logprobs", "advantages", "train", "sync")
ONE_THREAD = ["+system_envs.OMP_NUM_THREADS='1'", "+system_envs.MKL_NUM_THREADS='1'"]


def bench_config(folder: Path, overrides: list[str]) -> RLVRConfig:
    """The demo config with its model and prompts, no validation / checkpoints, plus ``overrides``."""
    model = demo_model(ROOT / ".cache" / "rlvr_demo")
    data = write_prompts(folder / "train.jsonl")
    base = [f"pretrain={model}", f"actor_train.data_args.file_name={data}", f"output_dir={folder}", "eval_steps=0",
            "save_steps=100000", *ONE_THREAD]  # fmt: skip
    return RLVRConfig.from_dict(load_config(CONFIG, [*base, *overrides]))


class LocalGroup:
    """One in-process RoleWorker behind the WorkerGroup calls the pipeline makes (world size 1)."""

    world_size = 1

    def __init__(self, worker: RoleWorker) -> None:
        self.worker = worker

    def call(self, method: str, *args: Any, dispatch: str = "one_to_all", **kwargs: Any) -> Any:
        result = getattr(self.worker, method)(*args, **kwargs)
        if dispatch == "rank_zero" or (dispatch == "dp_split" and isinstance(result, RolloutBatch)):
            return result  # what the dispatch mode's gather makes of one rank's answer
        return [result]

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = self.call(method, *args, **kwargs)
        return type("Done", (), {"get": lambda self: result, "done": lambda self: True})()


class LocalRoles:
    """Every role's strategy in this process; ``activate`` is free (nothing to offload)."""

    def __init__(self, config: RLVRConfig) -> None:
        port = WorkerBase.free_port()
        self.groups = {}
        for role in ("actor_train", "actor_infer", "reference", "critic"):
            section = getattr(config, role)
            if section is not None:
                worker = RoleWorker(role, 0, 1, "127.0.0.1", port, {}, section)
                worker.initialize()
                self.groups[role] = LocalGroup(worker)

    def __getitem__(self, role: str) -> LocalGroup:
        return self.groups[role]

    def activate(self, role: str) -> None:
        return None


class LocalUpdater:
    """Weight sync as a direct copy: infer.load_weights(train.named_weights())."""

    def __init__(self, roles: LocalRoles) -> None:
        self.train, self.infer = roles["actor_train"].worker, roles["actor_infer"].worker

    def sync(self) -> dict[str, float]:
        self.infer.strategy.load_weights(self.train.strategy.named_weights())
        return {}


def run_steps(pipeline: RLVRPipeline, steps: int, local: bool) -> list[dict[str, float]]:
    """``steps`` pipeline steps (the first is a warm-up and dropped)."""
    if local:
        torch.set_num_threads(1)
        roles = LocalRoles(pipeline.config)
        pipeline.roles, pipeline.updater = roles, LocalUpdater(roles)  # type: ignore[assignment]
    else:
        pipeline.start()
    try:
        return [pipeline.step(step) for step in range(steps)][1:]
    finally:
        if not local:
            pipeline.stop()


def median(history: list[dict[str, float]], key: str) -> float:
    return statistics.median(row.get(key, 0.0) for row in history)


def bench_overhead(folder: Path, steps: int) -> None:
    colocated = ["num_gpus_per_node=1", "actor_train.device_mapping=[0]", "actor_infer.device_mapping=[0]",
                 "actor_train.training_args.gradient_accumulation_steps=8"]  # fmt: skip
    runs = {}
    for name, local in (("in-process", True), ("ray", False)):
        pipeline = RLVRPipeline(bench_config(folder / name, colocated), log=lambda line: None)
        runs[name] = run_steps(pipeline, steps, local)
    print(f"\n== RLVR step breakdown: demo model, 16 prompts x 8 samples, median of {steps - 1} steps (s) ==")
    print(f"{'phase':<12}" + "".join(f"{name:>12}" for name in runs))
    for phase in (*PHASES, "step"):
        print(f"{phase:<12}" + "".join(f"{median(history, f'time/{phase}'):>12.3f}" for history in runs.values()))
    ray_step, local_step = median(runs["ray"], "time/step"), median(runs["in-process"], "time/step")
    overhead = (ray_step - local_step) / ray_step
    print(f"framework overhead (Ray + dispatch + serialisation): {overhead:.1%} of the step (goal <= 10%)")


def bench_async(folder: Path, steps: int, response_length: int) -> None:
    separate = ["num_gpus_per_node=2", "actor_train.device_mapping=[0]", "actor_infer.device_mapping=[1]",
                "actor_train.training_args.gradient_accumulation_steps=8",
                f"response_length={response_length}"]  # fmt: skip
    runs = {}
    for ratio in (0, 1):
        config = bench_config(folder / f"ratio{ratio}", [*separate, f"async_generation_ratio={ratio}"])
        runs[ratio] = run_steps(RLVRPipeline(config, log=lambda line: None), steps, local=False)
    generate = median(runs[0], "time/generate_wait")
    sync = median(runs[0], "time/sync")
    sync_step, async_step = median(runs[0], "time/step"), median(runs[1], "time/step")
    rest = sync_step - generate - sync
    ideal = max(generate, rest) + sync
    efficiency = (sync_step - async_step) / (sync_step - ideal)
    print(f"\n== async_generation_ratio 1 vs 0, train and infer on separate CPU slots, median of {steps - 1} steps ==")
    print(f"sync step {sync_step:.3f} s = generate {generate:.3f} + rest {rest:.3f} + weight sync {sync:.3f}")
    for ratio, history in runs.items():
        print(f"ratio {ratio}: " + " ".join(f"{key}={median(history, f'time/{key}'):.3f}"
                                          for key in (*PHASES, "generate_wait", "step")))  # fmt: skip
    print(f"async step {async_step:.3f} s; ideal max(generate, rest) + sync = {ideal:.3f} s")
    print(f"overlap efficiency {efficiency:.1%} of the ideal saving (goal >= 90%); staleness "
          f"{median(runs[1], 'async/staleness/mean'):.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-async", action="store_true")
    parser.add_argument("--response-length", type=int, default=40, help="async part: balances generate and train")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_rlvr_") as tmp:
        if not args.skip_overhead:
            bench_overhead(Path(tmp), args.steps)
        if not args.skip_async:
            bench_async(Path(tmp), args.steps, args.response_length)


if __name__ == "__main__":
    main()

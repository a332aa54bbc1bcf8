"""Benchmark: rl-engines weight sync and Ray dispatch, each against a baseline measured in the same run.

1. Weight sync train -> infer (ROLL's model_update) of a model of ``--hidden`` x ``--layers`` (default ~120 MB of
   fp32 weights), colocated (persistent shared-memory slots) and separate (a gloo broadcast group), against a
   plain memory copy of the same bytes (``torch.Tensor.copy_`` into preallocated buffers, measured before and
   between the modes; the median is the baseline). Goal: colocated >= 50% of the memory copy.
2. Ray dispatch overhead: an empty remote call, a dp_split round trip of the train step's own batch, and of
   batches of 1 / 8 / 32 MiB to two ranks and back (the per-MB cost), against one training step of the tiny
   model (8 samples x 64 tokens) in this process. Goal: per-call overhead < 10% of the train step.

Run: python benchmarks/bench_engines.py [--repeat 5] [--hidden 512 --layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfig
from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec, RoleResources, plan_placement
from rl_engines.ray_cluster import ResourcePool, cpu_device_resources, start_ray, stop_ray
from rl_engines.roles import Roles
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer
from rl_engines.weight_sync import DEFAULT_BUCKET_BYTES
from rl_engines.worker_group import WorkerBase, WorkerGroup


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def build_model(folder: Path, hidden: int, layers: int, vocab: int) -> None:
    build_tiny_tokenizer(folder, [f"{a}+{b}={a + b}" for a in range(50) for b in range(50)], vocab_size=256)
    build_tiny_causal_lm(folder, vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=1,
                         tie_word_embeddings=False)  # fmt: skip


def config(folder: Path, role: str, devices: list[int], strategy: str) -> WorkerConfig:
    values = {
        "device_mapping": devices,
        "model_args": {"model_name_or_path": str(folder), "disable_gradient_checkpointing": True},
        "strategy_args": {"strategy_name": strategy},
    }
    return WorkerConfig.from_dict(values, role)


def memcpy_baseline(folder: Path) -> tuple[Callable[[], None], int]:
    """A copy of every weight into preallocated buffers, and the bytes it moves."""
    from transformers import AutoModelForCausalLM

    weights = list(AutoModelForCausalLM.from_pretrained(str(folder)).state_dict().values())
    targets = [torch.empty_like(w) for w in weights]

    def copy() -> None:
        for src, dst in zip(weights, targets):
            dst.copy_(src)

    return copy, sum(w.numel() * w.element_size() for w in weights)


def bench_sync(folder: Path, repeat: int, bucket_bytes: int) -> None:
    copy, nbytes = memcpy_baseline(folder)
    baseline = [timed(copy, repeat)]
    results = {}
    cluster = ClusterSpec(1, 2)
    for mode, infer_devices in (("colocated (shared memory)", [0]), ("separate (gloo broadcast)", [1])):
        configs = {"actor_train": config(folder, "actor_train", [0], "fsdp2_train"),
                   "actor_infer": config(folder, "actor_infer", infer_devices, "hf_infer")}  # fmt: skip
        with Roles(cluster, configs, rpc_timeout=600) as roles:
            updater = roles.model_updater(bucket_bytes=bucket_bytes)
            results[mode] = timed(lambda u=updater: u.sync(), repeat)
        baseline.append(timed(copy, repeat))  # the baseline again, between modes, for this noisy machine
    seconds = statistics.median(baseline)
    base_gbps = nbytes / seconds / 1e9
    print(f"\n== weight sync: {nbytes / 2**20:.0f} MiB of fp32 weights, {bucket_bytes / 2**20:.0f} MiB buckets ==")
    print(f"{'path':<34}{'median s':>10}{'GB/s':>9}{'vs memcpy':>11}")
    print(f"{'memcpy (copy_ into buffers)':<34}{seconds:>10.4f}{base_gbps:>9.2f}{1.0:>10.2f}x")
    for mode, median in results.items():
        gbps = nbytes / median / 1e9
        print(f"{mode:<34}{median:>10.4f}{gbps:>9.2f}{gbps / base_gbps:>10.2f}x")
    ratio = nbytes / results["colocated (shared memory)"] / 1e9 / base_gbps
    print(f"goal colocated >= 0.50x memcpy: {'met' if ratio >= 0.5 else 'NOT met'} ({ratio:.2f}x)")


class EchoWorker(WorkerBase):
    """A worker whose method returns its shard unchanged: what remains is dispatch cost."""

    def echo(self, batch: RolloutBatch) -> RolloutBatch:
        return batch

    def noop(self) -> None:
        return None


def train_step_seconds(folder: Path, repeat: int) -> tuple[float, RolloutBatch]:
    cfg = WorkerConfig.from_dict({"model_args": {"model_name_or_path": str(folder)},
                                  "training_args": {"per_device_train_batch_size": 8}}, "actor_train")  # fmt: skip
    strategy = create_strategy(cfg, "actor_train")
    strategy.initialize()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 250, (8, 64), generator=gen)
    batch = RolloutBatch({"prompts": tokens[:, :32], "responses": tokens[:, 32:], "input_ids": tokens,
                          "attention_mask": torch.ones(8, 64, dtype=torch.long),
                          "response_mask": torch.ones(8, 32, dtype=torch.bool),
                          "advantages": torch.randn(8, 32, generator=gen)})  # fmt: skip
    batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
    return timed(lambda: strategy.train_step(batch, ActorObjective()), repeat), batch


def bench_dispatch(tiny: Path, repeat: int) -> None:
    step, step_batch = train_step_seconds(tiny, repeat)
    print(f"\n== Ray dispatch vs one tiny-model train step ({step * 1e3:.1f} ms, 8 x 64 tokens, in-process) ==")
    print(f"{'call':<40}{'median ms':>10}{'% of step':>11}")
    cluster = ClusterSpec(1, 2)
    pool = ResourcePool(cluster)
    placement = plan_placement(cluster, [RoleResources("bench", [0, 1])]).roles["bench"]
    with WorkerGroup("bench", EchoWorker, placement, pool, rpc_timeout=600) as group:
        noop = timed(lambda: group.call("noop"), repeat * 20)
        print(f"{'noop on 2 ranks':<40}{noop * 1e3:>10.2f}{noop / step * 100:>10.1f}%")
        kib = sum(t.numel() * t.element_size() for t in step_batch.batch.values()) / 1024
        own = timed(lambda: group.call("echo", step_batch, dispatch="dp_split"), repeat * 4)
        label = f"dp_split of that step's batch ({kib:.0f} KiB)"
        print(f"{label:<40}{own * 1e3:>10.2f}{own / step * 100:>10.1f}%")
        for mib in (1, 8, 32):
            rows = 16
            cols = mib * 2**20 // 4 // rows
            batch = RolloutBatch({"x": torch.randn(rows, cols)})
            echo = timed(lambda b=batch: group.call("echo", b, dispatch="dp_split"), repeat)
            print(
                f"{f'dp_split {mib} MiB batch, 2 ranks, round trip':<40}{echo * 1e3:>10.2f}{echo / step * 100:>10.1f}%"
            )
    pool.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_BYTES // 2**20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big, tiny = Path(tmp, "big"), Path(tmp, "tiny")
        build_model(big, args.hidden, args.layers, args.vocab)
        build_model(tiny, 64, 2, 259)
        start_ray(num_cpus=2, resources=cpu_device_resources(ClusterSpec(1, 2)))
        try:
            bench_sync(big, args.repeat, args.bucket_mb * 2**20)
            bench_dispatch(tiny, args.repeat)
        finally:
            stop_ray(remove_temp_dir=True)


if __name__ == "__main__":
    main()

"""Benchmark: padding-free throughput of a train step and a log-prob pass: padded vs dynamic batching vs packing.

A realistic RL length mix: prompts of 50-400 tokens, responses log-normal (median ~1/8 of ``response_length``) with
a long tail cut at ``response_length``, as when a few samples run to the limit. One fsdp2_train strategy in this
process (a world of one; fp32 and sdpa unless ``--dtype`` / ``--attn`` say otherwise; CPU, or CUDA when visible) on
a small Qwen2 built locally (heads of 128 dimensions; hidden / 256 key/value heads, at least one), once per mode,
each mode in a fresh process so that its peak memory is its own:

- ``padded``: fixed micro-batches of ``--micro`` samples, every one as wide as the batch (the baseline);
- ``dynamic``: ``use_dynamic_batching_in_train`` / ``_in_infer`` with a budget of ``--micro`` x the median sample
  length (rounded to 64), a row per sample as wide as the longest in its pass (ROLL's layout);
- ``packing``: ``use_sequence_packing`` with ``algorithm: load_balance`` and the same number of tokens per pass
  (``max_packed_sequence_length_*``): each pass one row of real tokens, attention kept within each sample.

Reported per mode: real tokens per second of ``train_step`` and of ``compute_log_probs`` (median of ``--repeats``),
the fraction of the tokens the model processed that were padding, the largest pass (samples x width) and the peak
RSS of the process; and each mode's speed-up over ``padded`` measured in the same run.

Run: python benchmarks/bench_packing.py [--samples 32] [--response-length 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("padded", "dynamic", "packing")


def length_mix(samples: int, response_length: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts uniform in 50-400, responses log-normal with a tail to the limit."""
    rng = random.Random(seed)
    median = max(response_length // 8, 1)
    return [(rng.randint(50, 400), min(response_length, max(1, int(rng.lognormvariate(math.log(median), 1.0)))))
            for _ in range(samples)]  # fmt: skip


def build_batch(lengths: list[tuple[int, int]], response_length: int, vocab: int) -> Any:
    import torch

    from rl_core.batch import RolloutBatch

    prompt_width = max(p for p, _ in lengths)
    gen = torch.Generator().manual_seed(0)
    size = len(lengths)
    prompts = torch.randint(3, vocab, (size, prompt_width), generator=gen)
    responses = torch.randint(3, vocab, (size, response_length), generator=gen)
    attention = torch.zeros(size, prompt_width + response_length, dtype=torch.long)
    mask = torch.zeros(size, response_length, dtype=torch.bool)
    for row, (prompt, response) in enumerate(lengths):
        attention[row, prompt_width - prompt : prompt_width + response] = 1
        mask[row, :response] = True
    return RolloutBatch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                         "attention_mask": attention, "response_mask": mask,
                         "advantages": torch.randn(size, response_length, generator=gen)})  # fmt: skip


def run_mode(mode: str, args: argparse.Namespace, model_dir: str, out: Any) -> None:
    """In a fresh process: build the strategy for ``mode``, time its passes, put the numbers on ``out``."""
    import torch

    from rl_engines.config import WorkerConfig
    from rl_engines.objectives import ActorObjective
    from rl_engines.strategies import create_strategy

    lengths = length_mix(args.samples, args.response_length)
    batch = build_batch(lengths, args.response_length, args.vocab)
    median = statistics.median(p + r for p, r in lengths)
    budget = max(64, int(args.micro * median) // 64 * 64)
    budget = max(budget, -(-max(p + r for p, r in lengths) // 64) * 64)
    values: dict[str, Any] = {
        "model_args": {"model_name_or_path": model_dir, "disable_gradient_checkpointing": True,
                       "attn_implementation": args.attn, "dtype": args.dtype},
        "training_args": {"per_device_train_batch_size": args.micro, "learning_rate": 1e-5,
                          "gradient_accumulation_steps": args.samples // args.micro},
        "infer_batch_size": args.micro,
    }  # fmt: skip
    if mode == "dynamic":
        for phase in ("train", "infer"):
            values.update({f"use_dynamic_batching_in_{phase}": True, f"max_tokens_per_microbatch_in_{phase}": budget,
                           f"sequence_length_round_in_{phase}": 64})  # fmt: skip
    if mode == "packing":
        values.update(use_sequence_packing=True, sequence_packing_args={
            "algorithm": "load_balance", "max_packed_sequence_length_train": budget,
            "max_packed_sequence_length_forward": budget})  # fmt: skip
    strategy = create_strategy(WorkerConfig.from_dict(values, "actor_train"), "actor_train")
    strategy.initialize()
    seen: list[tuple[int, int]] = []
    strategy.model.get_input_embeddings().register_forward_pre_hook(lambda _, a: seen.append(tuple(a[0].shape)))
    real = int(batch.batch["attention_mask"].sum())
    log_prob_times, train_times = [], []
    batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]  # warm-up
    for _ in range(args.repeats):
        seen.clear()
        start = time.perf_counter()
        strategy.compute_log_probs(batch)
        log_prob_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        strategy.train_step(batch, ActorObjective())
        train_times.append(time.perf_counter() - start)
    processed = sum(samples * width for samples, width in seen) / 2  # the log-prob pass and the train step
    out.put({
        "mode": mode, "budget": budget if mode != "padded" else None,
        "train_tokens_per_s": real / statistics.median(train_times),
        "log_prob_tokens_per_s": real / statistics.median(log_prob_times),
        "padding_fraction": 1 - real / processed, "largest_pass": max(s * w for s, w in seen),
        "passes": len(seen) // 2, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    })  # fmt: skip
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--micro", type=int, default=4, help="samples per padded micro-batch")
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attn", default="sdpa", help="model_args.attn_implementation (fa2: flash varlen on CUDA)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="model_args.dtype")
    args = parser.parse_args()

    from rl_engines.tiny_model import build_tiny_causal_lm

    with tempfile.TemporaryDirectory(prefix="bench_packing_") as folder:
        build_tiny_causal_lm(Path(folder), vocab_size=args.vocab, hidden_size=args.hidden,
                             intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=max(2, args.hidden // 128),
                             num_key_value_heads=max(1, args.hidden // 256),
                             max_position_embeddings=args.response_length + 512)  # fmt: skip
        context = multiprocessing.get_context("spawn")
        results = []
        for mode in MODES:
            queue = context.Queue()
            process = context.Process(target=run_mode, args=(mode, args, folder, queue))
            process.start()
            results.append(queue.get())
            process.join()
    base = results[0]
    print(f"{args.samples} samples, response_length {args.response_length}, {args.layers} layers x {args.hidden}, "
          f"{os.environ['OMP_NUM_THREADS']} threads, attention {args.attn}, {args.dtype}")  # fmt: skip
    print(
        "| mode | train tok/s | log-prob tok/s | train speed-up | log-prob speed-up | padding | largest pass | "
        "passes | peak RSS MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in results:
        print(f"| {row['mode']} | {row['train_tokens_per_s']:.0f} | {row['log_prob_tokens_per_s']:.0f} | "
              f"{row['train_tokens_per_s'] / base['train_tokens_per_s']:.2f}x | "
              f"{row['log_prob_tokens_per_s'] / base['log_prob_tokens_per_s']:.2f}x | {row['padding_fraction']:.1%} | "
              f"{row['largest_pass']} | {row['passes']} | {row['peak_rss_mib']:.0f} |")  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()

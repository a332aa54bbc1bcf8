"""Benchmark: rl_replay dump / load of one rollout batch against pickle (ROLL's format), same run.

Batch: 128 samples x 4096 tokens, six float32 tensors, two int64 tensors, and per-sample strings
(prompt, response, tag) as numpy object arrays, as in a verl / ROLL DataProto. Measured for numpy
arrays and for torch tensors. The baseline is what ROLL does: `pickle.dump(batch, f, protocol=5)` to
a file and `pickle.load` back (protocol 5 stores numpy / torch buffers without extra copies), plus
`torch.save` / `torch.load` for the torch batch. rl_replay's load includes reading the whole file,
checking its size and CRC-32 against the manifest, and rebuilding the batch; its durable dump includes
fsync of the file, the directory and the manifest, which pickle does not do (also shown without).

Run: python benchmarks/bench_replay.py [--repeat 15] [--dir /tmp/somewhere]
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rl_replay import RolloutReplay

B, T = 128, 4096
FLOAT_KEYS = ("old_log_probs", "ref_log_probs", "values", "advantages", "returns", "response_mask")
INT_KEYS = ("input_ids", "position_ids")


def make_batch(use_torch: bool) -> dict[str, Any]:
    """The rollout batch: six float32 [B, T], two int64 [B, T], three per-sample string arrays [B]."""
    rng = np.random.default_rng(0)
    batch: dict[str, Any] = {k: rng.standard_normal((B, T), dtype=np.float32) for k in FLOAT_KEYS}
    batch.update({k: rng.integers(0, 151_000, (B, T), dtype=np.int64) for k in INT_KEYS})
    if use_torch:
        import torch

        batch = {k: torch.from_numpy(v) for k, v in batch.items()}
    words = ["the", "answer", "is", "step", "so", "we", "get", "<think>", "</think>", "42"]
    for key, n_words in (("prompt", 200), ("response", 600), ("tag", 1)):
        texts = [" ".join(words[(i + j) % len(words)] for j in range(n_words)) for i in range(B)]
        batch[key] = np.array(texts, dtype=object)
    return batch


def round_robin(fns: dict[str, Callable[[int], Any]], repeat: int) -> dict[str, float]:
    """Median wall time in seconds of each fn(i), i = 0 .. repeat-1, after a warm-up call fn(repeat).

    The formats take turns (a, b, c, a, b, c, ...) so that drift of this machine's speed hits all alike;
    each call gets its own index so that every dump writes a new file, as a training run does; and each
    call starts after os.sync(), so that no format pays for the write-back of another's files.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in [repeat, *range(repeat)]:
        for name, fn in fns.items():
            os.sync()
            start = time.perf_counter()
            fn(i)
            if i != repeat:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def pickle_dump(path: str, batch: Any) -> None:
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=5)


def pickle_load(path: str) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def bench(label: str, use_torch: bool, root: str, repeat: int) -> None:
    """Dump and load the batch `repeat` times with each format; print a table of medians and ratios."""
    batch = make_batch(use_torch)

    def path(ext: str, i: int) -> str:
        return os.path.join(root, f"{label}_step_{i:06d}.{ext}")

    dumps: dict[str, Callable[[int], Any]] = {"pickle protocol 5": lambda i: pickle_dump(path("pkl", i), batch)}
    loads: dict[str, Callable[[int], Any]] = {"pickle protocol 5": lambda i: pickle_load(path("pkl", i))}
    sizes = {"pickle protocol 5": lambda: os.path.getsize(path("pkl", 0))}
    if use_torch:
        import torch

        name = "torch.save / torch.load"
        dumps[name] = lambda i: torch.save(batch, path("pt", i))
        loads[name] = lambda i: torch.load(path("pt", i), weights_only=False)
        sizes[name] = lambda: os.path.getsize(path("pt", 0))
    readers = {}
    for durable in (True, False):
        name = "rl_replay (fsync, verified load)" if durable else "rl_replay (no fsync, verified load)"
        writer = RolloutReplay(os.path.join(root, f"{label}-rl_replay-{durable}"), "dump", durable=durable)
        dumps[name] = lambda i, w=writer: w.dump(i, batch)
        readers[name] = writer.dump_dir
    dump_times = round_robin(dumps, repeat)
    for name, dump_dir in readers.items():
        reader = RolloutReplay(dump_dir, "mock")
        loads[name] = lambda i, r=reader: r.load(i)
        sizes[name] = lambda r=reader: os.path.getsize(r.step_path(0))
        _check_round_trip(reader.load(0), batch, use_torch)
    load_times = round_robin(loads, repeat)
    _report(label, [(name, dump_times[name], load_times[name], sizes[name]()) for name in dumps])


def _check_round_trip(loaded: dict[str, Any], batch: dict[str, Any], use_torch: bool) -> None:
    for key, value in batch.items():
        got = loaded[key]
        if use_torch and key not in ("prompt", "response", "tag"):
            assert got.dtype == value.dtype and bool((got == value).all()), key
        else:
            assert np.array_equal(np.asarray(got), np.asarray(value)), key


def _report(label: str, rows: list[tuple[str, float, float, int]]) -> None:
    base_dump, base_load, base_size = rows[0][1:]
    print(f"\n{label} batch ({B} x {T}, 6 x float32 + 2 x int64 + 3 string arrays), median times")
    print(f"{'format':38s} {'dump ms':>9} {'load ms':>9} {'size MB':>9} {'dump x':>8} {'load x':>8} {'size x':>8}")
    for name, dump_t, load_t, size in rows:
        print(
            f"{name:38s} {dump_t * 1e3:9.2f} {load_t * 1e3:9.2f} {size / 2**20:9.2f} "
            f"{base_dump / dump_t:8.2f} {base_load / load_t:8.2f} {size / base_size:8.3f}"
        )
    print("(x columns: pickle time / this time, so > 1 is faster; size x: this size / pickle size)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    args = parser.parse_args()
    logging.getLogger("rl_replay").setLevel(logging.WARNING)
    root = args.dir or tempfile.mkdtemp(prefix="bench_replay_")
    try:
        bench("numpy", False, root, args.repeat)
        try:
            import torch  # noqa: F401
        except ImportError:
            print("\ntorch not installed: torch batch skipped")
        else:
            bench("torch", True, root, args.repeat)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

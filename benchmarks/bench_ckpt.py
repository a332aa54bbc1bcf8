"""Benchmark: rl-ckpt conversion throughput against reading the same bytes from disk, and peak memory vs model size.

Model: Qwen2.5-0.5B's config (hidden 896, 14 heads in 2 KV groups, FFN 4864, vocabulary 151,936, tied embeddings,
bfloat16 as released) with ``--layers`` decoder layers, random weights, saved by transformers (one safetensors file).
Conversions, each in its own fresh process: HF -> Megatron-core TP=2 x PP=2 (per-rank files) and back.

Baselines, measured in the same run: a plain sequential read (16 MiB ``readinto``) of the very files the conversion
reads, and a plain write of as many bytes as it writes. Before every timed step the input files are evicted from the
page cache (``os.sync`` + ``posix_fadvise DONTNEED``), so baseline and conversions all start cold; outputs go to the
page cache (no fsync), as the converter leaves them. Throughput = input bytes / wall time. Printed: its ratio to the
read bandwidth (goal >= 0.5), and to the I/O floor "read the input + write the output" (1.0 = nothing but I/O);
each is the median over the repeats of the ratio within one repeat (read, convert, write run back to back).
transformers (imported to build config.json, a fixed ~2-3 s here) is imported before the clock starts.

Memory, sampled every 5 ms in the converting process from /proc/self/status: the peak RSS (VmHWM, which counts the
touched pages of memory-mapped input files) and the peak anonymous RSS (RssAnon: memory the converter allocated,
without the clean file pages the kernel can drop), both above the process's RSS before converting, against the model
size.

Run: python benchmarks/bench_ckpt.py [--layers 24] [--repeat 3] [--max_shard_size 500MB] [--dir /tmp/somewhere]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
MB = 1e6


def build_model(path: Path, layers: int) -> None:
    """Qwen2.5-0.5B-shaped random model in bfloat16, saved by transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**QWEN25_05B, num_hidden_layers=layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(str(path))


def files_of(folder: Path) -> list[Path]:
    """Every weight file of a HF or Megatron folder (what a conversion reads)."""
    return sorted(p for p in folder.rglob("*") if p.suffix in (".safetensors", ".pt"))


def evict(paths: list[Path]) -> None:
    """Drop ``paths`` from the page cache, so the next read comes from the disk."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_bytes(path: Path, size: int) -> float:
    """Seconds to write ``size`` bytes to a new file (16 MiB writes), as the conversions' outputs are written."""
    view = memoryview(os.urandom(16 * 2**20))
    os.sync()
    start = time.perf_counter()
    with path.open("wb", buffering=0) as f:
        for offset in range(0, size, len(view)):
            f.write(view[: min(len(view), size - offset)])
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def read_all(paths: list[Path]) -> float:
    """Seconds to read every byte of ``paths`` sequentially."""
    buffer = bytearray(16 * 2**20)
    start = time.perf_counter()
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


class MemorySampler:
    """Peak of /proc/self/status fields, sampled every ``period`` seconds on a thread."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.peak = dict.fromkeys(self.FIELDS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> dict[str, int]:
        """Current values in bytes."""
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in MemorySampler.FIELDS or name == "VmHWM":
                out[name] = int(value.split()[0]) * 1024
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            now = self.read()
            for key in self.FIELDS:
                self.peak[key] = max(self.peak[key], now[key])

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def child(direction: str, src: str, dst: str, max_shard_size: str) -> None:
    """Run one conversion in this (fresh) process and print its time and memory as JSON."""
    import transformers  # noqa: F401 (a fixed import cost, kept off the clock)

    from rl_ckpt import convert_hf_to_mcore, convert_mcore_to_hf, open_mcore_checkpoint

    before = MemorySampler.read()
    with MemorySampler() as sampler:
        start = time.perf_counter()
        if direction == "hf2mcore":
            convert_hf_to_mcore(src, dst, tp=2, pp=2)
        else:
            convert_mcore_to_hf(open_mcore_checkpoint(src), dst, max_shard_size=max_shard_size)
        seconds = time.perf_counter() - start
    after = MemorySampler.read()
    result = {
        "seconds": seconds,
        "hwm": after["VmHWM"] - before["VmRSS"],
        "anon": max(sampler.peak["RssAnon"], after["RssAnon"]) - before["RssAnon"],
    }
    print(json.dumps(result))


def run_child(direction: str, src: Path, dst: Path, max_shard_size: str) -> dict[str, Any]:
    """One conversion in a subprocess (inputs evicted first); its JSON result."""
    shutil.rmtree(dst, ignore_errors=True)
    evict(files_of(src))
    cmd = [sys.executable, __file__, "--child", direction, str(src), str(dst), "--max_shard_size", max_shard_size]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def bench(root: Path, layers: int, repeat: int, max_shard_size: str) -> None:
    hf, mcore, back = root / "hf", root / "mcore", root / "hf_back"
    build_model(hf, layers)
    model_bytes = sum(p.stat().st_size for p in files_of(hf))
    print(f"model: Qwen2.5-0.5B shape, {layers} layers, bfloat16, {model_bytes / MB:.0f} MB of safetensors")
    print(f"conversions: HF -> Megatron TP=2 x PP=2 -> HF (--max_shard_size {max_shard_size}); median of {repeat}\n")
    header = f"{'direction':<9} {'in MB':>6} {'out MB':>6} {'read MB/s':>9} {'write MB/s':>10} {'convert MB/s':>12}"
    print(f"{header} {'/read':>5} {'/I-O':>5} {'peak RSS MB':>11} {'/model':>6} {'peak anon MB':>12} {'/model':>6}")
    for direction, src, dst in (("hf2mcore", hf, mcore), ("mcore2hf", mcore, back)):
        if direction == "mcore2hf" and not mcore.exists():
            run_child("hf2mcore", hf, mcore, max_shard_size)
        runs, reads, writes = [], [], []
        for _ in range(repeat):  # baseline read, conversion, baseline write back to back: drift hits all alike
            evict(files_of(src))
            reads.append(read_all(files_of(src)))
            runs.append(run_child(direction, src, dst, max_shard_size))
            out_bytes = sum(p.stat().st_size for p in files_of(dst))
            writes.append(write_bytes(root / "baseline.bin", out_bytes))
        in_bytes = sum(p.stat().st_size for p in files_of(src))
        conv = [r["seconds"] for r in runs]
        read_ratio = statistics.median(r / c for r, c in zip(reads, conv))
        io_ratio = statistics.median((r + w) / c for r, w, c in zip(reads, writes, conv))
        hwm, anon = max(r["hwm"] for r in runs), max(r["anon"] for r in runs)
        print(
            f"{direction:<9} {in_bytes / MB:>6.0f} {out_bytes / MB:>6.0f} "
            f"{in_bytes / statistics.median(reads) / MB:>9.0f} {out_bytes / statistics.median(writes) / MB:>10.0f} "
            f"{in_bytes / statistics.median(conv) / MB:>12.0f} {read_ratio:>5.2f} {io_ratio:>5.2f} {hwm / MB:>11.0f} "
            f"{hwm / model_bytes:>6.2f} {anon / MB:>12.0f} {anon / model_bytes:>6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B has 24; even for PP=2)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per direction (median)")
    parser.add_argument("--max_shard_size", default="500MB", help="HF output shard size (the writer buffers one)")
    parser.add_argument("--dir", default=None, help="working folder (default: a temporary one, removed after)")
    parser.add_argument("--child", nargs=3, metavar=("DIRECTION", "SRC", "DST"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        child(*ns.child, ns.max_shard_size)
        return
    if ns.dir:
        Path(ns.dir).mkdir(parents=True, exist_ok=True)
        bench(Path(ns.dir), ns.layers, ns.repeat, ns.max_shard_size)
        return
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        bench(Path(tmp), ns.layers, ns.repeat, ns.max_shard_size)


if __name__ == "__main__":
    main()

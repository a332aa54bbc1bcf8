"""Benchmark: rl-ckpt conversion throughput against reading the same bytes from disk, and peak memory vs model size.

Model: Qwen2.5-0.5B's config (hidden 896, 14 heads in 2 KV groups, FFN 4864, vocabulary 151,936, tied embeddings,
bfloat16 as released) with ``--layers`` decoder layers, random weights, saved by transformers (one safetensors file);
``--model qwen3_moe``: a Qwen3-MoE-shaped model (hidden 1024, 16 heads in 4 KV groups, 32 experts of intermediate
size 384 per layer, top 4, Qwen3's vocabulary, untied), converted at TP=1 x PP=2 x EP=2 (``dist2hf`` does not apply).
Layouts, each conversion in its own fresh process:

- ``hf2mcore``: HF -> Megatron-core TP=2 x PP=2 per-rank files (MoE: TP=1 x PP=2 x EP=2);
- ``mcore2hf``: those per-rank files -> HF (``--max_shard_size`` shards);
- ``dist2hf``: a torch_dist (DCP) folder -> HF. The folder holds megatron's global keys (layers stacked on a leading
  dimension) saved by ``torch.distributed.checkpoint`` in one process: one chunk per tensor, so a layer is a slice
  of a chunk (megatron's own TP x PP saves cut chunks per rank; rl-ckpt reads both, see tests/rl_ckpt).

Baselines, measured in the same run, back to back with each conversion: a plain sequential read (16 MiB
``readinto``) of the very files the conversion reads, and a plain write of as many bytes as it writes, the way it
writes them (16 MiB ``O_DIRECT`` writes from an aligned buffer, buffered where the file system refuses O_DIRECT).
``--cache cold`` (default): before every timed step the input files are evicted from the page cache (``os.sync`` +
``posix_fadvise DONTNEED``), so the read baseline and the conversion both read them from the disk; ``--cache
warm``: the inputs are read once and kept in the page cache, so both read from memory. Every timed step starts
after ``os.sync`` and a ``--settle`` pause, so that no step pays for the writes (or deleted files' discards) of the
one before: on the project's VM the host takes writes into its own cache (~2 GB/s) and flushes them later, and a
read right after ran up to 3x slower. The disk's read bandwidth there also drifts over minutes (~0.6 to ~2.7 GB/s):
compare a conversion only with the baselines of its own repeat, which is what the ratios do. Throughput = input bytes /
wall time (a conversion may skip input bytes it does not need, e.g. the last stage's copy of tied embeddings).
Printed: its ratio to the read bandwidth (goal >= 0.5), and to the I/O floor "read the input + write the output"
(1.0 = nothing but I/O; reads and writes share the disk here, so their times add up); each is the median over the
repeats of the ratio within one repeat. Fixed import costs, the same whatever the model size, are paid before the
clock starts: transformers with the model's config class (config.json is written with it, ~2-3 s here) and
``torch.distributed.checkpoint`` (its metadata classes read a torch_dist folder, ~0.8 s).

Memory, sampled every 5 ms in the converting process from /proc/self/status: the peak RSS (VmHWM, which counts the
touched pages of memory-mapped files) and the peak anonymous RSS (RssAnon: memory the converter allocated), both
above the process's RSS before converting, against the model size.

Run: python benchmarks/bench_ckpt.py [--layers 24] [--model qwen2|qwen3_moe] [--repeat 3] [--max_shard_size 500MB]
     [--cache cold|warm] [--layouts hf2mcore,mcore2hf,dist2hf] [--settle 3] [--dir /tmp/somewhere]
"""

from __future__ import annotations

import argparse
import json
import mmap
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
CHUNK = 16 * 2**20
LAYOUTS = ("hf2mcore", "mcore2hf", "dist2hf")


QWEN3_MOE = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "moe_intermediate_size": 384,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
PARALLEL = {"qwen2": {"tp": 2, "pp": 2}, "qwen3_moe": {"tp": 1, "pp": 2, "ep": 2}}
"""hf2mcore's parallel sizes per ``--model``."""


def build_model(path: Path, layers: int, model: str = "qwen2") -> None:
    """Qwen2.5-0.5B-shaped (or ``QWEN3_MOE``-shaped) random model in bfloat16, saved by transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    if model == "qwen3_moe":
        config = transformers.AutoConfig.for_model("qwen3_moe", **QWEN3_MOE, num_hidden_layers=layers)
    else:
        config = transformers.Qwen2Config(**QWEN25_05B, num_hidden_layers=layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(str(path))


def build_dist(hf: Path, out: Path) -> None:
    """A torch_dist iteration folder of the HF model: megatron's global keys, layers stacked, one chunk each."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter, save

    from rl_ckpt import convert_hf_to_mcore

    with tempfile.TemporaryDirectory() as tmp:
        convert_hf_to_mcore(hf, tmp, tp=1, pp=1)
        rank = torch.load(Path(tmp) / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    model, layers = rank["model"], int(rank["args"]["num_layers"])
    te_names = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
    te_names["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"
    state = {k: v for k, v in model.items() if not k.startswith("decoder.layers.")}
    for key in [k.removeprefix("decoder.layers.0.") for k in model if k.startswith("decoder.layers.0.")]:
        stacked = torch.stack([model[f"decoder.layers.{i}.{key}"] for i in range(layers)])
        state[f"decoder.layers.{te_names.get(key, key)}"] = stacked
    iteration = out / "iter_0000001"
    save(state, storage_writer=FileSystemWriter(str(iteration)), no_dist=True)
    torch.save({"args": rank["args"], "checkpoint_version": 3.0, "iteration": 1}, iteration / "common.pt")
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (out / "latest_checkpointed_iteration.txt").write_text("1")


def files_of(folder: Path) -> list[Path]:
    """Every weight file of a HF, Megatron or torch_dist folder (what a conversion reads)."""
    return sorted(p for p in folder.rglob("*") if p.suffix in (".safetensors", ".pt", ".distcp"))


def evict(paths: list[Path]) -> None:
    """Drop ``paths`` from the page cache, so the next read comes from the disk."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prepare(paths: list[Path], cache: str, settle: float) -> None:
    """Inputs cold (evicted) or warm (read once), as ``--cache`` says; then ``settle`` seconds of quiet."""
    if cache == "cold":
        evict(paths)
    else:
        os.sync()
        read_all(paths)
    time.sleep(settle)


def write_bytes(path: Path, size: int) -> float:
    """Seconds to write ``size`` bytes to a new file as the converter does: 16 MiB writes from an aligned buffer,
    O_DIRECT (buffered where refused), the last partial block padded and the file truncated to ``size``."""
    buffer = mmap.mmap(-1, CHUNK)
    view = memoryview(buffer)
    view[:] = os.urandom(2**20) * (CHUNK // 2**20)
    start = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, flags)
    try:
        for offset in range(0, size, CHUNK):
            n = min(CHUNK, size - offset)
            os.write(fd, view[: -(-n // 4096) * 4096])
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def read_all(paths: list[Path]) -> float:
    """Seconds to read every byte of ``paths`` sequentially."""
    buffer = bytearray(CHUNK)
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


def child(layout: str, src: str, dst: str, max_shard_size: str, model: str) -> None:
    """Run one conversion in this (fresh) process and print its time and memory as JSON."""
    import torch.distributed.checkpoint  # noqa: F401 (fixed import costs, kept off the clock)
    from transformers import AutoConfig

    AutoConfig.for_model(model)  # imports the config class config.json is written with

    from rl_ckpt import convert_hf_to_mcore, convert_mcore_to_hf, open_mcore_checkpoint

    before = MemorySampler.read()
    with MemorySampler() as sampler:
        start = time.perf_counter()
        if layout == "hf2mcore":
            convert_hf_to_mcore(src, dst, **PARALLEL[model])
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


def run_child(layout: str, src: Path, dst: Path, ns: argparse.Namespace) -> dict[str, Any]:
    """One conversion in a subprocess (inputs cold or warm first); its JSON result."""
    shutil.rmtree(dst, ignore_errors=True)
    prepare(files_of(src), ns.cache, ns.settle)
    cmd = [sys.executable, __file__, "--child", layout, str(src), str(dst), "--max_shard_size", ns.max_shard_size,
           "--model", ns.model]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(layout: str, src: Path, dst: Path, root: Path, ns: argparse.Namespace, model_bytes: int) -> None:
    """Baseline read, conversion, baseline write, ``ns.repeat`` times; print one table row."""
    runs, reads, writes = [], [], []
    for _ in range(ns.repeat):  # back to back: drift hits all alike
        prepare(files_of(src), ns.cache, ns.settle)
        reads.append(read_all(files_of(src)))
        runs.append(run_child(layout, src, dst, ns))
        out_bytes = sum(p.stat().st_size for p in files_of(dst))
        prepare([], ns.cache, ns.settle)
        writes.append(write_bytes(root / "baseline.bin", out_bytes))
    in_bytes = sum(p.stat().st_size for p in files_of(src))
    conv = [r["seconds"] for r in runs]
    read_ratio = statistics.median(r / c for r, c in zip(reads, conv))
    io_ratio = statistics.median((r + w) / c for r, w, c in zip(reads, writes, conv))
    hwm, anon = max(r["hwm"] for r in runs), max(r["anon"] for r in runs)
    print(
        f"{layout:<9} {in_bytes / MB:>6.0f} {out_bytes / MB:>6.0f} "
        f"{in_bytes / statistics.median(reads) / MB:>9.0f} {out_bytes / statistics.median(writes) / MB:>10.0f} "
        f"{in_bytes / statistics.median(conv) / MB:>12.0f} {read_ratio:>5.2f} {io_ratio:>5.2f} {hwm / MB:>11.0f} "
        f"{hwm / model_bytes:>6.2f} {anon / MB:>12.0f} {anon / model_bytes:>6.2f}",
        flush=True,
    )


def bench(root: Path, ns: argparse.Namespace) -> None:
    hf, mcore, dist = root / "hf", root / "mcore", root / "dist"
    build_model(hf, ns.layers, ns.model)
    model_bytes = sum(p.stat().st_size for p in files_of(hf))
    shape = "Qwen2.5-0.5B" if ns.model == "qwen2" else "Qwen3-MoE (32 experts)"
    print(f"model: {shape} shape, {ns.layers} layers, bfloat16, {model_bytes / MB:.0f} MB of safetensors; hf2mcore "
          f"at {PARALLEL[ns.model]}")  # fmt: skip
    print(f"inputs {ns.cache}; HF shards --max_shard_size {ns.max_shard_size}; median of {ns.repeat}\n")
    header = f"{'layout':<9} {'in MB':>6} {'out MB':>6} {'read MB/s':>9} {'write MB/s':>10} {'convert MB/s':>12}"
    print(f"{header} {'/read':>5} {'/I-O':>5} {'peak RSS MB':>11} {'/model':>6} {'peak anon MB':>12} {'/model':>6}")
    sources = {"hf2mcore": (hf, mcore), "mcore2hf": (mcore, root / "hf_back"), "dist2hf": (dist, root / "hf_dist")}
    for layout in ns.layouts.split(","):
        if layout == "dist2hf" and ns.model != "qwen2":
            print("dist2hf   skipped: rl-ckpt reads MoE checkpoints in per-rank files only")
            continue
        src, dst = sources[layout]
        if layout == "mcore2hf" and not mcore.exists():
            run_child("hf2mcore", hf, mcore, ns)
        if layout == "dist2hf" and not dist.exists():
            build_dist(hf, dist)
        measure(layout, src, dst, root, ns, model_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B has 24; even for PP=2)")
    parser.add_argument("--model", choices=tuple(PARALLEL), default="qwen2", help="the model's shape (see above)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per layout (median)")
    parser.add_argument("--max_shard_size", default="500MB", help="HF output shard size")
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold", help="inputs evicted / in page cache")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {LAYOUTS}")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of quiet before every timed step")
    parser.add_argument("--dir", default=None, help="working folder (default: a temporary one, removed after)")
    parser.add_argument("--child", nargs=3, metavar=("LAYOUT", "SRC", "DST"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        child(*ns.child, ns.max_shard_size, ns.model)
        return
    if ns.dir:
        Path(ns.dir).mkdir(parents=True, exist_ok=True)
        bench(Path(ns.dir), ns)
        return
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        bench(Path(tmp), ns)


if __name__ == "__main__":
    main()

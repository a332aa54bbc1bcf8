"""rl-core hot path on a 128 x 4096-token batch: rollout correction (IS weights + rejection mask + every metric the
pipeline logs) + vanilla PPO loss with those weights on the corrected mask, forward and backward timed apart.

Each phase runs eager and fused (:mod:`rl_core.fused`: one compiled graph), and, when ``import verl`` works here,
verl 0.9.1's ``compute_rollout_correction_and_rejection_mask`` + ``compute_policy_loss_vanilla`` on the same
tensors. Phases are timed round-robin (one sample of each in turn, so load changes hit all alike); the baseline,
measured in the same run, is a memory-bandwidth roofline: one plain copy of the input bytes (old / rollout /
current log-probs, advantages, mask). Reported per phase: median ms, ``% of roofline`` (copy time / phase time)
and peak extra memory of one steady-state call (CUDA allocator peak on GPU; on CPU the peak RSS growth in a fresh
subprocess). To compare with verl, put verl 0.9.1 and the few packages its two functions import beside the
project's venv, without their dependencies (verl 0.9.1 requires transformers < 5.11 and tensordict <= 0.10, which
conflict with this venv; the two functions the bench calls ran with the newer ones), then run::

    .venv/bin/pip install --no-deps --target .tmp/verl verl==0.9.1 omegaconf antlr4-python3-runtime==4.9.3 \
        tensordict pyvers orjson codetiming
    PYTHONPATH=.tmp/verl .venv/bin/python benchmarks/bench_rl_core.py [--device cpu|cuda] [--preset NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from rl_core.losses import get_policy_loss
from rl_core.losses.aggregation import GlobalBatchInfo
from rl_core.rollout_corr import rollout_correction
from rl_core.rollout_corr_config import PRESETS

CORRECTION_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                   "rollout_rs_threshold")  # fmt: skip
Step = Callable[[], "torch.Tensor | None"]  # a forward; returns the loss to backpropagate, or None


def make_inputs(batch: int, length: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(batch, length, generator=g) * 0.5 - 2.0
    rollout = old + 0.05 * torch.randn(batch, length, generator=g)
    current = old + 0.05 * torch.randn(batch, length, generator=g)
    advantages = torch.randn(batch, length, generator=g)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    tensors = {"old": old, "rollout": rollout, "current": current, "advantages": advantages, "mask": mask}
    return {k: v.to(device) for k, v in tensors.items()}


def ours(x: dict[str, torch.Tensor], preset: str, fused: bool, part: str) -> Step:
    """rl-core's ``part`` (correction, loss or hot = both) as a forward step."""
    options = {key: PRESETS[preset][key] for key in CORRECTION_KEYS}
    loss_fn = get_policy_loss("vanilla")
    weights, mask, _ = rollout_correction(x["old"], x["rollout"], x["mask"], **options, fused=False)
    info = GlobalBatchInfo.from_mask(x["mask"])
    os.environ["RL_CORE_FUSED"] = "1" if fused else "0"  # the loss is a registry entry: no fused argument

    def step() -> torch.Tensor | None:
        current = x["current"].detach().requires_grad_(True)
        w, m = weights, mask
        if part != "loss":
            w, m, _ = rollout_correction(x["old"], x["rollout"], x["mask"], **options, fused=fused)
            if part == "correction":
                return None
        return loss_fn(x["old"], current, x["advantages"], m, rollout_is_weights=w, global_batch=info)[0]

    return step


def verl_step(x: dict[str, torch.Tensor], preset: str) -> Step:
    """verl 0.9.1's correction + vanilla loss (``actor/`` metrics via ``.item()``, as verl does)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    options = {key: PRESETS[preset][key] for key in CORRECTION_KEYS}
    batch_info = {"dp_size": 1, "batch_num_tokens": int(x["mask"].sum()), "global_batch_size": x["mask"].shape[0]}
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                               "clip_ratio_c": 3.0, "global_batch_info": batch_info})  # fmt: skip
    maskf = x["mask"].float()

    def step() -> torch.Tensor:
        current = x["current"].detach().requires_grad_(True)
        proto, mask, _ = compute_rollout_correction_and_rejection_mask(x["old"], x["rollout"], maskf, **options)
        weights = None if proto is None else proto.batch["rollout_is_weights"]
        return compute_policy_loss_vanilla(x["old"], current, x["advantages"], mask, config=config,
                                           rollout_is_weights=weights)[0]  # fmt: skip

    return step


def roofline(x: dict[str, torch.Tensor]) -> Step:
    total_bytes = sum(t.numel() * t.element_size() for t in x.values())
    src = torch.ones(total_bytes, dtype=torch.uint8, device=x["old"].device)
    dst = torch.zeros_like(src)  # touched now, so the copy itself allocates nothing

    def step() -> None:
        dst.copy_(src)

    return step


def phases(x: dict[str, torch.Tensor], preset: str, with_verl: bool) -> dict[str, Step]:
    table = {"roofline_copy": roofline(x)}
    for impl, fused in (("eager", False), ("fused", True)):
        for part in ("correction", "loss", "hot"):
            table[f"{part}_{impl}"] = ours(x, preset, fused, part)
    if with_verl:
        table["hot_verl"] = verl_step(x, preset)
    return table


def run_once(name: str, step: Step, sync: Callable[[], None]) -> tuple[float, float]:
    """Forward and backward seconds of one sample (backward 0 for phases without a loss)."""
    fused = name.endswith("_fused")
    os.environ["RL_CORE_FUSED"] = "1" if fused else "0"
    start = time.perf_counter()
    loss = step()
    sync()
    mid = time.perf_counter()
    if loss is not None:
        loss.backward()
        sync()
    return mid - start, time.perf_counter() - mid


def time_phases(table: dict[str, Step], repeats: int, device: str) -> dict[str, dict[str, float]]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in table}
    for round_ in range(repeats + 3):  # 3 warm-up rounds (the fused phases compile in the first)
        for name, step in table.items():
            sample = run_once(name, step, sync)
            if round_ >= 3:
                samples[name].append(sample)
    return {name: {"forward_ms": 1e3 * statistics.median(s[0] for s in got),
                   "backward_ms": 1e3 * statistics.median(s[1] for s in got)}
            for name, got in samples.items()}  # fmt: skip


def peak_memory_mb(name: str, args: argparse.Namespace) -> float:
    """Extra peak memory of one steady-state forward + backward of phase ``name``, in MiB."""
    if args.device == "cuda":
        step = phases(make_inputs(args.batch, args.length, "cuda"), args.preset, name == "hot_verl")[name]
        run_once(name, step, torch.cuda.synchronize)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_once(name, step, torch.cuda.synchronize)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    cmd = [sys.executable, __file__, "--child-memory", name, "--batch", str(args.batch), "--length",
           str(args.length), "--preset", args.preset]  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.split()[-1])


def _vm_hwm_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def child_memory(args: argparse.Namespace) -> None:
    """Peak RSS growth of one call after a warm-up call, in a child whose large allocations are all mmap-backed (so
    freed memory goes back to the OS and every new allocation shows in RSS) and whose peak is reset just before."""
    torch.set_num_threads(1)
    step = phases(make_inputs(args.batch, args.length, "cpu"), args.preset, args.child_memory == "hot_verl")
    run_once(args.child_memory, step[args.child_memory], lambda: None)  # compiles the fused phases
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak-RSS counter (Linux >= 4.0)
    before = _vm_hwm_kb()
    run_once(args.child_memory, step[args.child_memory], lambda: None)
    print((_vm_hwm_kb() - before) / 1024)


def verl_importable() -> bool:
    try:
        import verl.trainer.ppo.rollout_corr_helper  # noqa: F401
    except ImportError:
        return False
    return True


def report(results: dict[str, dict[str, float]], args: argparse.Namespace, input_mb: float) -> None:
    roof = results["roofline_copy"]["forward_ms"]
    print(f"rl-core benchmark: {args.batch} x {args.length} tokens, float32, device={args.device}, "
          f"threads={torch.get_num_threads()}, inputs {input_mb:.1f} MiB, preset {args.preset}")  # fmt: skip
    print(f"{'phase':<18}{'fwd ms':>9}{'bwd ms':>9}{'fwd % roofline':>16}{'peak extra MiB':>16}")
    for name, r in results.items():
        print(f"{name:<18}{r['forward_ms']:>9.2f}{r['backward_ms']:>9.2f}{100 * roof / r['forward_ms']:>15.1f}%"
              f"{r['peak_extra_mb']:>16.1f}")  # fmt: skip
    hot = results["hot_fused"]
    print(f"goal: hot_fused forward at least 20% of the roofline -> {100 * roof / hot['forward_ms']:.1f}%")
    if "hot_verl" in results:
        verl = results["hot_verl"]
        fwd = hot["forward_ms"] / verl["forward_ms"]
        total = (hot["forward_ms"] + hot["backward_ms"]) / (verl["forward_ms"] + verl["backward_ms"])
        print(f"goal: hot_fused time at most 0.25x verl 0.9.1's -> forward {fwd:.2f}x, forward + backward {total:.2f}x")
    else:
        print("verl is not importable here: install verl==0.9.1 beside rl-core to compare (see the docstring)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--preset", default="decoupled_k3_rs_token_tis", choices=sorted(PRESETS))
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: the per-core figure)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--child-memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_memory:
        child_memory(args)
        return
    x = make_inputs(args.batch, args.length, args.device)
    input_mb = sum(t.numel() * t.element_size() for t in x.values()) / 2**20
    results = time_phases(phases(x, args.preset, verl_importable()), args.repeats, args.device)
    for name, r in results.items():
        r["peak_extra_mb"] = peak_memory_mb(name, args)
    if args.json:
        print(json.dumps({"device": args.device, "input_mb": input_mb, "preset": args.preset, "results": results}))
        return
    report(results, args, input_mb)


if __name__ == "__main__":
    main()

"""rl-core hot path: rollout IS weights + vanilla PPO loss + aggregation on a 128 x 4096-token batch.

Baseline, measured in the same run: a memory-bandwidth roofline, i.e. one plain copy of the same input bytes
(old / rollout / current log-probs, advantages, mask). Reported per phase: median time, ratio to the roofline,
and peak extra memory (CUDA allocator peak on GPU; on CPU the peak RSS growth of one call in a fresh subprocess).

    python benchmarks/bench_rl_core.py [--device cpu|cuda] [--batch 128] [--length 4096] [--repeats 20]
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
from rl_core.rollout_is import compute_rollout_is_weights

PHASES = ("roofline_copy", "is_weights", "ppo_loss", "is_plus_ppo_forward", "is_plus_ppo_forward_backward")


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


def phase_fn(name: str, x: dict[str, torch.Tensor]) -> Callable[[], object]:
    loss_fn = get_policy_loss("vanilla")
    total_bytes = sum(t.numel() * t.element_size() for t in x.values())
    src = torch.ones(total_bytes, dtype=torch.uint8, device=x["old"].device)
    dst = torch.zeros_like(src)  # touched now, so the copy itself allocates nothing

    def roofline() -> object:
        return dst.copy_(src)

    def is_weights() -> object:
        return compute_rollout_is_weights(x["old"], x["rollout"], x["mask"])

    def ppo_loss() -> object:
        return loss_fn(x["old"], x["current"], x["advantages"], x["mask"])

    def forward(requires_grad: bool = False) -> torch.Tensor:
        current = x["current"].detach().requires_grad_(requires_grad)
        weights, mask, _ = compute_rollout_is_weights(x["old"], x["rollout"], x["mask"])
        loss, _ = loss_fn(x["old"], current, x["advantages"], mask, rollout_is_weights=weights)
        return loss

    def forward_backward() -> object:
        forward(requires_grad=True).backward()
        return None

    table = {"roofline_copy": roofline, "is_weights": is_weights, "ppo_loss": ppo_loss,
             "is_plus_ppo_forward": forward, "is_plus_ppo_forward_backward": forward_backward}  # fmt: skip
    return table[name]


def time_phase(fn: Callable[[], object], repeats: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def peak_memory_mb(phase: str, batch: int, length: int, device: str) -> float:
    """Extra peak memory of one call of ``phase`` beyond its inputs, in MiB."""
    if device == "cuda":
        x = make_inputs(batch, length, device)
        fn = phase_fn(phase, x)
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    cmd = [sys.executable, __file__, "--child-memory", phase, "--batch", str(batch), "--length", str(length)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip())


def _vm_hwm_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def child_memory(phase: str, batch: int, length: int) -> None:
    """Peak RSS growth of one call, in a child whose large allocations are all mmap-backed (so freed memory
    goes back to the OS and every new allocation shows in RSS) and whose peak is reset just before the call."""
    torch.set_num_threads(1)
    x = make_inputs(batch, length, "cpu")
    fn = phase_fn(phase, x)  # allocates the roofline buffers too; they are part of the baseline
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak-RSS counter (Linux >= 4.0)
    before = _vm_hwm_kb()
    fn()
    print((_vm_hwm_kb() - before) / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--child-memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        child_memory(args.child_memory, args.batch, args.length)
        return
    x = make_inputs(args.batch, args.length, args.device)
    input_mb = sum(t.numel() * t.element_size() for t in x.values()) / 2**20
    results = {}
    for phase in PHASES:
        seconds = time_phase(phase_fn(phase, x), args.repeats, args.device)
        results[phase] = {"ms": seconds * 1e3, "peak_extra_mb": peak_memory_mb(phase, args.batch, args.length,
                                                                               args.device)}  # fmt: skip
    roof = results["roofline_copy"]["ms"]
    for r in results.values():
        r["x_roofline"] = r["ms"] / roof
    if args.json:
        print(json.dumps({"device": args.device, "input_mb": input_mb, "threads": torch.get_num_threads(),
                          "results": results}))  # fmt: skip
        return
    print(f"rl-core benchmark: {args.batch} x {args.length} tokens, float32, device={args.device}, "
          f"threads={torch.get_num_threads()}, inputs {input_mb:.1f} MiB")  # fmt: skip
    print(f"{'phase':<32}{'median ms':>12}{'x roofline':>12}{'peak extra MiB':>16}")
    for phase, r in results.items():
        print(f"{phase:<32}{r['ms']:>12.2f}{r['x_roofline']:>12.2f}{r['peak_extra_mb']:>16.1f}")
    ratio = results["is_plus_ppo_forward"]["x_roofline"]
    verdict = "met" if ratio <= 3.0 else "not met (eager PyTorch makes one full-tensor pass per op)"
    print(f"goal: is_plus_ppo_forward within 3x of roofline_copy -> {ratio:.1f}x, {verdict}")


if __name__ == "__main__":
    main()

"""Benchmark: code-reward throughput of the sandbox (apps.common.sandbox): programs graded per second on a pool of N
processes against a pool of 1, in the same run.

The workload is what a code-RL batch looks like: ``--responses`` responses to stdin/stdout problems, each with
``--cases`` test cases, a mix of right answers, wrong answers, and a few that loop until the CPU limit; graded by the
code reward (``apps.rlvr.code_reward.code_rewards``), so each case is one sandboxed process. Reported per pool size:
wall seconds, programs per second, and the speed-up over a pool of 1. On a machine with C cores the speed-up tops
out near C for CPU-bound programs; programs that wait (sleep, I/O) gain up to the pool size.

Run: python benchmarks/bench_sandbox.py [--responses 24] [--cases 4] [--pools 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.common.sandbox import Limits, Sandbox
from apps.rlvr import code_reward
from apps.rlvr.config import RewardSpec

RIGHT = "```python\nn = int(input())\nprint(sum(i * i for i in range(n)))\n```"
WRONG = "```python\nn = int(input())\nprint(sum(range(n)))\n```"
LOOPS = "```python\nwhile True:\n    pass\n```"


def workload(responses: int, cases: int) -> tuple[list[str], list[dict[str, object]]]:
    """Right : wrong : looping = 6 : 3 : 1 responses, each against ``cases`` stdin cases."""
    sizes = range(1000, 1000 + cases)
    tests = [{"stdin": f"{n}\n", "expected_stdout": str(sum(i * i for i in range(n)))} for n in sizes]
    kinds = [RIGHT] * 6 + [WRONG] * 3 + [LOOPS]
    texts = [kinds[i % len(kinds)] for i in range(responses)]
    return texts, [{"case_type": "input", "test_cases": json.dumps(tests)} for _ in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--responses", type=int, default=24)
    parser.add_argument("--cases", type=int, default=4)
    parser.add_argument("--pools", default="1,2,4")
    parser.add_argument("--cpu-seconds", type=int, default=1, help="the CPU limit that stops the looping programs")
    args = parser.parse_args()
    texts, records = workload(args.responses, args.cases)
    programs = args.responses * args.cases
    expected = [1.0 if text == RIGHT else 0.0 for text in texts]
    baseline = None
    print(f"{programs} programs ({args.responses} responses x {args.cases} cases), CPU limit {args.cpu_seconds} s")
    for workers in [int(p) for p in args.pools.split(",")]:
        box = Sandbox(Limits(cpu_seconds=args.cpu_seconds, wall_seconds=args.cpu_seconds + 5.0), workers=workers)
        code_reward._SANDBOX = box
        start = time.perf_counter()
        rewards = code_reward.code_rewards(texts, records, RewardSpec())
        seconds = time.perf_counter() - start
        box.close()
        if rewards != expected:
            raise SystemExit(f"pool {workers}: wrong grades {rewards}")
        baseline = baseline or seconds
        rate = programs / seconds
        print(f"pool {workers}: {seconds:6.2f} s  {rate:6.1f} programs/s  x{baseline / seconds:.2f} vs pool 1")


if __name__ == "__main__":
    main()

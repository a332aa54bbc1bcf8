"""`rl-replay`: inspect rollout dumps and check that two runs are numerically identical."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rl_replay.__about__ import __version__
from rl_replay.config import SPLITS
from rl_replay.errors import ReplayError
from rl_replay.metrics import DEFAULT_METRICS, compare_metrics, format_table, read_metrics

EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE = 0, 1, 2

DESCRIPTION = """\
Inspect the rollout dumps written by rl_replay (rollout_mock mode: dump) and check that a replayed run
(mode: mock) matches its baseline. A dump directory holds manifest.json and
{train,val}/step_NNNNNN.safetensors, one file per training step.

exit status: 0 = OK / identical, 1 = verification failed / runs differ, 2 = bad arguments or unreadable input.
"""

EPILOG = """\
examples:
  rl-replay ls ./output/rollout_dumps/baseline_v1
      list the dumped steps of each split with sample counts, sizes and checksums
  rl-replay show ./output/rollout_dumps/baseline_v1 5 --split train
      print every tensor / array of step 5 with dtype, shape and min / max / mean
  rl-replay verify ./output/rollout_dumps/baseline_v1
      re-check every file's size and CRC-32 against the manifest (use it in CI)
  rl-replay diff ./dumps/run_a ./dumps/run_b --atol 1e-6
      compare two dumps step by step and key by key
  rl-replay compare-metrics ./output/baseline/metrics.jsonl ./output/optimized/metrics.jsonl
      the guide's step 4: are pg_loss, total_loss, value_loss, approx_kl, grad_norm identical per step?

metrics logs are JSONL, one object per line: {"step": 0, "actor/pg_loss": 0.123, ...}; a run may also be a
directory holding metrics.jsonl or TensorBoard event files (needs: pip install 'rl-replay[tensorboard]').
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `rl-replay`."""
    parser = argparse.ArgumentParser(
        prog="rl-replay", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"rl-replay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list the steps of a dump directory")
    p.add_argument("dir", metavar="DIR", help="dump directory (rollout_mock.dump_dir)")

    p = sub.add_parser("show", help="print the contents of one dumped step")
    p.add_argument("dir", metavar="DIR", help="dump directory")
    p.add_argument("step", metavar="STEP", type=int, help="step number, e.g. 0")
    p.add_argument("--split", choices=SPLITS, default="train", help="scheduler mode the step was dumped in")

    p = sub.add_parser("verify", help="check every file's size and checksum against the manifest")
    p.add_argument("dir", metavar="DIR", help="dump directory")

    p = sub.add_parser("diff", help="compare two dumps step by step and key by key (exit 1 if they differ)")
    p.add_argument("dir_a", metavar="DIR_A")
    p.add_argument("dir_b", metavar="DIR_B")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for numbers (default 0: exact)")

    p = sub.add_parser("compare-metrics", help="compare two runs' metric logs per step (exit 1 if any metric diverges)")
    p.add_argument(
        "run_a", metavar="RUN_A", help="baseline: metrics JSONL file, or a directory with one / with TensorBoard events"
    )
    p.add_argument("run_b", metavar="RUN_B", help="run to check, same forms as RUN_A")
    p.add_argument(
        "--metrics",
        default=",".join(DEFAULT_METRICS),
        help="comma-separated names; 'pg_loss' also matches 'actor/pg_loss' (default: %(default)s)",
    )
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, |a-b| <= atol + rtol*|b| (default 0)")
    p.add_argument(
        "--common-steps-only",
        action="store_true",
        help="compare only steps both runs logged (default: a step missing in one run is a difference)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 OK, 1 different / failed, 2 usage or input error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version exit 0, bad arguments 2
        return int(exc.code or 0)
    try:
        return _run(args)
    except (ReplayError, OSError) as exc:
        print(f"rl-replay: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    from rl_replay import diffing, inspection

    if args.command == "ls":
        _print(inspection.list_dump(args.dir))
        return EXIT_OK
    if args.command == "show":
        _print(inspection.describe_step(args.dir, args.step, args.split))
        return EXIT_OK
    if args.command == "verify":
        report = inspection.verify_dump(args.dir)
    elif args.command == "diff":
        report = diffing.diff_dumps(args.dir_a, args.dir_b, args.atol)
    else:
        return _compare_metrics(args)
    _print(report.lines)
    return EXIT_DIFFERENT if report.failed else EXIT_OK


def _compare_metrics(args: argparse.Namespace) -> int:
    names = [m.strip() for m in args.metrics.split(",") if m.strip()]
    result = compare_metrics(
        read_metrics(args.run_a), read_metrics(args.run_b), names, args.atol, args.rtol, args.common_steps_only
    )
    if not result.rows:
        print(
            f"rl-replay: error: none of the metrics {names} is logged in {args.run_a} or {args.run_b}", file=sys.stderr
        )
        return EXIT_USAGE
    print(format_table(result, "A: " + args.run_a, "B: " + args.run_b))
    if result.not_logged:
        print(f"not logged in either run (skipped): {', '.join(result.not_logged)}")
    bad = sum(not r.ok for r in result.rows)
    steps = len({r.step for r in result.rows})
    verdict = (
        f"DIVERGED: {bad} of {len(result.rows)} value(s) differ"
        if bad
        else f"IDENTICAL: {len(result.rows)} value(s) match"
    )
    print(f"{verdict} over {steps} step(s) (atol={args.atol}, rtol={args.rtol})")
    return EXIT_DIFFERENT if bad else EXIT_OK


def _print(lines: Sequence[str]) -> None:
    for line in lines:
        print(line)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

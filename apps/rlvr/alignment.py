"""Numerical alignment of training strategies (why rollout replay exists): dump a few RLVR steps once, replay the
same rollouts through each training strategy, and compare the per-step training metrics with the first one's.

Replay removes sampling from the comparison, so what differs between two replays is the training engine alone
(sharding, reduction order, parallel layout). ``python -m apps.rlvr.alignment --config_path DIR --config_name NAME
--variant NAME=OVERRIDE[,OVERRIDE...] ...`` prints the table; ``alignment_matrix`` returns it for tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from rl_replay.metrics import read_metrics

ALIGNED = ("actor/pg_loss", "actor/total_loss", "actor/ppo_kl", "actor/grad_norm")
"""Metrics compared: the loss, ROLL's approx_kl (``ppo_kl``) and the gradient norm before clipping."""


@dataclass
class AlignmentResult:
    """Per variant, per step, the aligned metrics; the first variant is the reference."""

    metrics: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)

    @property
    def reference(self) -> str:
        """The variant the others are compared with."""
        return next(iter(self.metrics))

    def max_abs_diff(self, variant: str, key: str, against: str | None = None) -> float:
        """Largest |variant - reference| of ``key`` over the steps; ``against``: another variant instead of the
        reference (e.g. LoRA variants against one LoRA run: the same rollouts, a different model)."""
        ref, other = self.metrics[against or self.reference], self.metrics[variant]
        return max(abs(other[step][key] - ref[step][key]) for step in ref)

    def table(self, keys: Sequence[str] = ALIGNED) -> str:
        """Markdown: one row per step and metric, each variant's value and its difference from the reference."""
        variants = list(self.metrics)
        head = ["step", "metric", *variants, *(f"|{v} - ref|" for v in variants[1:])]
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for step in sorted(self.metrics[self.reference]):
            for key in keys:
                values = [self.metrics[v][step][key] for v in variants]
                diffs = [abs(value - values[0]) for value in values[1:]]
                cells = [str(step), key, *(f"{v:.8g}" for v in values), *(f"{d:.2e}" for d in diffs)]
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _run_pipeline(config: RLVRConfig) -> None:
    from apps.rlvr.pipeline import RLVRPipeline

    RLVRPipeline(config, log=lambda line: None, progress_bar=False).run()


def alignment_matrix(
    config_file: Path, base: Sequence[str], variants: Mapping[str, Sequence[str]], work_dir: Path
) -> AlignmentResult:
    """Dump ``max_steps`` rollouts with the first variant, then replay them through every other variant.

    ``base`` are overrides for every run (model, data, steps); ``variants`` maps a name to its own overrides (e.g.
    ``actor_train.strategy_args.strategy_name=deepspeed_train``). Validation is off: only training is compared. The
    first variant's metrics are those of the dumping run itself: replaying its rollouts through the same variant
    reproduces its training bit for bit (rl-replay's promise, tested with the RLVR pipeline), so that replay is not
    run again.
    """
    dumps = work_dir / "rollouts"
    mock = ["eval_steps=0", "+rollout_mock.enable=true", f"+rollout_mock.dump_dir={dumps}"]
    result = AlignmentResult()
    for index, (name, overrides) in enumerate(variants.items()):
        mode = "dump" if index == 0 else "mock"
        output = work_dir / name
        run = [*base, *overrides, *mock, f"+rollout_mock.mode={mode}", f"output_dir={output}"]
        _run_pipeline(RLVRConfig.from_dict(load_config(config_file, run)))
        logged = read_metrics(str(output / "metrics.jsonl"))
        result.metrics[name] = {step: {k: float(v) for k, v in row.items()} for step, row in logged.items()}
    return result


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``name=override,override`` -> (name, overrides); a bare name has no overrides (the config as it is)."""
    name, _, rest = text.partition("=")
    if not name:
        raise ValueError(f"--variant {text!r}: write NAME or NAME=key=value[,key=value...]")
    return name, [item for item in rest.split(",") if item] if rest else []


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the alignment table of the variants."""
    parser = argparse.ArgumentParser(prog="python -m apps.rlvr.alignment", description=__doc__.splitlines()[0])
    parser.add_argument("--config_path", required=True)
    parser.add_argument("--config_name", required=True)
    parser.add_argument("--work_dir", required=True, help="dumps and the runs' outputs go here")
    parser.add_argument("--variant", action="append", required=True, help="NAME[=key=value,...]; first = reference")
    parser.add_argument("overrides", nargs="*", help="overrides for every run, e.g. max_steps=3")
    args = parser.parse_args(argv)
    variants = dict(parse_variant(text) for text in args.variant)
    config_file = Path(args.config_path) / f"{args.config_name.removesuffix('.yaml')}.yaml"
    result = alignment_matrix(config_file, args.overrides, variants, Path(args.work_dir))
    print(result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

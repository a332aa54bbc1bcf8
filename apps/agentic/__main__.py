"""``python -m apps.agentic --config_path DIR --config_name NAME [key=value ...]``.

ROLL's start_agentic_pipeline.py: the same flags and the same YAML files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from apps.agentic.config import AgenticConfig
from apps.common.yaml_config import load_config
from rl_replay.errors import ReplayError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m apps.agentic", description="Run the agentic pipeline.")
    parser.add_argument("--config_path", required=True, help="folder holding the YAML config")
    parser.add_argument("--config_name", required=True, help="file name without .yaml")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. max_steps=5")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Load, validate, run; a config error exits 2 with its message (no traceback)."""
    args = parse_args(argv)
    path = Path(args.config_path) / f"{args.config_name.removesuffix('.yaml')}.yaml"
    try:
        config = AgenticConfig.from_dict(load_config(path, args.overrides))
        from apps.agentic.pipeline import AgenticPipeline

        pipeline = AgenticPipeline(config)
    except (ValueError, FileNotFoundError, ReplayError) as err:  # bad config, missing file, missing dump
        print(f"config error: {err}", file=sys.stderr)
        return 2
    pipeline.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

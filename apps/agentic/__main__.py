"""``python -m apps.agentic --config_path DIR --config_name NAME [key=value ...]``.

ROLL's start_agentic_pipeline.py: the same flags and the same YAML files.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from apps.agentic.config import AgenticConfig
from apps.common.loop import cli_main
from apps.common.preflight import PreflightError


def build(mapping: dict[str, Any]) -> Any:
    """The pipeline of a loaded config mapping (pre-flight runs here: errors exit 2)."""
    from apps.agentic.pipeline import AgenticPipeline

    if not mapping.get("actor_train"):
        raise PreflightError(
            "the config has no actor_train section, so there is nothing to train: ROLL runs such a file (e.g. its "
            "agentic_rollout_sokoban.yaml) with start_agentic_rollout_pipeline.py. To sample episodes only, run "
            "`python -m apps.agentic.rollout_pipeline` with the same flags; to train, add an actor_train section."
        )
    return AgenticPipeline(AgenticConfig.from_dict(mapping))


def main(argv: Sequence[str] | None = None) -> int:
    """Load, validate, run; a config error exits 2 with its message (no traceback)."""
    return cli_main(argv, "python -m apps.agentic", "Run the agentic pipeline.", build)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m apps.rlvr --config_path DIR --config_name NAME [key=value ...]`` (ROLL's start_rlvr_pipeline.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from apps.common.loop import cli_main
from apps.rlvr.config import RLVRConfig


def build(mapping: dict[str, Any]) -> Any:
    """The pipeline of a loaded config mapping (pre-flight runs here: errors exit 2)."""
    from apps.rlvr.pipeline import RLVRPipeline

    return RLVRPipeline(RLVRConfig.from_dict(mapping))


def main(argv: Sequence[str] | None = None) -> int:
    """Load, validate, run; a config error exits 2 with its message (no traceback)."""
    return cli_main(argv, "python -m apps.rlvr", "Run the RLVR pipeline.", build)


if __name__ == "__main__":
    sys.exit(main())

"""``../shared`` beside the checkout (ROLL's example configs), found the same way by every test that reads it.

The folder is located relative to this file, never by an absolute path, so the tests read it on any machine where
it sits next to the checkout. When it is missing, :func:`require_shared` skips the test with a message naming the
path, except under CI (environment variable ``CI`` set, e.g. ``CI=true``): there a missing ``../shared`` would turn
those tests into silent skips, so it fails them instead.

Use :func:`require_shared` inside a test (or a fixture) before reading a path, and :func:`roll_example_files` for
parameters collected from the examples: it never returns an empty list, so a missing folder cannot silently drop a
parametrized test (pass each parameter through :func:`require_shared` in the fixture or test).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DIR = Path(__file__).resolve().parents[2] / "shared"  # <checkout>/tests/shared_dir.py -> <checkout>/../shared
ROLL_EXAMPLES = SHARED_DIR / "roll-examples"
ROLL_TARGETS = SHARED_DIR / "roll-targets"
"""ROLL files of capabilities the issues add; each joins the examples' parametrized tests when its capability lands."""


def under_ci() -> bool:
    """True when the ``CI`` environment variable is set to anything but empty / 0 / false / no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_shared(path: Path = ROLL_EXAMPLES) -> Path:
    """``path`` (under ``../shared``) when it exists; otherwise fail the test under CI, skip it elsewhere."""
    if path.exists():
        return path
    message = f"{path} is missing: these tests read ../shared beside the checkout ({SHARED_DIR})"
    if under_ci():
        pytest.fail(f"{message}; under CI (CI={os.environ['CI']!r}) that is a failure, not a skip", pytrace=False)
    pytest.skip(f"{message}; put ../shared next to the checkout to run them")


def roll_example_files(*patterns: str) -> list[Path]:
    """Sorted files of ``ROLL_EXAMPLES`` matching the glob ``patterns``, for ``parametrize`` / fixture params.

    When nothing matches (``../shared`` missing or incomplete), the first pattern's path stands in as the only
    parameter: it does not exist, so :func:`require_shared` fails or skips the test naming it, where an empty
    parameter list would skip the test silently.
    """
    found = sorted({path for pattern in patterns for path in ROLL_EXAMPLES.glob(pattern)})
    return found or [ROLL_EXAMPLES / patterns[0]]


def roll_target_files(*relative: str) -> list[Path]:
    """The named files of ``ROLL_TARGETS`` (whether or not they exist: pass each through :func:`require_shared`)."""
    return [ROLL_TARGETS / name for name in relative]

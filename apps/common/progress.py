"""A progress bar over pipeline steps (tqdm, on stderr), with the step's reward and time as its postfix.

Shown when stderr is a terminal (``enabled=None``), so logs and CI output stay line-based; log lines printed
while it is shown go through ``write`` so they do not tear the bar.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO

POSTFIX = {"critic/score/mean": "reward", "val/score/mean": "val", "time/step": "s/step"}


class StepProgress:
    """``update(step, metrics)`` once per finished step; ``close()`` at the end."""

    def __init__(self, total: int, initial: int, *, desc: str, enabled: bool | None = None, file: TextIO | None = None):
        from tqdm import tqdm

        disable = None if enabled is None else not enabled  # None: tqdm hides itself when file is not a terminal
        self.bar: Any = tqdm(total=total, initial=initial, desc=desc, unit="step", disable=disable,
                             file=file or sys.stderr, dynamic_ncols=True)  # fmt: skip

    def update(self, metrics: Mapping[str, float]) -> None:
        """Advance one step and show the step's reward (and validation score when there is one)."""
        shown = {label: f"{metrics[key]:.3g}" for key, label in POSTFIX.items() if key in metrics}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def write(self, line: str) -> None:
        """Print a log line above the bar (plain print when the bar is hidden)."""
        if self.bar.disable:
            print(line)
        else:
            self.bar.write(line)

    def close(self) -> None:
        """Finish the bar."""
        self.bar.close()

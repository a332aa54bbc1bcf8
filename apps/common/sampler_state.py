"""Where a prompt sampler is: what a checkpoint records so a resumed run draws exactly the next prompts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplerState:
    """Where a sampler is: resume from it to continue with exactly the next prompts."""

    epoch: int = 0
    position: int = 0
    streams: dict[str, list[int]] = field(default_factory=dict)
    """A sampler of several streams (RLVR's domains): each one's ``[epoch, position]``."""

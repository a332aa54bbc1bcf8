"""Where a prompt sampler is: what a checkpoint records so a resumed run draws exactly the next prompts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplerState:
    """Where a sampler is: resume from it to continue with exactly the next prompts."""

    epoch: int = 0
    position: int = 0

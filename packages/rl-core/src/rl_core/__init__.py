"""rl-core: pure-tensor RL math for LLM post-training (torch + numpy only)."""

from rl_core.__about__ import __version__

__all__ = ["__version__"]

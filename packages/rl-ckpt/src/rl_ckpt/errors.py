"""The one error type of rl_ckpt."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint cannot be read or converted.

    The message names the path, rank file or tensor at fault and says how to fix it; the CLI prints it and
    exits with status 2.
    """

"""Padding a batch's rows to a multiple of a worker group's size, so ``dp_split`` gives every worker an equal shard."""

from __future__ import annotations


def padded_indices(indices: list[int], multiple: int) -> list[int]:
    """``indices`` repeated cyclically up to a multiple of ``multiple`` (equal shards for dp_split)."""
    missing = (-len(indices)) % multiple
    return indices + [indices[i % len(indices)] for i in range(missing)]

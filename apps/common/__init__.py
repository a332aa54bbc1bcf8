"""Pieces every app shares: ROLL-style YAML loading and command-line entry points."""

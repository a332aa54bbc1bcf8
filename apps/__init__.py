"""Thin RLVR and agentic pipelines composed from the rl-* packages (config, entry points, rewards, demos)."""

"""Agentic RL: multi-turn episodes in text environments (config, env managers, rollouts and the pipeline)."""

"""Env managers: the environments of one ``*_env_manager`` section, grouped, seeded and stepped concurrently.

``num_env_groups`` groups are divided over ``tags`` (``num_groups_partition``, or equally); each group holds
``group_size`` environments that are reset with one seed, so they start from the same state (the "prompt" the group's
episodes are compared on). Seeds come from ``(seed, split, step, round, group)`` through numpy's SeedSequence: a
resumed or replayed run sees the same environments, and validation seeds (the same at every evaluation) never meet
training ones. An ``env_config`` with a ``seed`` key (GEM's reasoning-gym environments build their question set from
it) gets its group's own seed for the run in its place, as ROLL gives it the group seed.

Environments are split into workers of at most ``max_env_num_per_worker`` (ROLL's env-manager workers); the
workers step their environments on a thread pool, so a slow environment type does not hold up the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from apps.agentic.config import AgenticConfig
from apps.agentic.env_sections import EnvManagerConfig, EnvSpec
from apps.agentic.envs import StepResult, TextEnv, make_env
from apps.agentic.envs.tools import ToolEnv, parse_tool_wrapper

SPLITS = {"train": 0, "val": 1}


@dataclass
class EnvSlot:
    """One environment and where it sits."""

    index: int
    """Position in the manager (also the order of samples in a rollout)."""
    tag: str
    group: int
    """Env group id within the manager; the group's environments share their seed."""
    spec: EnvSpec
    env: TextEnv


def group_seed(seed: int, split: str, step: int, round_index: int, group: int) -> int:
    """The reset seed of one env group in one round of one step (a 31-bit int, deterministic)."""
    sequence = np.random.SeedSequence([seed, SPLITS[split], step, round_index, group])
    return int(sequence.generate_state(1)[0] & 0x7FFFFFFF)


class EnvManager:
    """The environments of one manager section; ``reset`` a round, then ``step`` the ones still running."""

    def __init__(self, config: AgenticConfig, section: EnvManagerConfig, split: str) -> None:
        self.section, self.split, self.seed = section, split, config.base.seed
        self.slots: list[EnvSlot] = []
        group = 0
        for tag, groups in zip(section.tags, section.partition(), strict=True):
            spec = config.env_spec(tag)
            env_config = dict(spec.env_config)  # the manager's format_penalty is not read (ROLL's is not either)
            for _ in range(groups):
                if "seed" in env_config:  # ROLL: an environment's own seed (GEM's reasoning-gym sets) is its group's
                    env_config["seed"] = group_seed(self.seed, split, 0, 0, group)
                for _ in range(section.group_size):
                    env = make_env(spec.env_type, env_config)
                    if spec.tool_wrapper is not None:  # checked by the config (parse_tool_wrapper)
                        env = ToolEnv(env, parse_tool_wrapper(spec.tool_wrapper, f"custom_envs.{tag}.tool_wrapper"))
                    self.slots.append(EnvSlot(len(self.slots), tag, group, spec, env))
                group += 1
        per_worker = section.max_env_num_per_worker or len(self.slots)
        self.workers = [self.slots[i : i + per_worker] for i in range(0, len(self.slots), per_worker)]
        self.pool = ThreadPoolExecutor(max_workers=len(self.workers), thread_name_prefix=f"env-{split}")

    def seeds(self, step: int, round_index: int) -> list[int]:
        """Each slot's reset seed for this round (equal within a group). Validation draws the same held-out seeds
        at every evaluation, so its success rates compare across steps."""
        step = step if self.split == "train" else 0
        return [group_seed(self.seed, self.split, step, round_index, slot.group) for slot in self.slots]

    def reset(self, seeds: Sequence[int]) -> list[str]:
        """Reset every environment with its seed; returns the first observations, in slot order."""
        return self._map(lambda slot: slot.env.reset(int(seeds[slot.index])), self.slots)

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        """Step the environments of ``actions`` (slot index -> the model's response text)."""
        chosen = [self.slots[i] for i in sorted(actions)]
        results = self._map(lambda slot: slot.env.step(actions[slot.index]), chosen)
        return {slot.index: result for slot, result in zip(chosen, results, strict=True)}

    def _map(self, fn: Callable[[EnvSlot], Any], slots: Sequence[EnvSlot]) -> list[Any]:
        """``fn`` over ``slots``: each worker's share runs on its own thread; results in the order of ``slots``."""
        wanted = {slot.index for slot in slots}
        shares = [[slot for slot in worker if slot.index in wanted] for worker in self.workers]

        def run(share: list[EnvSlot]) -> list[tuple[int, Any]]:
            return [(slot.index, fn(slot)) for slot in share]

        futures = [self.pool.submit(run, share) for share in shares if share]
        found = dict(pair for future in futures for pair in future.result())
        return [found[slot.index] for slot in slots]

    def render(self, index: int, mode: str = "text") -> Any:
        """The current frame of one environment (``text`` or ``rgb_array``)."""
        return self.slots[index].env.render(mode)

    def close(self) -> None:
        """Close every environment and the worker threads."""
        for slot in self.slots:
            slot.env.close()
        self.pool.shutdown(wait=True)

    def describe(self) -> dict[str, Any]:
        """Shape of the manager for logs: environments, groups per tag, workers."""
        return {
            "environments": len(self.slots), "workers": len(self.workers),
            "groups": dict(zip(self.section.tags, self.section.partition(), strict=True)),
            "group_size": self.section.group_size,
        }  # fmt: skip

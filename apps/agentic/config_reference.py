"""docs/agentic-config-reference.md, generated from the agentic config dataclasses by the renderer of
``apps.common.config_reference``.

``python -m apps.agentic.config_reference > docs/agentic-config-reference.md`` rewrites it; a test fails when it is
out of date.
"""

from __future__ import annotations

import sys

from apps.agentic.config import AgenticConfig, RewardNormalization
from apps.agentic.env_sections import EnvManagerConfig, EnvSpec
from apps.common.config_reference import render

AGENTIC_HEADER = """# Agentic config reference

Generated from the config dataclasses by `python -m apps.agentic.config_reference >
docs/agentic-config-reference.md` (a test fails when this file is out of date). These are the agentic keys; the keys
shared with RLVR (experiment, cluster, schedule, algorithm, worker sections, rollout_mock) are in
[rlvr-config-reference.md](rlvr-config-reference.md#top-level-keys-shared-with-the-agentic-pipeline); the RLVR-only
ones (`rewards`, `validation`, `prompt_length`, `response_length`, dynamic sampling and sample masks) are rejected.
See [agentic.md](agentic.md) for the guide.
"""


def agentic_reference() -> str:
    """The agentic keys: top level, env managers, custom_envs entries, reward_normalization."""
    return render(
        AGENTIC_HEADER,
        [
            (AgenticConfig, "Top-level agentic keys", ("base",)),  # base: the shared keys, not a YAML key
            (EnvManagerConfig, "train_env_manager, val_env_manager", ()),
            (EnvSpec, "custom_envs.<tag>", ()),
            (RewardNormalization, "reward_normalization", ()),
        ],
    )


if __name__ == "__main__":
    sys.stdout.write(agentic_reference())

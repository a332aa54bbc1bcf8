"""docs/rlvr-config-reference.md, generated from the RLVR config dataclasses by the renderer of
``apps.common.config_reference``.

``python -m apps.rlvr.config_reference > docs/rlvr-config-reference.md`` rewrites it; a test fails when it is out of
date.
"""

from __future__ import annotations

import dataclasses
import sys

from apps.common.config import SharedConfig
from apps.common.config_reference import render
from apps.common.policy_args import ActorPolicyArgs
from apps.rlvr.config import RewardSpec, RLVRConfig, ValidationConfig
from rl_engines.config import (
    GeneratingArgs,
    ModelArgs,
    SequencePackingArgs,
    StrategyArgs,
    TrainingArgs,
    WorkerConfig,
)

HEADER = """# RLVR config reference

Generated from the config dataclasses by `python -m apps.rlvr.config_reference > docs/rlvr-config-reference.md`
(a test fails when this file is out of date). Every key is ROLL's; unknown keys are rejected naming the key path.
See [rlvr.md](rlvr.md) for the guide.
"""


def reference() -> str:
    """The whole reference: top-level keys, worker sections and their argument groups, rewards, validation."""
    shared = tuple(field.name for field in dataclasses.fields(SharedConfig))
    return render(
        HEADER,
        [
            (SharedConfig, "Top-level keys shared with the agentic pipeline", ("actor_policy",)),
            (RLVRConfig, "RLVR-only top-level keys", shared),
            (WorkerConfig, "Worker sections: actor_train, actor_infer, reference, critic, rewards.<name>", ()),
            (ModelArgs, "<worker>.model_args", ()),
            (TrainingArgs, "<worker>.training_args", ()),
            (GeneratingArgs, "<worker>.generating_args and validation.generating_args", ()),
            (StrategyArgs, "<worker>.strategy_args", ()),
            (SequencePackingArgs, "<worker>.sequence_packing_args", ()),
            (ActorPolicyArgs, "actor_train policy-loss keys (ROLL's ActorPGWorker; apps.common.policy_args)", ()),
            (RewardSpec, "rewards.<name> (besides the worker keys)", ()),
            (ValidationConfig, "validation", ()),
        ],
    )


if __name__ == "__main__":
    sys.stdout.write(reference())

"""The config references (docs/rlvr-config-reference.md, docs/agentic-config-reference.md) generated from the config
dataclasses themselves: every key, its type, its default and the documentation line under its field, so the
references cannot drift from the code.

``python -m apps.common.config_reference > docs/rlvr-config-reference.md`` and ``python -m
apps.common.config_reference agentic > docs/agentic-config-reference.md`` rewrite them; a test fails when a file is out
of date.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
from typing import Any

HEADER = """# RLVR config reference

Generated from the config dataclasses by `python -m apps.common.config_reference > docs/rlvr-config-reference.md`
(a test fails when this file is out of date). Every key is ROLL's; unknown keys are rejected naming the key path.
See [rlvr.md](rlvr.md) for the guide.
"""


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of the dataclass ``cls`` (its attribute docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return "`null`" if field.default is None else f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        return "see below" if dataclasses.is_dataclass(value) else f"`{value!r}`"
    return "required"


def _type(field: dataclasses.Field[Any]) -> str:
    return str(field.type).replace(" | ", " or ")


def table(cls: type, title: str, skip: tuple[str, ...] = ()) -> str:
    """A markdown section with one row per field of ``cls``."""
    docs = field_docs(cls)
    rows = [f"## {title}\n", f"{inspect.getdoc(cls) or ''}\n", "| key | type | default | meaning |"]
    rows.append("| --- | --- | --- | --- |")
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        meaning = docs.get(field.name, "").replace("|", "\\|")
        rows.append(f"| `{field.name}` | {_type(field)} | {_default(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def reference() -> str:
    """The whole reference: top-level keys, worker sections and their argument groups, rewards, validation."""
    from apps.rlvr.config import RewardSpec, RLVRConfig, ValidationConfig
    from rl_engines.config import GeneratingArgs, ModelArgs, StrategyArgs, TrainingArgs, WorkerConfig

    sections = [
        (RLVRConfig, "Top-level keys"),
        (WorkerConfig, "Worker sections: actor_train, actor_infer, reference, critic, rewards.<name>"),
        (ModelArgs, "<worker>.model_args"),
        (TrainingArgs, "<worker>.training_args"),
        (GeneratingArgs, "<worker>.generating_args and validation.generating_args"),
        (StrategyArgs, "<worker>.strategy_args"),
        (RewardSpec, "rewards.<name> (besides the worker keys)"),
        (ValidationConfig, "validation"),
    ]
    return HEADER + "".join("\n" + table(cls, title) for cls, title in sections)


AGENTIC_HEADER = """# Agentic config reference

Generated from the config dataclasses by `python -m apps.common.config_reference agentic >
docs/agentic-config-reference.md` (a test fails when this file is out of date). These are the agentic keys; the keys
shared with RLVR (experiment, cluster, schedule, algorithm, worker sections, rollout_mock) are in
[rlvr-config-reference.md](rlvr-config-reference.md), except the RLVR-only ones the agentic pipeline rejects
(`rewards`, `validation`, `prompt_length`, `response_length`, dynamic sampling and sample masks). See
[agentic.md](agentic.md) for the guide.
"""


def agentic_reference() -> str:
    """The agentic keys: top level, env managers, custom_envs entries, reward_normalization."""
    from apps.agentic.config import AgenticConfig, EnvManagerConfig, EnvSpec, RewardNormalization

    sections = [
        (EnvManagerConfig, "train_env_manager, val_env_manager"),
        (EnvSpec, "custom_envs.<tag>"),
        (RewardNormalization, "reward_normalization"),
    ]
    top = table(AgenticConfig, "Top-level agentic keys", skip=("base",))  # base: the RLVR keys, not a YAML key
    return AGENTIC_HEADER + "\n" + top + "".join("\n" + table(cls, title) for cls, title in sections)


if __name__ == "__main__":
    sys.stdout.write(agentic_reference() if sys.argv[1:] == ["agentic"] else reference())

"""The config reference (docs/rlvr-config-reference.md) generated from the config dataclasses themselves: every key,
its type, its default and the documentation line under its field, so the reference cannot drift from the code.

``python -m apps.common.config_reference > docs/rlvr-config-reference.md`` rewrites it; a test fails when the file
is out of date.
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


def table(cls: type, title: str) -> str:
    """A markdown section with one row per field of ``cls``."""
    docs = field_docs(cls)
    rows = [f"## {title}\n", f"{inspect.getdoc(cls) or ''}\n", "| key | type | default | meaning |"]
    rows.append("| --- | --- | --- | --- |")
    for field in dataclasses.fields(cls):
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


if __name__ == "__main__":
    sys.stdout.write(reference())

"""The renderer of the config references, which are generated from the config dataclasses themselves: every key,
its type, its default and the documentation line under its field, so the references cannot drift from the code.

Each app has its generator: ``python -m apps.rlvr.config_reference > docs/rlvr-config-reference.md`` and ``python -m
apps.agentic.config_reference > docs/agentic-config-reference.md`` rewrite them; a test fails when a file is out of
date.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from typing import Any


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of the dataclass ``cls`` (its attribute docstring), its bases' included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
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
        if field.name in skip or not field.init:  # init=False: derived at load, not a key
            continue
        meaning = docs.get(field.name, "").replace("|", "\\|")
        rows.append(f"| `{field.name}` | {_type(field)} | {_default(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def render(header: str, sections: list[tuple[type, str, tuple[str, ...]]]) -> str:
    """``header``, then one table per ``(dataclass, title, fields to skip)``."""
    return header + "".join("\n" + table(cls, title, skip) for cls, title, skip in sections)

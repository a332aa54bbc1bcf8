"""Load a ROLL-style YAML config: Hydra ``defaults`` includes, ``${...}`` interpolation, ``key=value`` overrides.

ROLL runs on Hydra / OmegaConf; we read the same files without them:
- ``defaults: [../config/envs@_here_, _self_]`` merges the listed files (relative to the including file, ``.yaml``
  implied) into the root, in order; the file's own keys go where ``_self_`` stands (last when absent, as Hydra).
- ``${key}`` / ``${a.b}`` as a whole value is replaced by the referenced value (any type); inside a longer string it is
  substituted as text. Hydra's ``${now:%Y%m%d-%H%M%S}`` is the load's start time in that strftime pattern (one time
  for the whole load). OmegaConf's ``${oc.env:NAME}`` is that environment variable's value (a string), and
  ``${oc.env:NAME,default}`` falls back to ``default`` when it is unset (the string OmegaConf makes of it: quotes
  removed, ``null`` None, ``true`` ``True``, ``1e3`` ``1000.0``); unset without a default fails naming the key and
  the variable, as OmegaConf does. References resolve against the merged root, recursively and innermost first
  (``${a.${b}}``); cycles and missing keys fail naming the key that refers.
- the ``hydra:`` section (Hydra's own run settings) is dropped.

A config is data that travels, so its size after expansion is bounded: YAML aliases (``*name``) and ``${...}``
references of references multiply (9 levels of 9 make 9**9 values, a "billion laughs"); files past the limits below
fail fast, naming the file. Each included file is composed once per load, however often it is listed.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")
IGNORED_SECTIONS = ("hydra",)
MAX_YAML_VALUES = 1_000_000
"""Most values (mappings, lists, scalars) one file may hold once its aliases are expanded; real configs hold < 1,000."""
MAX_RESOLVED_VALUES = 100_000
"""Most values ``${...}`` references may copy into one config (counted per copy); real configs copy < 1,000."""
MAX_RESOLVED_CHARS = 4_000_000
"""Most characters of text ``${...}`` references may copy into one config; real configs copy < 10,000."""


class ConfigFileError(ValueError):
    """A config file cannot be read, composed or interpolated; the message names the file and the key."""


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The composed, override-applied and interpolated mapping of the YAML file at ``path``."""
    root = _compose(Path(path), stack=(), composed={})
    for item in overrides:
        apply_override(root, item)
    for section in IGNORED_SECTIONS:
        root.pop(section, None)
    return resolve_interpolations(root, source=str(path))


class _AliasLimitError(Exception):
    """A document's aliases expand past MAX_YAML_VALUES, or an alias refers to a node that contains it."""


class _BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]  # yaml has no type stubs here
    """yaml.SafeLoader that refuses a document whose aliases expand to more than MAX_YAML_VALUES values.

    PyYAML shares an aliased node instead of copying it, so parsing a billion-laughs file is cheap, but everything
    after it (merging, interpolation, the typed config) walks the expanded tree. The check runs on the composed
    node graph, before any Python object is built, in time linear in the file.
    """

    def compose_document(self) -> Any:
        node = super().compose_document()
        _expanded_size(node, sizes={}, active=set())
        return node


def _expanded_size(node: Any, sizes: dict[int, int], active: set[int]) -> int:
    """Values under the YAML ``node`` (itself included) with every alias expanded; memoized per node."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    where = f"line {node.start_mark.line + 1}, column {node.start_mark.column + 1}"
    if key in active:
        raise _AliasLimitError(
            f"an alias inside the value at {where} refers back to that value (like `a: &a [*a]`), so it expands "
            "forever. Write the nested value out instead of aliasing its parent."
        )
    active.add(key)
    children: list[Any] = []
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, active)
        if total > MAX_YAML_VALUES:
            raise _AliasLimitError(
                f"its YAML aliases (*name) expand the value at {where} to more than {MAX_YAML_VALUES:,} values "
                "(aliases of aliases multiply: an alias bomb). Real configs hold under a thousand; write the repeated "
                "values out or use fewer levels of aliases of aliases."
            )
    active.discard(key)
    sizes[key] = total
    return total


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigFileError(f"config file {path} does not exist; check --config_path / --config_name.")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_BoundedLoader)
    except _AliasLimitError as err:
        raise ConfigFileError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigFileError(f"{path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} must hold a mapping at the top level, got {type(data).__name__}.")
    return data


def _compose(path: Path, stack: tuple[Path, ...], composed: dict[Path, dict[str, Any]]) -> dict[str, Any]:
    """The file at ``path`` with its defaults merged in. ``composed`` caches the files composed so far in this load,
    so a file listed 9 times at each of 7 levels is composed once, not 9**7 times (deep_merge copies what it merges,
    so a cached part is never changed)."""
    path = path.resolve()
    if path in composed:
        return composed[path]
    if path in stack:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigFileError(f"defaults include themselves: {chain}")
    own = _read(path)
    entries = own.pop("defaults", None) or []
    if not isinstance(entries, list):
        raise ConfigFileError(f"{path}: `defaults` must be a list, got {entries!r}.")
    if "_self_" not in entries:
        entries = [*entries, "_self_"]
    merged: dict[str, Any] = {}
    for entry in entries:
        if entry == "_self_":
            part = own
        elif isinstance(entry, str):
            part = _compose(_default_path(path, entry), (*stack, path), composed)
        else:
            raise ConfigFileError(
                f"{path}: defaults entry {entry!r} is not supported; use a relative file such as "
                "`../config/envs@_here_` or `_self_`."
            )
        merged = deep_merge(merged, part)
    composed[path] = merged
    return merged


def _default_path(including: Path, entry: str) -> Path:
    name, _, package = entry.partition("@")
    if package not in ("", "_here_", "_global_"):
        raise ConfigFileError(
            f"{including}: defaults entry {entry!r} places the file under package {package!r}; only @_here_ "
            "(merge at the root) is supported. Move the keys into the file or include it at the root."
        )
    target = including.parent / name
    return target if target.suffix in (".yaml", ".yml") else target.with_suffix(".yaml")


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` merged in: mappings merge key by key, anything else is replaced."""
    result = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = deep_merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def apply_override(root: dict[str, Any], item: str) -> None:
    """Apply one Hydra-style ``a.b.c=value`` override (value parsed as YAML).

    A key the file does not spell out is added (the typed config knows every valid key and rejects the rest by
    name), so ``resume_from_checkpoint=true`` works on a file that leaves it at its default; Hydra's ``+key=``
    spelling is accepted too.
    """
    key, sep, raw = item.partition("=")
    key = key.lstrip("+")
    if not sep or not key:
        raise ConfigFileError(f"override {item!r} must look like key=value (e.g. max_steps=10 or actor_train.x=1).")
    parts = key.split(".")
    node = root
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigFileError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is not a mapping in the config.")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw else None


def resolve_interpolations(root: dict[str, Any], source: str = "the config") -> dict[str, Any]:
    """A copy of ``root`` with every ``${...}`` replaced (see the module docstring); ``source`` names the file
    in errors. Raises ConfigFileError once references copy in more than MAX_RESOLVED_VALUES values or
    MAX_RESOLVED_CHARS characters."""
    resolver = _Resolver(root, source)
    return resolver.value(root, "", ())  # type: ignore[no-any-return]


class _Resolver:
    def __init__(self, root: dict[str, Any], source: str) -> None:
        self.root = root
        self.source = source
        self.values = 0  # values copied in by references so far
        self.chars = 0  # characters copied in by references (strings inside them, text substituted) so far
        self.now = datetime.now()  # one time for every ${now:...} of this load, so the names it builds agree

    def spend(self, values: int, chars: int, chain: tuple[str, ...]) -> None:
        """Count what references copy in; fail once references of references multiplied it past the limits."""
        self.values += values
        self.chars += chars
        if self.values <= MAX_RESOLVED_VALUES and self.chars <= MAX_RESOLVED_CHARS:
            return
        too_many = self.values > MAX_RESOLVED_VALUES
        what = f"{MAX_RESOLVED_VALUES:,} values" if too_many else f"{MAX_RESOLVED_CHARS:,} characters of text"
        refs = " -> ".join(f"${{{ref}}}" for ref in chain)
        raise ConfigFileError(
            f"{self.source}: ${{...}} references copy more than {what} into the config (reached expanding {refs}); "
            "references of references multiply, like a YAML alias bomb. Real configs copy a few hundred values; "
            "refer to the value you need directly instead of nesting references to large sections."
        )

    def value(self, node: Any, where: str, active: tuple[str, ...]) -> Any:
        if active:  # inside a reference: this value is a copy the file did not spell out
            self.spend(1, len(node) if isinstance(node, str) else 0, active)
        if isinstance(node, dict):
            return {k: self.value(v, f"{where}.{k}" if where else str(k), active) for k, v in node.items()}
        if isinstance(node, list):
            return [self.value(v, f"{where}[{i}]", active) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return self.string(node, where, active)
        return node

    def string(self, text: str, where: str, active: tuple[str, ...]) -> Any:
        """Innermost references first, until none is left: ``${a.${b}}`` or ``${oc.env:X,${y}}`` resolve as in
        OmegaConf."""

        def substitute(match: re.Match[str]) -> str:
            ref = match.group(1).strip()
            text = str(self.lookup(ref, where, active))
            self.spend(0, len(text), (*active, ref))
            return text

        while True:
            whole = INTERPOLATION.fullmatch(text.strip())
            if whole:
                return self.lookup(whole.group(1).strip(), where, active)
            resolved = INTERPOLATION.sub(substitute, text)
            if resolved == text or "${" not in resolved:
                return resolved
            text = resolved

    def lookup(self, ref: str, where: str, active: tuple[str, ...]) -> Any:
        if ref in active:
            raise ConfigFileError(f"{where}: interpolation cycle {' -> '.join((*active, ref))}.")
        if ref.startswith("now:"):  # Hydra's resolver: the load's start time in a strftime pattern
            return self.now.strftime(ref[len("now:") :])
        if ref.startswith("oc.env:"):
            return environment_value(ref[len("oc.env:") :], where)
        if ":" in ref:
            raise ConfigFileError(
                f"{where}: resolver interpolation ${{{ref}}} is not supported (only Hydra's ${{now:<strftime>}} and "
                "OmegaConf's ${oc.env:NAME[,default]}); write the value or a plain ${key}."
            )
        node: Any = self.root
        for part in ref.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigFileError(f"{where}: ${{{ref}}} refers to a key the config does not have ({part!r}).")
            node = node[part]
        return self.value(copy.deepcopy(node), ref, (*active, ref))


def environment_value(arguments: str, where: str) -> str | None:
    """OmegaConf's ``oc.env`` resolver on ``NAME`` or ``NAME,default`` (see the module docstring)."""
    name, comma, default = (part.strip() for part in arguments.partition(","))
    if name in os.environ:
        return os.environ[name]
    if not comma:
        raise ConfigFileError(
            f"{where}: ${{oc.env:{name}}} reads the environment variable {name!r}, which is not set; set it, or "
            f"give a default: ${{oc.env:{name},<default>}}."
        )
    return _resolver_default(default, f"{where}: ${{oc.env:{arguments}}}")


_UNSIGNED = r"(0|[1-9](_?[0-9])*)"  # OmegaConf's grammar: no leading zeros, single underscores between digits
_POINT = rf"({_UNSIGNED}?\.[0-9](_?[0-9])*|{_UNSIGNED}\.)"
OMEGACONF_INT = re.compile(rf"[+-]?{_UNSIGNED}")
OMEGACONF_FLOAT = re.compile(rf"[+-]?({_POINT}|({_UNSIGNED}|{_POINT})[eE][+-]?[0-9](_?[0-9])*|inf|nan)", re.IGNORECASE)


def _resolver_default(text: str, where: str) -> str | None:
    """The string OmegaConf makes of an ``oc.env`` default: a quoted string unquoted, ``null`` None, and a bool /
    int / float parsed as OmegaConf's grammar does, then ``str()`` of it (``true`` -> ``True``, ``1e3`` ->
    ``1000.0``); anything else as written."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].replace("\\" + text[0], text[0])
    if "," in text:
        raise ConfigFileError(f"{where}: oc.env takes a variable name and one default; quote a default with commas.")
    lowered = text.lower()
    if lowered == "null":
        return None
    if lowered in ("true", "false"):
        return str(lowered == "true")
    if OMEGACONF_INT.fullmatch(text):
        return str(int(text))
    if OMEGACONF_FLOAT.fullmatch(text):
        return str(float(text))
    return text

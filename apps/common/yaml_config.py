"""Load a ROLL-style YAML config: Hydra ``defaults`` includes, ``${...}`` interpolation, ``key=value`` overrides.

ROLL runs on Hydra / OmegaConf; we read the same files without them:
- ``defaults: [../config/envs@_here_, _self_]`` merges the listed files (relative to the including file, ``.yaml``
  implied) into the root, in order; the file's own keys go where ``_self_`` stands (last when absent, as Hydra).
- ``${key}`` / ``${a.b}`` as a whole value is replaced by the referenced value (any type); inside a longer string it is
  substituted as text. References resolve against the merged root, recursively; cycles and missing keys fail
  naming the key that refers.
- the ``hydra:`` section (Hydra's own run settings) is dropped.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")
IGNORED_SECTIONS = ("hydra",)


class ConfigFileError(ValueError):
    """A config file cannot be read, composed or interpolated; the message names the file and the key."""


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The composed, override-applied and interpolated mapping of the YAML file at ``path``."""
    root = _compose(Path(path), stack=())
    for item in overrides:
        apply_override(root, item)
    for section in IGNORED_SECTIONS:
        root.pop(section, None)
    return resolve_interpolations(root)


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigFileError(f"config file {path} does not exist; check --config_path / --config_name.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigFileError(f"{path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} must hold a mapping at the top level, got {type(data).__name__}.")
    return data


def _compose(path: Path, stack: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
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
            part = _compose(_default_path(path, entry), (*stack, path))
        else:
            raise ConfigFileError(
                f"{path}: defaults entry {entry!r} is not supported; use a relative file such as "
                "`../config/envs@_here_` or `_self_`."
            )
        merged = deep_merge(merged, part)
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


def resolve_interpolations(root: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``root`` with every ``${...}`` replaced (see the module docstring)."""
    resolver = _Resolver(root)
    return resolver.value(root, "", ())  # type: ignore[no-any-return]


class _Resolver:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def value(self, node: Any, where: str, active: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            return {k: self.value(v, f"{where}.{k}" if where else str(k), active) for k, v in node.items()}
        if isinstance(node, list):
            return [self.value(v, f"{where}[{i}]", active) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return self.string(node, where, active)
        return node

    def string(self, text: str, where: str, active: tuple[str, ...]) -> Any:
        whole = INTERPOLATION.fullmatch(text.strip())
        if whole:
            return self.lookup(whole.group(1).strip(), where, active)

        def substitute(match: re.Match[str]) -> str:
            return str(self.lookup(match.group(1).strip(), where, active))

        return INTERPOLATION.sub(substitute, text)

    def lookup(self, ref: str, where: str, active: tuple[str, ...]) -> Any:
        if ref in active:
            raise ConfigFileError(f"{where}: interpolation cycle {' -> '.join((*active, ref))}.")
        if ":" in ref:
            raise ConfigFileError(
                f"{where}: resolver interpolation ${{{ref}}} is not supported; write the value or a plain ${{key}}."
            )
        node: Any = self.root
        for part in ref.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigFileError(f"{where}: ${{{ref}}} refers to a key the config does not have ({part!r}).")
            node = node[part]
        return self.value(copy.deepcopy(node), ref, (*active, ref))

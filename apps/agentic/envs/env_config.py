"""``env_config`` mappings (YAML) -> an environment's typed config dataclass, with errors that name the key.

Each environment type declares its settings as a dataclass (``SokobanConfig``, ``FrozenLakeConfig``, ...); the
mapping's keys must be fields of it and the values must fit the field's type hint. YAML gives lists where a field
wants a tuple (``dim_room: [6, 6]``) and JSON gives string keys where a field wants ``dict[int, str]``; both are
converted. Range checks (``max_steps >= 1``, ...) live in each dataclass's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

C = TypeVar("C")


class EnvConfigError(ValueError):
    """A bad ``env_config`` key or value; the message names ``env_config.<key>`` and how to fix it."""


def parse_env_config(config_cls: type[C], values: Mapping[str, Any] | None, env_type: str) -> C:
    """Build ``config_cls`` from ``values``: unknown keys and ill-typed values raise :class:`EnvConfigError`."""
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise EnvConfigError(f"env_config of env_type {env_type!r} must be a mapping, got {values!r}.")
    fields = {f.name for f in dataclasses.fields(config_cls)}  # type: ignore[arg-type]
    unknown = sorted((key for key in values if key not in fields), key=str)
    if unknown:
        raise EnvConfigError(
            f"env_config.{unknown[0]} is not a setting of env_type {env_type!r} ({config_cls.__name__}); "
            f"valid keys: {sorted(fields)}. Fix the spelling or remove the key."
        )
    hints = typing.get_type_hints(config_cls)
    kwargs = {name: convert_value(hints[name], value, f"env_config.{name}") for name, value in values.items()}
    return config_cls(**kwargs)


def convert_value(hint: Any, value: Any, key: str) -> Any:
    """``value`` checked (and converted: list -> tuple, "3" -> 3 for int dict keys) against type ``hint``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return convert_value(option, value, key)
            except EnvConfigError:
                continue
        raise _wrong_type(hint, value, key)
    if hint is Any:
        return value
    if origin is tuple:
        return _convert_tuple(hint, value, key)
    if origin is dict:
        return _convert_dict(hint, value, key)
    return _convert_scalar(hint, value, key)


def _convert_scalar(hint: Any, value: Any, key: str) -> Any:
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if hint not in (bool, int, float, str):
        raise TypeError(f"{key}: type {hint!r} is not supported in environment configs")
    raise _wrong_type(hint, value, key)


def _convert_tuple(hint: Any, value: Any, key: str) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise _wrong_type(hint, value, key)
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        args = (args[0],) * len(value)
    if len(args) != len(value):
        raise EnvConfigError(f"{key} must have {len(args)} entries ({_name(hint)}), got {value!r}.")
    return tuple(convert_value(arg, item, f"{key}[{i}]") for i, (arg, item) in enumerate(zip(args, value)))


def _convert_dict(hint: Any, value: Any, key: str) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise _wrong_type(hint, value, key)
    key_hint, value_hint = typing.get_args(hint)
    converted = {}
    for item_key, item in value.items():
        if key_hint is int and isinstance(item_key, str) and item_key.strip().lstrip("-").isdigit():
            item_key = int(item_key)  # JSON object keys are strings
        converted[convert_value(key_hint, item_key, f"{key} key")] = convert_value(
            value_hint, item, f"{key}[{item_key!r}]"
        )
    return converted


def _wrong_type(hint: Any, value: Any, key: str) -> EnvConfigError:
    return EnvConfigError(f"{key} must be {_name(hint)}, got {type(value).__name__} {value!r}.")


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")

"""Wrap a scheduler's "get the batch for step N" function so that it dumps or replays.

In dump mode the wrapped function runs and its result is saved; in mock mode it is never called and
the saved batch is returned. Both sync and async functions are supported.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

from rl_replay.errors import ConfigError

StepSpec = str | Callable[..., int] | None
SplitSpec = str | Callable[..., str]
_STEP_NAMES = ("step", "global_step")


class Replay(Protocol):
    """What a wrapper needs from RolloutReplay."""

    mode: str

    def dump(self, step: int, batch: Any, split: str = "train") -> str: ...

    def load(self, step: int, split: str = "train", *, generic: bool = False) -> Any: ...


def _argument_getter(fn: Callable[..., Any], spec: StepSpec) -> Callable[[tuple[Any, ...], dict[str, Any]], int]:
    if callable(spec):
        step_fn = spec
        return lambda args, kwargs: step_fn(*args, **kwargs)
    sig = inspect.signature(fn)
    names = (spec,) if spec else _STEP_NAMES
    name = next((n for n in names if n in sig.parameters), None)
    if name is None:
        raise ConfigError(
            f"cannot find the step argument of {getattr(fn, '__qualname__', fn)}{sig}: looked for "
            f"{' / '.join(names)}. Pass step='<argument name>' or step=<callable(*args, **kwargs) -> int>."
        )

    def get(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return int(bound.arguments[name])

    return get


def make_wrapper(replay: Replay, fn: Callable[..., Any], split: SplitSpec, step: StepSpec) -> Callable[..., Any]:
    """The dumping / replaying version of `fn` (see `RolloutReplay.wrap`)."""
    get_step = _argument_getter(fn, step)

    def get_split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return split(*args, **kwargs) if callable(split) else split

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            n, name = get_step(args, kwargs), get_split(args, kwargs)
            if replay.mode == "mock":
                return replay.load(n, name)
            batch = await fn(*args, **kwargs)
            replay.dump(n, batch, name)
            return batch

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        n, name = get_step(args, kwargs), get_split(args, kwargs)
        if replay.mode == "mock":
            return replay.load(n, name)
        batch = fn(*args, **kwargs)
        replay.dump(n, batch, name)
        return batch

    return wrapper

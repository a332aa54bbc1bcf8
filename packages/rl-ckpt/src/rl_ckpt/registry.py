"""A name -> implementation registry (one per axis; here: model families).

Registering a name twice raises; looking up an unknown name raises with the valid names listed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from rl_ckpt.errors import CheckpointError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to implementations of one axis; ``axis`` and ``flag`` appear in error messages."""

    def __init__(self, axis: str, flag: str) -> None:
        self.axis = axis
        self.flag = flag
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator (or plain call) registering ``item`` under ``name``."""

        def decorator(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.axis} {name!r} is registered twice; pick another name for the new one")
            self._items[name] = item
            return item

        return decorator

    def get(self, name: str) -> T:
        """The implementation registered as ``name``, or a CheckpointError naming the valid choices."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            valid = ", ".join(self.names())
            raise CheckpointError(
                f"unknown {self.axis} {name!r}; supported: {valid}. Pass one of them with {self.flag}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

"""A name -> implementation registry, one per axis (advantage estimator, policy loss, ...).

Registering a name twice raises; looking up an unknown name raises with the valid names listed,
so a typo in a config key surfaces as a readable message instead of a ``KeyError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names (and aliases) to implementations of one axis.

    ``axis`` is what the names choose, e.g. ``"advantage estimator"``; ``config_key`` is the config key a
    user sets to choose one, e.g. ``"adv_estimator"``. Both appear in error messages.
    """

    def __init__(self, axis: str, config_key: str) -> None:
        self.axis = axis
        self.config_key = config_key
        self._items: dict[str, T] = {}
        self._canonical: dict[str, str] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator registering ``fn`` under ``name`` and optional ``aliases``."""

        def decorator(item: T) -> T:
            for key in (name, *aliases):
                if key in self._items:
                    raise ValueError(f"{self.axis} {key!r} is registered twice; pick another name for the new one")
            for key in (name, *aliases):
                self._items[key] = item
                self._canonical[key] = name
            return item

        return decorator

    def get(self, name: str) -> T:
        """Return the implementation registered as ``name``, or raise naming the valid choices."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            valid = ", ".join(sorted(self._items))
            raise ValueError(
                f"unknown {self.axis} {name!r} (config key '{self.config_key}'); valid names: {valid}"
            ) from None

    def canonical_name(self, name: str) -> str:
        """The primary name of ``name`` (resolving aliases); raises like :meth:`get` when unknown."""
        self.get(name)
        return self._canonical[name]

    def names(self) -> list[str]:
        """Primary names, sorted (aliases excluded)."""
        return sorted(set(self._canonical.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

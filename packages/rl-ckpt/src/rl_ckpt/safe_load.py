"""Unpickling checkpoint files without running code from them.

A real Megatron-LM checkpoint pickles more than tensors: ``args`` is an ``argparse.Namespace`` holding enums
(``AttnBackend``), and the RNG state holds numpy arrays; Transformer-Engine ``_extra_state`` entries are ``BytesIO``
objects, dist_checkpointing's ``.metadata`` holds torch.distributed.checkpoint dataclasses. ``torch.load(...,
weights_only=True)`` refuses all of them unless the classes are imported and allow-listed (megatron-core does that
for its own classes on import, so a converter would have to import megatron to read its files).

rl-ckpt needs none of those objects, only tensors and the plain numbers / strings / booleans of ``args``. So every
class that torch's weights-only unpickler does not already allow becomes an :class:`Opaque` placeholder: a class
defined here that records its name and the arguments it was given and does nothing else. No code from the file runs
and nothing is imported; references to ``os`` / ``sys`` are refused outright. ``trust=True`` (``--trust_checkpoint``)
unpickles with plain ``pickle`` instead, for files whose pickles the placeholders cannot stand in for.
"""

from __future__ import annotations

import argparse
import io
import pickle
import types
from pathlib import Path
from typing import IO, Any, ClassVar

import torch

from rl_ckpt.errors import CheckpointError

REAL_CLASSES: tuple[type, ...] = (argparse.Namespace, types.SimpleNamespace)
"""Attribute bags rebuilt as themselves (Megatron's ``args``): their attributes are set, no method runs."""


class Opaque:
    """Stands in for an object of a class that is not allow-listed; holds what the pickle gave it, runs nothing."""

    qualname: ClassVar[str] = "?"
    """``module.name`` of the class it stands for."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = object.__new__(cls)
        obj.__dict__["pickled_args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["pickled_state"] = state

    def __repr__(self) -> str:
        return f"<opaque {self.qualname}>"


def opaque_class(qualname: str) -> type[Opaque]:
    """A fresh :class:`Opaque` subclass standing for the class or function ``qualname``."""
    return type(f"Opaque[{qualname}]", (Opaque,), {"qualname": qualname})


def _trust_hint(path: Path, err: Exception) -> CheckpointError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return CheckpointError(
        f"{path} holds pickled objects rl-ckpt will not rebuild without running code from the file ({first}); "
        "re-run with --trust_checkpoint to unpickle it (this runs code from the file: only for checkpoints you trust)"
    )


def load_torch_file(path: Path, *, trust: bool = False, mmap: bool = True, meta: bool = False) -> Any:
    """``torch.load(path)`` on CPU; without ``trust`` unknown classes become :class:`Opaque` (see the module doc).

    ``mmap``: tensors stay in the page cache until touched (peak memory is what the caller keeps, not the file).
    ``meta``: tensors on the meta device, nothing read (``torch_zip.locate_storages`` finds their bytes).
    """
    location = "meta" if meta else "cpu"
    mmap = mmap and not meta
    try:
        if trust:
            return torch.load(path, map_location=location, weights_only=False, mmap=mmap)
        try:
            unknown = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except ValueError:  # not a zip checkpoint (pre-1.6 format): torch.load reports it below
            unknown = []
        real = {f"{cls.__module__}.{cls.__qualname__}" for cls in REAL_CLASSES}
        stand_ins = [(opaque_class(name), name) for name in unknown if name not in real]
        with torch.serialization.safe_globals([*REAL_CLASSES, *stand_ins]):
            return torch.load(path, map_location=location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise _trust_hint(path, err) from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}; the file is corrupt or truncated") from None


def load_torch_bytes(data: IO[bytes], where: str, *, meta: bool = False) -> Any:
    """A ``torch.save`` blob inside a bigger file (a dist_checkpointing chunk), weights only: tensors and containers;
    ``meta``: on the meta device, nothing read."""
    try:
        return torch.load(data, map_location="meta" if meta else "cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"cannot read {where}: {str(err).splitlines()[0]}; the file is corrupt") from None


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the names in ``allowed``; any other name becomes an :class:`Opaque`.

    ``os``, ``sys``, ``posix``, ``nt``, ``subprocess`` and ``builtins`` names are refused (a data file never needs
    them), except the plain containers in ``BUILTINS``. Every callable the pickle can reach is therefore either
    allow-listed by the caller, one of those containers, or a placeholder.
    """

    REFUSED_MODULES: ClassVar[frozenset[str]] = frozenset({"os", "sys", "posix", "nt", "subprocess", "builtins"})
    BUILTINS: ClassVar[dict[str, type]] = {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex}

    def __init__(self, file: io.BufferedIOBase, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        """The allow-listed object, or a placeholder class; raises for modules that only code execution needs."""
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        if module == "builtins" and name in self.BUILTINS:
            return self.BUILTINS[name]
        if module.split(".")[0] in self.REFUSED_MODULES:
            raise pickle.UnpicklingError(f"refusing to resolve {module}.{name}")
        return opaque_class(f"{module}.{name}")


def load_restricted_pickle(path: Path, allowed: dict[tuple[str, str], Any]) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler`; CheckpointError naming the file when it fails."""
    try:
        with path.open("rb") as f:
            return RestrictedUnpickler(f, allowed).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as err:
        raise CheckpointError(f"cannot read {path}: {err}; the file is corrupt or not a checkpoint file") from None

"""Test-harness import hooks. Never imported by product code.

``after_import(name, hook)`` runs ``hook(module)`` as soon as module ``name`` has executed, before anything else can
copy its names; the megatron shims (tests/rl_engines/megatron_shims.py) and the cache below use it.

The cache of transformers' import-structure scan: ``import transformers`` (5.x) reads every file under
``transformers/models`` to build its lazy module table (``define_import_structure``), about 0.8 s of CPU in every
process that imports it, and the test session starts some two hundred such processes (each Ray worker). The table is
a pure function of the installed files, so the harness keeps it in ``<repo>/.cache/transformers_import_structure``,
keyed by the scanned folder and the modification times of that folder and of transformers' ``import_utils.py``: the
first process of a fresh checkout builds each entry, the others read it. transformers itself is unchanged; a missing
or unreadable entry falls back to the scan.

``tests/harness_site/sitecustomize.py`` loads this module (as ``import_hooks``) and calls
``cache_transformers_import_structure()`` at the start-up of every Python process the test session starts
(``tests/conftest.py`` runs it in the session's own process and puts that folder first on ``PYTHONPATH``).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "transformers_import_structure"
IMPORT_UTILS = "transformers.utils.import_utils"
_HOOKS: dict[str, list[Callable[[Any], None]]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the hooked modules as Python would and runs their hooks right after each has executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_then_hooks(module: Any) -> None:
            run(module)
            for hook in _HOOKS[name]:
                hook(module)

        spec.loader.exec_module = run_then_hooks  # type: ignore[method-assign]
        return spec


def after_import(name: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` once module ``name`` has executed (at once when it already has)."""
    if name in sys.modules:
        hook(sys.modules[name])
        return
    _HOOKS.setdefault(name, []).append(hook)
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _cached(original: Any, source: str) -> Any:
    def define_import_structure(*args: Any, **kwargs: Any) -> Any:
        folder = os.fspath(args[0] if args else kwargs["module_path"])
        stamp = (os.stat(folder).st_mtime_ns, os.stat(source).st_mtime_ns)
        key = hashlib.sha256(repr((folder, stamp, args[1:], sorted(kwargs.items()))).encode()).hexdigest()[:32]
        path = CACHE_DIR / f"{key}.pickle"
        try:
            return pickle.loads(path.read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
        value = original(*args, **kwargs)
        try:
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            partial.write_bytes(pickle.dumps(value))
            os.replace(partial, path)  # whole or absent for a concurrent reader
        except OSError:
            pass
        return value

    return define_import_structure


def _cache_in(module: Any) -> None:
    original = getattr(module, "define_import_structure", None)
    if original is not None and not original.__qualname__.startswith("_cached"):
        module.define_import_structure = _cached(original, module.__file__)


def cache_transformers_import_structure() -> None:
    """Cache the scan in this process from now on (a transformers already imported has scanned already)."""
    after_import(IMPORT_UTILS, _cache_in)

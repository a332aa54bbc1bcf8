"""Test-harness cache of transformers' import-structure scan. Never imported by product code.

``import transformers`` (5.x) reads every file under ``transformers/models`` to build its lazy module table
(``define_import_structure``): about 0.8 s of CPU in every process that imports it, and the test session starts some
two hundred such processes (each Ray worker). The table is a pure function of the installed files, so the harness
keeps it in ``<repo>/.cache/transformers_import_structure``, keyed by the scanned folder and the modification times
of that folder and of transformers' ``import_utils.py``: the first process of a fresh checkout builds each entry, the
others read it. transformers itself is unchanged; a missing or unreadable entry falls back to the scan.

``install()`` arranges it for this process (before transformers is imported); ``tests/harness_site/sitecustomize.py``
calls it at the start-up of every Python process the test session starts (``tests/conftest.py`` puts that folder
first on ``PYTHONPATH``).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import sys
from pathlib import Path
from typing import Any

CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "transformers_import_structure"
MODULE = "transformers.utils.import_utils"


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


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        if hasattr(module, "define_import_structure"):
            module.define_import_structure = _cached(module.define_import_structure, module.__file__)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Cache the scan in this process from now on (no-op when installed, or when transformers is already imported)."""
    if MODULE not in sys.modules and not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

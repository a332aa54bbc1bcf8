"""Start-up hook of every Python process the test session starts (tests/conftest.py puts this folder first on
PYTHONPATH): loads the harness's import hooks (tests/import_hooks.py) as ``import_hooks``, caches transformers'
import-structure scan with them, arranges that megatron-core gets the CPU shims (tests/rl_engines/megatron_shims.py)
when, and only when, a process imports it, and starts Ray's workers through the fork server of worker_zygote.py (this
folder) where the session asks for it."""

import importlib.util
import pathlib
import sys

_TESTS = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str, path: pathlib.Path, attribute: str):  # type: ignore[no-untyped-def]
    """The harness module ``name`` from ``path`` (once per process: the session's own process runs this hook too)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    if not hasattr(module, attribute):
        spec.loader.exec_module(module)
    return module


_load("import_hooks", _TESTS / "import_hooks.py", "after_import").cache_transformers_import_structure()
_load("megatron_shims", _TESTS / "rl_engines" / "megatron_shims.py", "apply_on_import").apply_on_import()
_load("worker_zygote", _TESTS / "harness_site" / "worker_zygote.py", "intercept").intercept()

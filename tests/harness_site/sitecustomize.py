"""Start-up hook of every Python process the test session starts (tests/conftest.py puts this folder first on
PYTHONPATH): the harness's cache of transformers' import-structure scan (tests/transformers_import_cache.py)."""

import importlib.util
import pathlib
import sys

_path = pathlib.Path(__file__).resolve().parents[1] / "transformers_import_cache.py"
_spec = importlib.util.spec_from_file_location("transformers_import_cache", _path)
if _spec is not None and _spec.loader is not None:
    _module = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
    if not hasattr(_module, "install"):
        _spec.loader.exec_module(_module)
    _module.install()

"""Start-up hook of every Python process the test session starts (tests/conftest.py puts this folder first on
PYTHONPATH): loads the harness's import hooks (tests/import_hooks.py) as ``import_hooks`` and caches transformers'
import-structure scan with them."""

import importlib.util
import pathlib
import sys

_path = pathlib.Path(__file__).resolve().parents[1] / "import_hooks.py"
_spec = importlib.util.spec_from_file_location("import_hooks", _path)
if _spec is not None and _spec.loader is not None:
    _module = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
    if not hasattr(_module, "after_import"):
        _spec.loader.exec_module(_module)
    _module.cache_transformers_import_structure()

"""The harness's cache of transformers' import-structure scan (tests/import_hooks.py) returns what the scan
returns, and this session's processes use it."""

import os
import subprocess
import sys
from pathlib import Path

import transformers
import transformers.utils.import_utils as import_utils

from tests import import_hooks as cache


def test_the_cached_table_is_the_scan_and_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path)
    models = Path(transformers.__file__).parent / "models"
    scan = import_utils.spread_import_structure(import_utils.create_import_structure_from_path(str(models)))
    calls = []

    def original(*args, **kwargs):
        calls.append(args)
        return import_utils.spread_import_structure(import_utils.create_import_structure_from_path(str(args[0])))

    cached = cache._cached(original, import_utils.__file__)
    assert cached(models) == scan and len(calls) == 1 and len(list(tmp_path.glob("*.pickle"))) == 1
    assert cached(models) == scan and len(calls) == 1  # read back, not scanned again


def test_every_process_of_the_session_uses_it():
    """This process (tests/conftest.py) and a child, which inherits the harness's sitecustomize on PYTHONPATH."""
    assert "_cached" in import_utils.define_import_structure.__qualname__
    probe = "import transformers.utils.import_utils as m; print(m.define_import_structure.__qualname__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.startswith("_cached")

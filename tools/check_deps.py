"""Check that installing rl-core pulls only torch, numpy and their own dependencies.

Asks pip to resolve ``packages/rl-core`` (with torch pinned to the on-disk CPU wheel) in a dry run against an
empty environment, and compares the resolved set with what torch and numpy need themselves.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# torch's own runtime dependencies on Linux CPU wheels, and numpy (which has none).
ALLOWED = {
    "rl-core", "torch", "numpy", "filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2",
    "markupsafe", "fsspec", "setuptools",
}  # fmt: skip


def resolve(package_dir: Path) -> set[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", "--report", "-", str(package_dir), "torch==2.13.0"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    return {item["metadata"]["name"].lower().replace("_", "-") for item in report["install"]}


def main() -> int:
    resolved = resolve(ROOT / "packages" / "rl-core")
    extra = sorted(resolved - ALLOWED)
    if extra:
        print(f"rl-core pulls packages beyond torch / numpy and their deps: {extra}")
        return 1
    print(f"rl-core dependency closure OK: {sorted(resolved)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

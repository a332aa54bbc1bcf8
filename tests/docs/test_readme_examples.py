"""The Python examples in the READMEs are run, so they stay true.

Rule: every ```python block of a README in ``READMES`` is executed, in its own namespace, except blocks that
contain ``start_ray(``. Those start a Ray cluster (minutes of worker start-up, ports, temp dirs), so they are only
compiled, which catches syntax errors. Each README must keep at least one block that is executed.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMES = [
    ROOT / "README.md",
    ROOT / "packages" / "rl-core" / "README.md",
    ROOT / "packages" / "rl-engines" / "README.md",
    ROOT / "docs" / "agentic.md",
]
NOT_RUN_MARKER = "start_ray("
"""A block containing this string needs a Ray cluster; it is compiled but not executed."""


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run(readme):
    blocks = python_blocks(readme)
    runnable = [block for block in blocks if NOT_RUN_MARKER not in block]
    assert runnable, f"{readme} has no python example that the tests run"
    for block in blocks:
        code = compile(block, str(readme), "exec")
        if block in runnable:
            exec(code, {"__name__": "__readme__"})

"""The Python examples in the READMEs are run, so they stay true."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", ROOT / "packages" / "rl-core" / "README.md"]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run(readme):
    blocks = python_blocks(readme)
    assert blocks, f"{readme} has no python example"
    for block in blocks:
        exec(compile(block, str(readme), "exec"), {"__name__": "__readme__"})

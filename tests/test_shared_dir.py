"""tests/shared_dir.py: ../shared is found beside the checkout; missing, it skips a test (with the path named) and
fails it under CI; every test reading it goes through the helper."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import shared_dir
from tests.shared_dir import require_shared, roll_example_files, under_ci

TESTS = Path(__file__).resolve().parent


def test_shared_is_the_folder_beside_the_checkout():
    beside_checkout = TESTS.parent.parent / "shared"
    assert beside_checkout == shared_dir.SHARED_DIR
    assert shared_dir.ROLL_EXAMPLES == shared_dir.SHARED_DIR / "roll-examples"


CI_VALUES = [("true", True), ("1", True), ("True", True), ("yes", True), ("", False), ("0", False), ("false", False),
             ("no", False)]  # fmt: skip


@pytest.mark.parametrize(("value", "expected"), CI_VALUES)
def test_ci_detection(monkeypatch, value, expected):
    monkeypatch.setenv("CI", value)
    assert under_ci() is expected
    monkeypatch.delenv("CI")
    assert under_ci() is False


def test_an_existing_path_is_returned(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require_shared(tmp_path) == tmp_path


@pytest.mark.parametrize("ci", [None, "false"])
def test_a_missing_path_skips_outside_ci_naming_it(tmp_path, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    missing = tmp_path / "roll-examples"
    with pytest.raises(pytest.skip.Exception, match=re.escape(f"{missing} is missing")) as info:
        require_shared(missing)
    assert "../shared" in str(info.value)


def test_a_missing_path_fails_under_ci(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    missing = tmp_path / "roll-examples"
    with pytest.raises(pytest.fail.Exception, match=re.escape(f"{missing} is missing")) as info:
        require_shared(missing)
    assert "CI='true'" in str(info.value)


def test_example_files_are_never_an_empty_parameter_list(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    for name in ("b.yaml", "a.yaml", "c.txt"):
        (tmp_path / "a" / name).write_text("x: 1\n")
    monkeypatch.setattr(shared_dir, "ROLL_EXAMPLES", tmp_path)
    assert roll_example_files("a/*.yaml", "a/a.*") == [tmp_path / "a" / "a.yaml", tmp_path / "a" / "b.yaml"]
    assert roll_example_files("nothing/*.yaml", "nor/*.yaml") == [tmp_path / "nothing" / "*.yaml"]
    monkeypatch.setattr(shared_dir, "ROLL_EXAMPLES", tmp_path / "absent")
    (placeholder,) = roll_example_files("a/*.yaml")
    assert placeholder == tmp_path / "absent" / "a" / "*.yaml"
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=re.escape(f"{placeholder} is missing")):
        require_shared(placeholder)


def test_every_test_reads_shared_through_the_helper():
    """No test builds its own path to ../shared (an absolute one skipped silently on other machines)."""
    own_paths = re.compile(r"""roll-examples|["']/work/|/\s*["']shared["']""")
    offenders = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.rglob("*.py"))
        if path.name not in ("shared_dir.py", Path(__file__).name) and own_paths.search(path.read_text("utf-8"))
    ]
    assert offenders == []

"""ROLL's code reward (``CodeSandboxRewardWorker``): the response's code against the record's test cases, in the
sandbox (``apps.common.sandbox``); score and reward 1 when every case passes, else 0.

A record carries ROLL's columns: ``case_type``, ``test_cases`` (a list, or its JSON) and, for call-based problems,
``test_case_function``. The case types (ROLL's local tester, itself after LiveCodeBench):

- ``input`` (the default): each case ``{"stdin", "expected_stdout"}``; the program reads stdin and must print the
  expected output (compared line by line after stripping, else token by token, numbers within 1e-6). With
  ``test_case_function`` the stdin lines are JSON arguments of that function (or ``Solution().<name>``) and its
  return value must equal the JSON expected output.
- ``assert`` / ``pytest``: each case ``{"assert_code"}`` runs after the code; ``test_*`` functions are called.
- ``check_based``: one case ``{"assert_code", "entry_point", "import_prefix"}``; its first line is run with each
  later line, then ``check(<entry_point>)``.
- ``text``: each case's ``assert_code`` with ``{response}`` replaced by the response itself (no code extracted).

The code is the first fenced block that defines a function (else the first block) after the last ``</think>``; a
response without a fence is taken whole. ``use_local: true`` (every ROLL example) grades here; ROLL's remote HTTP
sandbox (``use_local: false`` with ``code_url``) is not built, and such a section is refused.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from apps.common.sandbox import Limits, RunResult, Sandbox, missing_isolation
from apps.rlvr.config import RewardConfig, RewardSpec
from apps.rlvr.rewards import REWARD_FUNCTIONS

PRELUDE = """import sys, os, re, math, json, string, itertools, functools, collections, heapq, bisect, copy, random
from typing import *
from collections import *
from itertools import *
from functools import *
from heapq import *
from bisect import *
from math import inf
sys.setrecursionlimit(10 ** 6)
"""
"""What ROLL's testers put before the code: the imports solutions of these data sets take for granted."""

CALL_HARNESS = """
import json as _json, sys as _sys
_args = [_json.loads(_line) for _line in _sys.stdin.read().split("\\n") if _line.strip()]
_target = Solution().{name} if "Solution" in globals() else {name}
print(_json.dumps(_target(*_args)))
"""

_SANDBOX: Sandbox | None = None
WORKERS = 4
"""Sandboxed processes per reward process at once (the section's ``world_size`` Ray actors each have a pool)."""


def sandbox() -> Sandbox:
    """This process's sandbox pool (made on first use)."""
    global _SANDBOX
    if _SANDBOX is None:
        _SANDBOX = Sandbox(Limits(), workers=WORKERS)
    return _SANDBOX


# ---- the response's code ------------------------------------------------------------------------------------------
FENCE = re.compile(r"```([\w+#.-]*)[ \t]*\n?(.*?)```", re.S)


def extract_code(response: str) -> str:
    """The code of a response: after ``<|begin_of_solution|>`` and the last ``</think>``, the first fenced block
    with a ``def`` (else the first block); the whole text when nothing is fenced."""
    text = response.split("<|begin_of_solution|>")[-1]
    text = text.split("</think>")[-1].strip()
    if "```" not in text:
        return text
    blocks = [str(body) for _, body in FENCE.findall(text)]
    with_def = [block for block in blocks if "def " in block]
    return (with_def or blocks or [""])[0]


# ---- programs per case type ---------------------------------------------------------------------------------------
def test_cases(record: dict[str, Any]) -> list[Any]:
    """The record's ``test_cases`` (a list or its JSON); names the column when missing or malformed."""
    if "test_cases" not in record:
        raise KeyError(f"a code record needs a test_cases column; columns: {sorted(record)}")
    cases = record["test_cases"]
    cases = json.loads(cases) if isinstance(cases, str) else cases
    if not isinstance(cases, list):
        raise ValueError(f"test_cases must be a list (or its JSON), got {type(cases).__name__}")
    return cases


def _assert_code(case: Any) -> str:
    return str(case["assert_code"]) if isinstance(case, dict) else str(case)


def _test_runner(assert_code: str) -> str:
    names = re.findall(r"^def (test_\w+)\s*\(", assert_code, flags=re.M)
    return "".join(f"\n{name}()" for name in names)


@dataclass(frozen=True)
class Finished:
    """A test program passes when it gets to its end: its last stdout line is this run's secret token (so that
    ``sys.exit(0)`` or ``os._exit(0)`` in the response cannot pass the asserts after it)."""

    token: str


def _to_the_end(source: str) -> tuple[str, Finished]:
    token = secrets.token_hex(16)
    return f"{source}\nprint({token!r})\n", Finished(token)


def _run_to_the_end(sources: list[str]) -> tuple[list[tuple[str, str]], list[str | Finished | None], bool]:
    planned = [_to_the_end(source) for source in sources]
    return [(source, "") for source, _ in planned], [end for _, end in planned], False


def jobs(response: str, record: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str | Finished | None], bool]:
    """The sandbox runs grading ``response`` needs: ``(source, stdin)`` pairs, what each must print (the expected
    stdout, or a ``Finished`` token for test programs that pass by running to their end), and whether outputs are
    JSON values (call-based) rather than text."""
    case_type = str(record.get("case_type") or "input")
    cases = test_cases(record)
    if case_type == "text":
        return _run_to_the_end([_assert_code(c).replace("{response}", repr(response)) for c in cases])
    code = extract_code(response)
    if case_type in ("assert", "pytest"):
        return _run_to_the_end(
            [f"{PRELUDE}\n{code}\n{_assert_code(c)}\n{_test_runner(_assert_code(c))}" for c in cases]
        )
    if case_type == "check_based":
        return _check_based(code, cases)
    if case_type != "input":
        raise ValueError(f"case_type {case_type!r} is not one of input, assert, pytest, check_based, text")
    function = str(record.get("test_case_function") or "")
    if function and function != "None":
        source = f"{PRELUDE}\n{code}\n{CALL_HARNESS.format(name=function)}"
        return [(source, str(c["stdin"])) for c in cases], [str(c["expected_stdout"]) for c in cases], True
    return [(f"{PRELUDE}\n{code}", str(c["stdin"])) for c in cases], [str(c["expected_stdout"]) for c in cases], False


def _check_based(code: str, cases: list[Any]) -> tuple[list[tuple[str, str]], list[str | Finished | None], bool]:
    if not cases:
        return [], [], False
    case = cases[0]
    lines = [line for line in str(case["assert_code"]).split("\n") if line]
    solution = f"{PRELUDE}\n{case.get('import_prefix', '')}{code}"
    entry = case.get("entry_point", "candidate")
    checks = [f"{lines[0]}\n{line}" for line in lines[1:]] or lines[:1]
    return _run_to_the_end([f"{solution}\n{check}\ncheck({entry})" for check in checks])


# ---- comparing outputs --------------------------------------------------------------------------------------------
def same_output(actual: str, expected: str) -> bool:
    """Line by line after stripping; else token by token; else every token a number within 1e-6 (relative or
    absolute)."""
    if _lines(actual) == _lines(expected):
        return True
    got, want = actual.split(), expected.split()
    if got == want:
        return True
    if len(got) != len(want):
        return False
    try:
        return all(math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(got, want))
    except ValueError:
        return False


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def same_value(actual: str, expected: str) -> bool:
    """Call-based: the printed JSON equals the expected JSON value."""
    try:
        return bool(json.loads(actual) == json.loads(expected))
    except ValueError:
        return False


def passed(result: RunResult, expected: str | Finished | None, as_json: bool) -> bool:
    """Whether one run passed its case."""
    if not result.ok:
        return False
    if expected is None:
        return True
    if isinstance(expected, Finished):
        lines = result.stdout.strip().splitlines()
        return bool(lines) and lines[-1].strip() == expected.token
    return same_value(result.stdout, expected) if as_json else same_output(result.stdout, expected)


# ---- the reward ---------------------------------------------------------------------------------------------------
def check_section(name: str, section: RewardConfig) -> None:
    """Pre-flight: ROLL's remote sandbox is not built, and this machine can isolate the local one."""
    missing = missing_isolation()
    if missing:
        raise ValueError(
            f"rewards.{name}: the code sandbox runs responses only in isolated processes, and this machine lacks "
            f"{' and '.join(missing)}; grade code on a machine that has them."
        )
    if not section.spec.use_local:
        raise ValueError(
            f"rewards.{name}: use_local is false, which asks for ROLL's remote HTTP sandbox (code_url); only the "
            f"local sandbox is built here. Set rewards.{name}.use_local: true to grade in local sandboxed processes."
        )


@REWARD_FUNCTIONS.register("code_sandbox", "CodeSandboxRewardWorker")
def code_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """1.0 when the response passes every test case of its record in the sandbox, else 0.0."""
    return code_rewards([response], [record], spec)[0]


def code_rewards(responses: list[str], records: list[dict[str, Any]], spec: RewardSpec) -> list[float]:
    """Every response's reward; all their test cases run on the sandbox pool at once."""
    planned = [jobs(response, record) for response, record in zip(responses, records)]
    flat = [job for runs, _, _ in planned for job in runs]
    results = iter(sandbox().run_many(flat))
    rewards = []
    for runs, expected, as_json in planned:
        outcomes = [passed(next(results), want, as_json) for _, want in zip(runs, expected)]
        rewards.append(1.0 if outcomes and all(outcomes) else 0.0)
    return rewards


code_reward.check_section = check_section  # type: ignore[attr-defined]
code_reward.many = code_rewards  # type: ignore[attr-defined]

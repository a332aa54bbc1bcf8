"""Tool use around an environment: ROLL's ``custom_envs.<tag>.tool_wrapper`` (GEM's ``ToolEnvWrapper`` semantics).

A tag with a ``tool_wrapper`` runs its environment inside :class:`ToolEnv`. The first observation is followed by
each tool's instructions. Every response is offered to the tools in turn (while fewer than ``max_tool_uses`` calls
were made): a tool that finds its call in the response runs it, and its result is the next observation, given to the
model as a ``tool`` message; the step earns ``tool_reward`` (plus ``tool_success_reward`` when the call ran without
error) and ends nothing. A response no tool takes (or one past ``max_tool_uses``) goes to the environment, as its
answer. Tool calls count toward the episode's ``max_steps``, as in ROLL. Each episode reports
``tool_use_counter`` / ``tool_success_counter`` (``env/<tag>/...`` metrics).

Tools (``tool_configs: [{tool_id, tool_args}]``): ``python_code`` (:class:`PythonCodeTool`, ROLL's): the first
``<code>...</code>`` or ```` ```python ...``` ```` block runs in the code sandbox of ``apps.common.sandbox``.
"""

from __future__ import annotations

import math
import re
import signal
from dataclasses import dataclass, field
from typing import Any

from apps.agentic.envs.base import Frame, StepResult, TextEnv
from apps.common.config import checked_section
from apps.common.sandbox import Limits, Sandbox, missing_isolation
from rl_engines.config import WorkerConfigError, build_dataclass

ROLL_PYTHON_INSTRUCTION = (
    "Initially, when solving a question, you would need to think step by step, without the ability to use code for "
    "calculation. Now, you have the capability to write code to use the code interpreter for calculation. The code "
    "will be executed by a sandbox, and the result can be returned to enhance your reasoning process. your "
    "calculation while still maintaining the reasoning process.The thinking process can have multiple code "
    "snippets. Each code snippet is wrapped with: <code>...</code>, and should be executable.Details:1. Identify "
    "sections where code execution could speed up the reasoning process or make the calculation more accurate.2. "
    "Replace the manual calculation steps with code snippets and the corresponding interpreter's execution "
    "results.3. Keep the logical flow of the reasoning process intact, including any failed exploration attempts "
    "that were part of the initial process.4. The code snippets should be complete scripts, including necessary "
    "imports, and should not contain markdown symbols like <python>...‹/python>.5. Outputs in the code snippets must "
    "explicitly call the print function.6. Execution results should match the model's output exactly, with no extra "
    "or missing tokens."
)
"""The instructions ROLL's python_code tool gives the model (its text as ROLL's code concatenates it): what a model
trained with ROLL reads, so it is kept word for word."""
ROLL_PYTHON_PATTERNS = (r"<code>(.*?)</code>", r"```\n?python(.*?)```")
"""Where ROLL's python_code tool finds a call: the first match that ends earliest."""
BLOCKED_NAMES = ("subprocess", "multiprocessing", "threading", "socket", "psutil", "resource", "ctypes")
BLOCKED_CALLS = ("os.system", "os.popen", "os.spawn", "os.fork", "os.exec", "sys.exit", "os._exit", "os.kill")
BLOCKED = "Execution blocked: Code contains potentially dangerous operations or imports."
"""``sandbox_type: none``: GEM refuses code importing these modules or making these calls, with this message."""
FALLBACK_IMPORTS = """\
import bisect, collections, copy, datetime, functools, heapq, itertools, math, operator, random, re, string
from bisect import bisect, bisect_left, bisect_right, insort
from collections import Counter, OrderedDict, defaultdict, deque
from copy import deepcopy
from functools import cache, cmp_to_key, lru_cache, reduce
from heapq import heapify, heappop, heappush, heapreplace, merge, nlargest, nsmallest
from itertools import (accumulate, chain, combinations, count, cycle, groupby, islice, pairwise, permutations,
                       product, repeat, zip_longest)
from math import atan2, ceil, comb, factorial, floor, gcd, inf, isqrt, log, log2, log10, pi, prod, sqrt
from operator import itemgetter, or_, sub, xor
from random import randrange, shuffle
from string import ascii_lowercase, ascii_uppercase
from time import time
from typing import Any, Callable, Deque, Dict, Generator, Iterable, Iterator, List, Optional, Set, Tuple, Union
try:
    import numpy as np
except ImportError:
    pass
try:
    import pandas as pd
except ImportError:
    pass
"""
"""A program that failed on an undefined name runs once more after these imports (GEM's second try: a model's
``sqrt(2)`` without ``import math`` still gets its result)."""
MAX_USES_NOTE = "\n\nReached the maximum number of tool use. Please output final answer directly."


@dataclass(frozen=True)
class ToolCall:
    """One response offered to a tool: whether it held a call (``parsed``), whether running it failed, and the
    observation the model gets back."""

    parsed: bool
    error: bool
    observation: str


@dataclass(frozen=True)
class PythonCodeArgs:
    """``tool_args`` of ``tool_id: python_code`` (ROLL's PythonCodeTool)."""

    timeout: float = 5.0
    """Seconds a program may run (wall clock and CPU)."""
    sandbox_type: str = "none"
    """GEM's isolation: ``none`` (a plain subprocess that refuses code naming dangerous modules or calls) or
    ``bwrap`` (bubblewrap). Programs run in this project's sandbox either way (isolated processes); ``none`` keeps
    GEM's refusal and its message, so a model sees what it saw under ROLL."""
    keep_error_last_line: bool = False
    """Show only the last line of a failing program's stderr."""
    tool_instruction: str | None = None
    """The instructions shown to the model (null: ROLL's)."""
    patterns: list[str] | None = None
    """Regexes whose first group is the code (null: ROLL's ``<code>`` and ```` ```python ```` blocks)."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout}: give the seconds a program may run (> 0).")
        if self.sandbox_type not in ("none", "bwrap"):
            raise ValueError(f"sandbox_type={self.sandbox_type!r}: use none or bwrap (GEM's).")
        for pattern in self.patterns or ():
            try:
                groups = re.compile(pattern, re.DOTALL).groups
            except re.error as err:
                raise ValueError(f"patterns: {pattern!r} is not a regex ({err}).") from None
            if groups < 1:
                raise ValueError(f"patterns: {pattern!r} has no group to hold the code.")


class PythonCodeTool:
    """ROLL's ``python_code`` tool: the response's first code block, run in the sandbox; its output is the result."""

    name = "python_code"
    config_cls = PythonCodeArgs

    def __init__(self, args: PythonCodeArgs) -> None:
        self.args = args
        self.patterns = tuple(args.patterns or ROLL_PYTHON_PATTERNS)
        # the wall clock is the limit (GEM's timeout); CPU time a second more, as a backstop
        self.sandbox = Sandbox(Limits(cpu_seconds=math.ceil(args.timeout) + 1, wall_seconds=args.timeout), workers=1)

    @property
    def instructions(self) -> str:
        return self.args.tool_instruction or ROLL_PYTHON_INSTRUCTION

    def parse(self, action: str) -> str | None:
        """The code of the first call in ``action`` (of each pattern's first match, the one ending first), or None."""
        found = None
        end = len(action)
        for pattern in self.patterns:  # a later pattern's match wins a tie, as in ROLL
            match = re.search(pattern, action, re.DOTALL)
            if match and match.end() <= end:
                found, end = match.group(1).strip(), match.end()
        return found

    def call(self, action: str) -> ToolCall:
        code = self.parse(action)
        if code is None:
            return ToolCall(parsed=False, error=True, observation="")
        ok, stdout, stderr = self.run(code)
        if stderr and self.args.keep_error_last_line:
            stderr = stderr.split("\n")[-1]
        result = (f"{stdout}\n{stderr}" if stderr else stdout).lstrip(" \n")
        return ToolCall(parsed=True, error=not ok or not result, observation=f"Code execution result: {result}\n")

    def run(self, code: str) -> tuple[bool, str, str]:
        """``(ran cleanly, stdout, stderr)``; a program that failed on an undefined name runs again after
        :data:`FALLBACK_IMPORTS`."""
        if self.args.sandbox_type == "none" and _blocked(code):
            return False, "", BLOCKED
        outcome = self.sandbox.run(code)
        if not outcome.ok and "is not defined" in outcome.stderr:
            outcome = self.sandbox.run(f"{FALLBACK_IMPORTS}\n{code}")
        if outcome.timed_out or outcome.exit_code == -signal.SIGXCPU:  # GEM keeps no output of a program out of time
            return False, "", f"Execution timed out after {self.args.timeout:g} seconds."
        return outcome.ok, outcome.stdout, outcome.stderr.strip()

    def close(self) -> None:
        self.sandbox.close()


def _blocked(code: str) -> bool:
    names = any(f"import {name}" in code or f"from {name}" in code for name in BLOCKED_NAMES)
    return names or any(call in code for call in BLOCKED_CALLS)


TOOLS: dict[str, type[PythonCodeTool]] = {"python_code": PythonCodeTool}
"""``tool_id`` -> tool class (with its ``tool_args`` dataclass as ``config_cls``)."""
NOT_BUILT = {"search": "a search engine service", "mcp": "an MCP server"}
"""ROLL's other tools, which call services this project does not run."""


@dataclass(frozen=True)
class WrapperArgs:
    """``tool_wrapper.wrapper_args`` (GEM's ToolEnvWrapper)."""

    tool_reward: float = 0.0
    """Reward of a step whose response called a tool."""
    tool_success_reward: float = 0.0
    """Added when the call ran without error."""
    max_tool_uses: int | None = 10
    """Tool calls per episode at most (null: no limit); later responses go to the environment."""

    def __post_init__(self) -> None:
        if self.max_tool_uses is not None and self.max_tool_uses < 0:
            raise ValueError(f"max_tool_uses={self.max_tool_uses}: give a count >= 0 or null.")


@dataclass(frozen=True)
class ToolSpec:
    """One entry of ``tool_configs``."""

    tool_id: str
    args: Any


@dataclass(frozen=True)
class ToolWrapperConfig:
    """A tag's ``tool_wrapper``, checked."""

    wrapper: WrapperArgs = field(default_factory=WrapperArgs)
    tools: tuple[ToolSpec, ...] = ()


def parse_tool_wrapper(section: Any, where: str) -> ToolWrapperConfig:
    """``custom_envs.<tag>.tool_wrapper`` (``where``) as a :class:`ToolWrapperConfig`; errors
    (:class:`WorkerConfigError`) name the key."""
    section = checked_section(section, ("wrapper_args", "tool_configs"), where)
    wrapper = _build(WrapperArgs, section.get("wrapper_args"), f"{where}.wrapper_args")
    configs = section.get("tool_configs")
    if not isinstance(configs, list) or not configs:
        raise WorkerConfigError(f"{where}.tool_configs must list the tools ({{tool_id, tool_args}}), got {configs!r}.")
    tools = []
    for index, entry in enumerate(configs):
        at = f"{where}.tool_configs[{index}]"
        tool_id = checked_section(entry, ("tool_id", "tool_args"), at).get("tool_id")
        if tool_id in NOT_BUILT:
            raise WorkerConfigError(f"{at}.tool_id={tool_id!r}: ROLL's {tool_id} tool calls {NOT_BUILT[tool_id]}, "
                                    f"which is not built here; tools: {sorted(TOOLS)}.")  # fmt: skip
        if tool_id not in TOOLS:
            raise WorkerConfigError(f"{at}.tool_id={tool_id!r} is not a tool; tools: {sorted(TOOLS)}.")
        tools.append(ToolSpec(tool_id, _build(TOOLS[tool_id].config_cls, entry.get("tool_args"), f"{at}.tool_args")))
    return ToolWrapperConfig(wrapper, tuple(tools))


def _build(cls: type[Any], values: Any, prefix: str) -> Any:
    """``cls`` from ``values`` (types checked by rl-engines' dataclass builder); a bad value names ``prefix.key``."""
    try:
        return build_dataclass(cls, values, prefix)
    except ValueError as err:
        if isinstance(err, WorkerConfigError):
            raise
        raise WorkerConfigError(f"{prefix}.{err}") from None


def check_tool_machine(where: str) -> None:
    """Tools run programs in isolated processes: the machine must provide the isolation."""
    missing = missing_isolation()
    if missing:
        raise WorkerConfigError(f"{where}: the python_code tool runs programs only in isolated processes, and this "
                             f"machine lacks {' and '.join(missing)}; run tool environments on a machine that has "
                             "them.")  # fmt: skip


class ToolEnv:
    """``env`` with tools in front of it (see the module docstring); a :class:`TextEnv` itself."""

    def __init__(self, env: TextEnv, config: ToolWrapperConfig) -> None:
        self.env, self.config = env, config
        self.tools = [TOOLS[spec.tool_id](spec.args) for spec in config.tools]
        self.uses = self.successes = 0

    def reset(self, seed: int) -> str:
        self.uses = self.successes = 0
        observation = self.env.reset(seed)
        text = "\n".join(tool.instructions for tool in self.tools)
        return f"{observation}\n{'Available tools:' + chr(10) if len(self.tools) > 1 else ''}{text}"

    def step(self, action_text: str) -> StepResult:
        limit = self.config.wrapper.max_tool_uses
        call = ToolCall(parsed=False, error=True, observation="")
        name = None
        if limit is None or self.uses < limit:
            for tool in self.tools:  # GEM's order: the first tool whose call runs cleanly wins, else the last tried
                call, name = tool.call(action_text), tool.name
                if call.parsed and not call.error:
                    break
        if not call.parsed:
            result = self.env.step(action_text)
            return StepResult(result.observation, result.reward, result.terminated, result.truncated,
                              {**result.info, **self._counters()})  # fmt: skip
        self.uses += 1
        self.successes += int(not call.error)
        observation = call.observation + (MAX_USES_NOTE if self.uses == limit else "")
        reward = self.config.wrapper.tool_reward + (0.0 if call.error else self.config.wrapper.tool_success_reward)
        info = {"action_is_valid": True, "success": False, "action": name, **self._counters()}
        return StepResult(observation, reward, False, False, info)

    def _counters(self) -> dict[str, Any]:
        """GEM marks every step of a wrapped environment a tool step: the next observation is a ``tool`` message."""
        return {"use_tool": True, "tool_use_counter": self.uses, "tool_success_counter": self.successes}

    def render(self, mode: str = "text") -> Frame:
        return self.env.render(mode)

    @property
    def instructions(self) -> str:
        return self.env.instructions

    @property
    def suffix(self) -> str:
        return str(getattr(self.env, "suffix", ""))

    def close(self) -> None:
        for tool in self.tools:
            tool.close()
        self.env.close()

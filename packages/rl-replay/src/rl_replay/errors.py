"""Exceptions raised by rl_replay, with the messages of the ROLL rollout dump / mock guide.

The guide's error text is part of our contract: the missing-step message reproduces it line by
line (in Chinese, as in the guide) and follows it with the same content in English.
"""

from __future__ import annotations


class ReplayError(Exception):
    """Base class of every error rl_replay raises on purpose."""


class ConfigError(ReplayError, ValueError):
    """A `rollout_mock` config value is missing or invalid; the message names the key."""


class MockFileNotFoundError(ReplayError, FileNotFoundError):
    """Mock mode asked for a step that is not in the dump (the guide's "Mock文件不存在")."""


class SplitNotDumpedError(MockFileNotFoundError):
    """Mock mode replays a split (train / val) that the dump run never wrote."""


class StepsExceededError(MockFileNotFoundError):
    """Mock mode asks for more steps than the dump run wrote (mock max_steps > dump max_steps)."""


class DumpNotFoundError(MockFileNotFoundError):
    """Mock mode points at a directory that holds no rl_replay dump."""


class DumpExistsError(ReplayError, FileExistsError):
    """Dump mode would mix its steps with another run's steps in the same dump_dir."""


class ChecksumMismatchError(ReplayError, OSError):
    """A step file's size or checksum differs from the manifest: the file is corrupted or truncated."""


class DumpFormatError(ReplayError, ValueError):
    """A step file or manifest is not in the format rl_replay writes."""


class DumpPathError(DumpFormatError):
    """A manifest entry names a path outside the dump directory (absolute, with '..', or a symlink leading out)."""


class UnsupportedValueError(ReplayError, TypeError):
    """A batch holds a value rl_replay cannot store without pickle; the message names where."""


class MetricsError(ReplayError, ValueError):
    """A metrics log cannot be read or compared; the message names the file (and line)."""


def missing_step_message(path: str, dump_dir: str, split: str, step: int) -> str:
    """The guide's missing-step text (Chinese, verbatim) followed by the same in English."""
    return (
        f"[Rollout Mock] Mock文件不存在: {path}\n"
        "可能的原因:\n"
        f"1. 未在dump模式下运行过step {step}\n"
        f"2. dump_dir配置不正确: {dump_dir}\n"
        f"3. mode不匹配(当前: {split})\n"
        "请先以dump模式运行,确保生成了所有步骤的数据。\n"
        f"[Rollout Mock] Mock file not found: {path}\n"
        "Likely causes:\n"
        f"1. step {step} was never run in dump mode\n"
        f"2. dump_dir is not configured correctly: {dump_dir}\n"
        f"3. mode mismatch (current: {split})\n"
        "Run in dump mode first and make sure it produced the data of every step."
    )

"""The `rollout_mock` config section of the ROLL guide as a typed dataclass.

YAML shape (ROLL):

    rollout_mock:
      enable: true
      mode: dump          # dump | mock
      dump_dir: ./output/rollout_dumps/baseline_v1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from rl_replay.errors import ConfigError

MODES = ("dump", "mock")
SPLITS = ("train", "val")


@dataclass(frozen=True)
class RolloutMockConfig:
    """Validated `rollout_mock` section; build it with `RolloutMockConfig.from_dict`."""

    enable: bool = False
    """Turn the dump / mock mechanism on."""
    mode: str = "dump"
    """`dump`: save every step's rollout batch; `mock`: load it instead of generating."""
    dump_dir: str = "./output/rollout_dumps"
    """Directory holding `{train,val}/step_NNNNNN.safetensors`; identical in dump and mock mode."""
    overwrite: bool = False
    """(rl_replay extension) let dump mode replace another run's steps in `dump_dir`."""

    def __post_init__(self) -> None:
        _check_bool("enable", self.enable)
        _check_bool("overwrite", self.overwrite)
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ConfigError(
                f"rollout_mock.mode must be one of {list(MODES)} (dump: save data, mock: load data), got {self.mode!r}"
            )
        if not isinstance(self.dump_dir, str) or not self.dump_dir.strip():
            raise ConfigError(
                f"rollout_mock.dump_dir must be a non-empty path string (the same in dump and mock mode), "
                f"got {self.dump_dir!r}"
            )

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> RolloutMockConfig:
        """Build from the `rollout_mock` mapping of a parsed YAML config; unknown keys are rejected.

        `None` (section absent) gives a disabled config. `dump_dir` may be any path-like value.
        """
        if section is None:
            return cls()
        if not isinstance(section, Mapping):
            raise ConfigError(f"rollout_mock must be a mapping with keys enable, mode, dump_dir; got {section!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in section if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown key(s) in rollout_mock: {', '.join('rollout_mock.' + k for k in unknown)}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        values = dict(section)
        if "dump_dir" in values and hasattr(values["dump_dir"], "__fspath__"):
            values["dump_dir"] = str(values["dump_dir"])
        return cls(**values)


def _check_bool(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"rollout_mock.{key} must be true or false, got {value!r}")

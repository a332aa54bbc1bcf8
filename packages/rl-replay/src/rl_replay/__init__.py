"""rl_replay: dump and replay RL rollout batches exactly, without pickle.

Dump mode saves the rollout batch of every step; mock mode loads it instead of generating, so that
everything after it (advantages, losses, gradients) is deterministic. See `RolloutReplay`.
"""

from rl_replay.__about__ import __version__
from rl_replay.codec import GenericBatch, GenericTensorDict, batch_size_of
from rl_replay.config import RolloutMockConfig
from rl_replay.determinism import (
    DETERMINISTIC_ENV,
    apply_deterministic_mode,
    deterministic_settings,
    enable_deterministic,
)
from rl_replay.errors import (
    ChecksumMismatchError,
    ConfigError,
    DumpExistsError,
    DumpFormatError,
    DumpNotFoundError,
    DumpPathError,
    MetricsError,
    MockFileNotFoundError,
    ReplayError,
    SplitNotDumpedError,
    StepsExceededError,
    UnsupportedValueError,
)
from rl_replay.metrics import (
    DEFAULT_METRICS,
    MetricsComparison,
    append_metrics,
    compare_metrics,
    read_metrics,
)
from rl_replay.replay import RolloutReplay

__all__ = [
    "DEFAULT_METRICS",
    "DETERMINISTIC_ENV",
    "ChecksumMismatchError",
    "ConfigError",
    "DumpExistsError",
    "DumpFormatError",
    "DumpNotFoundError",
    "DumpPathError",
    "GenericBatch",
    "GenericTensorDict",
    "MetricsComparison",
    "MetricsError",
    "MockFileNotFoundError",
    "ReplayError",
    "RolloutMockConfig",
    "RolloutReplay",
    "SplitNotDumpedError",
    "StepsExceededError",
    "UnsupportedValueError",
    "__version__",
    "append_metrics",
    "apply_deterministic_mode",
    "batch_size_of",
    "compare_metrics",
    "deterministic_settings",
    "enable_deterministic",
    "read_metrics",
]

"""rl-engines: the execution layer (roles, placement, strategies, weight sync) for RL post-training.

Importing the package pulls no Ray, torch or engine: the exports here are the pure-Python config and placement
pieces. Import the rest from their modules: ``rl_engines.roles`` (Roles on Ray), ``rl_engines.strategies``
(fsdp2_train, hf_infer), ``rl_engines.objectives``, ``rl_engines.ray_cluster``, ``rl_engines.worker_group``.
"""

from rl_engines.__about__ import __version__
from rl_engines.config import WorkerConfig, WorkerConfigError
from rl_engines.device_mapping import DeviceMappingError, parse_device_mapping
from rl_engines.placement import (
    ClusterSpec,
    PartialOverlap,
    PlacementError,
    PlacementPlan,
    RolePlacement,
    RoleResources,
    WorkerPlacement,
    plan_placement,
)

__all__ = [
    "ClusterSpec",
    "DeviceMappingError",
    "PartialOverlap",
    "PlacementError",
    "PlacementPlan",
    "RolePlacement",
    "RoleResources",
    "WorkerConfig",
    "WorkerConfigError",
    "WorkerPlacement",
    "__version__",
    "parse_device_mapping",
    "plan_placement",
]

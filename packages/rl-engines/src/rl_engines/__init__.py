"""rl-engines: the execution layer (roles, placement, strategies) for RL post-training.

This first increment holds pure-Python resource planning only; importing it pulls no ray, torch or engine.
"""

from rl_engines.__about__ import __version__
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
    "WorkerPlacement",
    "__version__",
    "parse_device_mapping",
    "plan_placement",
]

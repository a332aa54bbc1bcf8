"""Checks of an agentic config that need the cluster: placement of the roles, the roles the algorithm needs, async
generation on devices of its own, and the batch arithmetic of the training roles (one sample per episode)."""

from __future__ import annotations

from apps.agentic.config import AgenticConfig
from apps.rlvr.preflight import (
    TRAIN_ROLES,
    PreflightError,
    PreflightReport,
    check_algorithm_roles,
    check_async,
    fill_model_paths,
    train_plan,
    worker_sections,
)
from rl_core.batch_size import lr_decay_steps
from rl_engines.placement import ClusterSpec
from rl_engines.roles import plan_roles


def agentic_preflight(config: AgenticConfig) -> PreflightReport:
    """Every check; raises PreflightError (or the placement / strategy / batch error, all ValueError) naming keys."""
    base = config.base
    fill_model_paths(base)
    check_algorithm_roles(base)
    sections = worker_sections(base)
    placement = plan_roles(ClusterSpec(base.num_nodes, base.num_gpus_per_node), sections)
    check_async(base, placement)
    generating = base.actor_infer.generating_args
    if generating.num_return_sequences != 1:
        raise PreflightError(
            f"actor_infer.generating_args.num_return_sequences is {generating.num_return_sequences}; an episode "
            "samples one response per turn: set it to 1 (group_size of train_env_manager sets the group)."
        )
    longest = max(config.env_spec(tag).max_tokens_per_step for tag in config.custom_envs)
    if base.sequence_length is not None and base.sequence_length <= longest:
        raise PreflightError(
            f"sequence_length ({base.sequence_length}) leaves no room for a prompt before a turn of "
            f"max_tokens_per_step={longest} tokens; raise sequence_length or lower max_tokens_per_step."
        )
    plans, decay = {}, {}
    for role in TRAIN_ROLES:
        if role in sections:
            plans[role] = train_plan(base, role, sections[role])
            decay[role] = lr_decay_steps(base.max_steps, plans[role], base.ppo_epochs)
    return PreflightReport(placement, plans, decay)

"""Checks of an agentic config that need the cluster: the shared ones of ``apps.common.preflight`` (placement of the
roles, the roles the algorithm needs, async generation on devices of its own, the batch arithmetic of the training
roles with one sample per episode, or per turn) and the agentic ones (one response per turn, room for a turn in
sequence_length)."""

from __future__ import annotations

from apps.agentic.config import AgenticConfig
from apps.agentic.env_sections import EnvManagerConfig
from apps.agentic.envs.tools import check_tool_machine
from apps.agentic.step_batch import adjusted_size, size_divisor
from apps.common.preflight import (
    PreflightError,
    PreflightReport,
    aggregation_notes,
    check_algorithm_roles,
    check_async,
    check_old_log_prob_switches,
    check_rollout_only,
    check_token_budgets,
    device_only_notes,
    dropped_key_notes,
    fill_model_paths,
    plan_training,
    role_sections,
)
from rl_engines.config import WorkerConfig
from rl_engines.placement import ClusterSpec
from rl_engines.roles import plan_roles


def agentic_preflight(config: AgenticConfig) -> PreflightReport:
    """Every check; raises PreflightError (or the placement / strategy / batch error, all ValueError) naming keys."""
    base = config.base
    fill_model_paths(base)
    check_algorithm_roles(base)
    sections = role_sections(base)
    placement = plan_roles(ClusterSpec(base.num_nodes, base.num_gpus_per_node), sections)
    check_async(base, placement)
    notes = episode_notes(config, sections, (config.train_env_manager, config.val_env_manager))
    notes += dropped_key_notes(config.base) + aggregation_notes(base, config.sequence_length)
    if config.reward_normalization.method == "asym_clip":
        notes.append("[preflight] reward_normalization.method: asym_clip normalises as mean_std, as ROLL does since "
                     "its agentic norm refactor (no clamp to [-1, 3]).")  # fmt: skip
    if base.adv_estimator == "gigpo":
        notes.append("[preflight] adv_estimator: gigpo groups a turn's step return with the turns of its own env group "
                     "that acted on the same state, as the GiGPO paper defines anchor-state groups; ROLL keys them by "
                     "the state alone, so there the same state seen by two env groups shares one group's statistics "
                     "(rl_core.step_rewards).")  # fmt: skip
    divisor = size_divisor(config, sections)
    # Whole episodes: rollout_batch_size resized by batch_adjust_mode, as ROLL resizes every batch. Step samples: as
    # many as the turns, resized likewise; plan the smallest such step (every episode one turn), each step's own
    # plan comes with its batch (apps.agentic.step_batch).
    if config.mode(config.train_env_manager) == "trajectory":
        samples = adjusted_size(base.rollout_batch_size, config.batch_adjust_mode, divisor)
    else:
        samples = -(-base.rollout_batch_size // divisor) * divisor
    report = plan_training(base, placement, sections, samples=samples)
    check_old_log_prob_switches(base, report)
    report.notes.extend(notes)
    return report


def rollout_preflight(config: AgenticConfig) -> PreflightReport:
    """The checks of the rollout pipeline (``apps.agentic.rollout_pipeline``): actor_infer alone is placed and
    started, episodes come from train_env_manager; the training roles and keys are not read (a note says so)."""
    base = config.base
    fill_model_paths(base)
    sections = {"actor_infer": base.actor_infer}
    check_rollout_only(base, sections)
    placement = plan_roles(ClusterSpec(base.num_nodes, base.num_gpus_per_node), sections)
    notes = episode_notes(config, sections, (config.train_env_manager,)) + list(base.sampling_notes)
    unread = "; val_env_manager does not run either" if config.val_env_manager is not None else ""
    notes.append("[preflight] rollout pipeline: only actor_infer starts and nothing trains, as ROLL's "
                 "AgenticRolloutPipeline: each step samples rollout_batch_size episodes of train_env_manager; the "
                 f"actor_train / reference / critic sections and the training keys are not read{unread}.")  # fmt: skip
    return PreflightReport(placement, {}, {}, notes)


def episode_notes(config: AgenticConfig, sections: dict[str, WorkerConfig],
                  managers: tuple[EnvManagerConfig | None, ...]) -> list[str]:  # fmt: skip
    """The checks of sampling episodes with actor_infer in ``managers`` (one response per turn, a machine for the
    tools, the token budgets of ``sections``); returns their notes."""
    generating = config.base.actor_infer.generating_args
    if generating.num_return_sequences != 1:
        raise PreflightError(
            f"actor_infer.generating_args.num_return_sequences is {generating.num_return_sequences}; an episode "
            "samples one response per turn: set it to 1 (group_size of train_env_manager sets the group)."
        )
    for manager in managers:
        for tag in manager.tags if manager is not None else ():
            if config.custom_envs[tag].tool_wrapper is not None:
                check_tool_machine(f"custom_envs.{tag}.tool_wrapper")
    notes = check_token_budgets(sections, config.sequence_length, "sequence_length") + device_only_notes(sections)
    return notes + length_key_notes(config) + turn_budget_notes(config) + manager_penalty_notes(config)


def manager_penalty_notes(config: AgenticConfig) -> list[str]:
    """``<manager>.format_penalty``: ROLL's config declares it and reads it nowhere."""
    notes = []
    for name in ("train_env_manager", "val_env_manager"):
        manager = getattr(config, name)
        if manager is None or manager.format_penalty is None:
            continue
        per_tag = ", ".join(f"{tag}: {config.custom_envs[tag].env_config.get('format_penalty', 'its default')}"
                            for tag in manager.tags)  # fmt: skip
        notes.append(f"[preflight] {name}.format_penalty ({manager.format_penalty}) changes nothing, as in ROLL, "
                     "which declares it and reads it nowhere: a malformed action is scored by its environment's "
                     f"env_config.format_penalty ({per_tag}).")  # fmt: skip
    return notes


def turn_budget_notes(config: AgenticConfig) -> list[str]:
    """A ``sequence_length`` no longer than some env's ``max_tokens_per_step``: no turn there gets its full budget
    (each generates at most what its context leaves, as ROLL's make_decision cuts it)."""
    longest = max(config.env_spec(tag).max_tokens_per_step for tag in config.custom_envs)
    if config.sequence_length > longest:
        return []
    given = f"{config.sequence_length}{'' if config.base.sequence_length else ' = prompt_length + response_length'}"
    return [f"[preflight] sequence_length ({given}) is at most max_tokens_per_step ({longest}): a turn generates at "
            "most the room its context leaves in sequence_length (as ROLL), so no turn gets its full budget; an "
            "episode whose first prompt fills sequence_length stops with an error naming its env."]  # fmt: skip


def length_key_notes(config: AgenticConfig) -> list[str]:
    """What ROLL's shared ``prompt_length`` / ``response_length`` do in this agentic run (they only derive a null
    ``sequence_length``)."""
    keys = [key for key in ("prompt_length", "response_length") if getattr(config, key) is not None]
    if not keys:
        return []
    derived = config.derived_sequence_length
    if derived is not None:
        prompt = derived - (config.response_length or 0)
        return [f"[preflight] sequence_length is null: prompt_length ({prompt}) + response_length "
                f"({config.response_length}) = {derived} tokens an episode may fill, as ROLL "
                "derives it; each turn still generates at most max_tokens_per_step tokens."]  # fmt: skip
    why = (f"sequence_length is {config.base.sequence_length}" if config.base.sequence_length is not None
           else f"response_length is null, so sequence_length is the default {config.sequence_length}")  # fmt: skip
    return [
        f"[preflight] {' / '.join(keys)}: ROLL reads them only to derive a null sequence_length and {why}, so "
        "they change nothing here (ROLL drops them too; its files set them to interpolate ${response_length})."
    ]

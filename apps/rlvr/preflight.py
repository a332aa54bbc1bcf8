"""Checks that need the whole config: run them before any worker starts (the ROLL FAQ's errors, as sentences).

``preflight(config)`` fills model paths from ``pretrain``, validates placement of every role on the cluster, the
roles the algorithm needs, and the batch arithmetic of each training and inference role. It returns what the
pipeline needs to start (the placement plan and each training role's batch plan).
"""

from __future__ import annotations

from dataclasses import dataclass

from apps.rlvr.config import ROLE_KEYS, RLVRConfig
from rl_core.batch import BatchSizeError
from rl_core.batch_size import ParallelLayout, TrainBatchPlan, lr_decay_steps, plan_train_batch
from rl_engines.config import WorkerConfig
from rl_engines.placement import ClusterSpec, PlacementPlan
from rl_engines.roles import plan_roles

TRAIN_ROLES = ("actor_train", "critic")


class PreflightError(ValueError):
    """The config cannot run; the message names the keys and the fix."""


@dataclass(frozen=True)
class PreflightReport:
    """What a valid config turns into."""

    placement: PlacementPlan
    """Where every role runs."""
    train_plans: dict[str, TrainBatchPlan]
    """Batch plan of each training role."""
    lr_decay_steps: dict[str, int]
    """Optimizer steps over the run, per training role (what a decaying schedule decays over)."""


def worker_sections(config: RLVRConfig) -> dict[str, WorkerConfig]:
    """Configured roles (and reward workers that hold devices), by placement name."""
    sections = {role: getattr(config, role) for role in ROLE_KEYS if getattr(config, role) is not None}
    for name, reward in config.rewards.items():
        if reward.worker.device_mapping:
            sections[f"rewards.{name}"] = reward.worker
    return sections


def fill_model_paths(config: RLVRConfig) -> None:
    """ROLL's convention: policy roles without model_name_or_path load ``pretrain``."""
    for role in ROLE_KEYS:
        section = getattr(config, role)
        if section is not None and not section.model_args.model_name_or_path and config.pretrain:
            section.model_args.model_name_or_path = config.pretrain


def preflight(config: RLVRConfig) -> PreflightReport:
    """Every check; raises PreflightError (or the placement / strategy error, all ValueError) naming the keys."""
    fill_model_paths(config)
    check_algorithm_roles(config)
    if not config.rewards:
        raise PreflightError("no `rewards` section: RLVR needs at least one reward (e.g. rewards.math_rule).")
    sections = worker_sections(config)
    placement = plan_roles(ClusterSpec(config.num_nodes, config.num_gpus_per_node), sections)
    check_async(config, placement)
    _check_generation(config, placement)
    plans, decay = {}, {}
    for role in TRAIN_ROLES:
        if role in sections:
            plans[role] = train_plan(config, role, sections[role])
            decay[role] = lr_decay_steps(config.max_steps, plans[role], config.ppo_epochs)
    return PreflightReport(placement, plans, decay)


def check_algorithm_roles(config: RLVRConfig) -> None:
    """The roles the algorithm keys need: a critic for gae, a reference for any KL to it."""
    if config.adv_estimator == "gae" and config.critic is None:
        raise PreflightError("adv_estimator: gae needs a value model; add a `critic` section or use grpo / reinforce.")
    needs_reference = config.use_kl_loss or config.add_token_level_kl
    if needs_reference and config.reference is None:
        keys = [k for k in ("use_kl_loss", "add_token_level_kl") if getattr(config, k)]
        raise PreflightError(f"{' and '.join(keys)} need a `reference` section (the frozen policy the KL is to).")


def check_async(config: RLVRConfig, placement: PlacementPlan) -> None:
    """Generation ahead of training needs actor_infer on devices of its own."""
    if config.async_generation_ratio > 0 and placement.is_colocated("actor_train", "actor_infer"):
        raise PreflightError(
            f"async_generation_ratio={config.async_generation_ratio:g} needs actor_infer on devices of its own, but "
            "actor_train.device_mapping and actor_infer.device_mapping overlap; separate them (e.g. train on "
            "0-3, infer on 4-7) or set async_generation_ratio: 0."
        )


def _check_generation(config: RLVRConfig, placement: PlacementPlan) -> None:
    generating = config.actor_infer.generating_args
    if generating.max_new_tokens > config.response_length:
        raise PreflightError(
            f"actor_infer.generating_args.max_new_tokens ({generating.max_new_tokens}) exceeds response_length "
            f"({config.response_length}); use max_new_tokens: ${{response_length}}."
        )
    # With is_num_return_sequences_expand the pipeline repeats each prompt and samples once per copy (as ROLL does),
    # so the engine's num_return_sequences is not used; otherwise it is the group size and must match.
    expected = config.num_return_sequences_in_group
    if not config.is_num_return_sequences_expand and generating.num_return_sequences != expected:
        raise PreflightError(
            f"actor_infer.generating_args.num_return_sequences is {generating.num_return_sequences} but "
            f"num_return_sequences_in_group is {expected}; use num_return_sequences: "
            "${num_return_sequences_in_group} (or is_num_return_sequences_expand: true)."
        )
    # Prompts need not divide over actor_infer's workers: generation is scheduled per request (ROLL runs 64 prompts
    # on 12 inference workers). Log-probs are computed in equal chunks, so the reference role must divide them.
    samples = config.rollout_batch_size * config.num_return_sequences_in_group
    if "reference" in placement.roles and samples % placement.roles["reference"].world_size:
        raise BatchSizeError(
            f"reference: rollout_batch_size x num_return_sequences_in_group = {samples} samples must split evenly "
            f"over its {placement.roles['reference'].world_size} workers; change reference.device_mapping."
        )


def train_plan(config: RLVRConfig, role: str, section: WorkerConfig) -> TrainBatchPlan:
    """The batch plan of a training role (raises the FAQ's batch-size errors naming the keys)."""
    strategy_config = section.strategy_args.strategy_config
    layout = ParallelLayout(
        world_size=len(section.device_mapping),
        tensor_model_parallel_size=int(strategy_config.get("tensor_model_parallel_size", 1)),
        pipeline_model_parallel_size=int(strategy_config.get("pipeline_model_parallel_size", 1)),
        context_parallel_size=int(strategy_config.get("context_parallel_size", 1)),
    )
    args = section.training_args
    return plan_train_batch(
        role,
        rollout_batch_size=config.rollout_batch_size,
        num_return_sequences_in_group=config.num_return_sequences_in_group,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        layout=layout,
    )

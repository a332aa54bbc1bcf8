"""Single-key checks of the shared top-level keys (``apps.common.config.SharedConfig``): value ranges, and choices
looked up in the registry that implements them. ``apps.rlvr.config_checks`` adds the RLVR-only keys' checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from apps.common.model_hub import check_source
from apps.common.policy_args import policy_loss_name
from apps.common.trackers import ROLL_TRACKERS, TRACKERS
from rl_core.advantages import ADV_ESTIMATORS
from rl_core.kl import KL_ESTIMATORS
from rl_core.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from rl_core.rewards import REWARD_NORMS
from rl_core.rollout_is import IS_LEVELS, IS_MODES
from rl_core.step_rewards import STEP_ESTIMATORS
from rl_engines.config import WorkerConfigError

NORM_TYPES = (None, "batch", "group")

# key -> smallest allowed value
MINIMUM = {
    "rollout_batch_size": 1, "ppo_epochs": 1, "max_steps": 1, "logging_steps": 1, "save_steps": 1, "eval_steps": 0,
    "num_nodes": 1, "num_gpus_per_node": 1, "rpc_timeout": 1e-9, "async_generation_ratio": 0.0, "critic_warmup": 0,
    "kl_horizon": 1, "max_ckpt_to_keep": 0,
}  # fmt: skip
UNIT_INTERVAL = ("gamma", "lambd", "difficulty_low_threshold", "difficulty_high_threshold")


def fail(message: str) -> NoReturn:
    """Raise the config error ``message`` (which names the key)."""
    raise WorkerConfigError(message)


def check_minimum(config: Any, minimum: Mapping[str, float]) -> None:
    """Every ``key`` of ``minimum`` is at least its value, with the key and the bound in the message."""
    for key, low in minimum.items():
        if getattr(config, key) < low:
            fail(f"{key} must be >= {low}, got {getattr(config, key)}.")


def check_ranges(config: Any) -> None:
    """Numeric bounds, with the key and the allowed range in the message."""
    check_minimum(config, MINIMUM)
    for key in UNIT_INTERVAL:
        if not 0.0 <= getattr(config, key) <= 1.0:
            fail(f"{key} must be in [0, 1], got {getattr(config, key)}.")
    if config.difficulty_low_threshold > config.difficulty_high_threshold:
        fail(
            f"difficulty_low_threshold ({config.difficulty_low_threshold}) must be <= difficulty_high_threshold "
            f"({config.difficulty_high_threshold})."
        )
    if config.entropy_loss_coef < 0:
        fail(f"entropy_loss_coef={config.entropy_loss_coef}: ROLL adds the entropy term only when the coefficient is "
             "> 0, so a negative one changes nothing there; set 0, or a positive bonus.")  # fmt: skip
    for key in ("val_batch_size", "model_update_buffer_size_mb"):
        if getattr(config, key) is not None and getattr(config, key) < 1:
            fail(f"{key} must be >= 1 or null, got {getattr(config, key)}.")
    if float(config.async_generation_ratio) != int(config.async_generation_ratio):
        fail(
            f"async_generation_ratio must be a whole number of batches to generate ahead (0 = synchronous, 1, 2, "
            f"...), got {config.async_generation_ratio}."
        )
    for name, value in config.system_envs.items():
        if not isinstance(value, str):
            fail(f"system_envs.{name} must be a string, got {value!r}; quote it in the YAML (e.g. '1').")


def _check_registry(registry: Any, key: str, value: str | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in registry:
        fail(
            f"{key}={value!r} is not supported; valid values: {registry.names()}" + (" or null." if allow_none else ".")
        )


def check_train_infer_correction(config: Any) -> None:
    """ROLL's ``train_infer_correction`` weights / filters the same gap (training vs inference log-probs) as verl's
    rollout correction: one of them at a time."""
    if config.train_infer_correction is None:
        return
    # rollout_is_threshold alone reports metrics; with rollout_is: true it weights and masks
    given = {
        "rollout_correction": config.rollout_correction is not None,
        "rollout_is_threshold with rollout_is: true": config.rollout_is_threshold is not None and config.rollout_is,
    }
    other = [key for key, value in given.items() if value]
    if other:
        fail(
            f"train_infer_correction and {other[0]} are both set: both correct the gap between the training and "
            "inference engines' log-probs (ROLL's and verl's keys), and applied together they would weight and filter "
            "it twice; keep one."
        )


def check_rollout_correction(config: Any) -> None:
    """``rollout_correction`` (verl 0.9.1's keys) is valid, not combined with the older rollout_is_* keys, and in
    bypass mode not combined with another policy loss (verl's bypass mode replaces the loss), nor its batch
    normalisation (a collective inside the loss) where actor_train's ranks compute the loss unequally often."""
    correction = config.rollout_correction
    if correction is None:
        return
    try:
        correction.validate("rollout_correction")
    except (TypeError, ValueError) as err:
        fail(str(err))
    if config.rollout_is_threshold is not None:
        fail(
            f"rollout_correction and rollout_is_threshold={config.rollout_is_threshold} are both set: they are two "
            "versions of verl's rollout correction (0.9.1's and the older rollout_is_* keys); keep one."
        )
    if correction.bypass_mode and policy_loss_name(config) not in ("vanilla", "ppo"):
        fail(
            f"rollout_correction.bypass_mode: true trains with verl's bypass-mode loss (loss_type "
            f"{correction.loss_type!r}), but the configured policy loss is {policy_loss_name(config)!r}; use the "
            "default pg_variant (ppo) with bypass mode, or bypass_mode: false."
        )
    if correction.bypass_mode and correction.rollout_is_batch_normalize and correction.rollout_is is not None:
        _check_bypass_batch_mean(config.actor_train)


def _check_bypass_batch_mean(section: Any) -> None:
    """Bypass mode's batch mean is a collective inside the loss: every rank of actor_train must compute the loss
    equally often. Megatron's pipeline stages do not (only the last computes it), nor do its data-parallel replicas
    when they plan their own micro-batch counts (dynamic batching, load-balanced packing)."""
    if section.strategy_args.strategy_name != "megatron_train":
        return  # fsdp2 / DeepSpeed ranks agree on their pass count (they gather parameters inside each pass)
    stages = int(section.strategy_args.strategy_config.get("pipeline_model_parallel_size", 1))
    own_counts = "its data-parallel replicas plan their own number of passes"
    why = ""
    if stages > 1:
        key = "actor_train.strategy_args.strategy_config.pipeline_model_parallel_size"
        why = f"only the last of its {key}={stages} stages computes it"
    elif section.use_dynamic_batching_in_train:
        why = f"{own_counts} (actor_train.use_dynamic_batching_in_train)"
    elif section.use_sequence_packing and section.sequence_packing_args.algorithm == "load_balance":
        why = f"{own_counts} (actor_train.use_sequence_packing, load_balance)"
    if why:
        fail(
            "rollout_correction.bypass_mode with rollout_correction.rollout_is_batch_normalize: true takes the batch "
            f"mean over every rank of actor_train (megatron_train) inside the loss, but {why}; set "
            "rollout_is_batch_normalize: false, or bypass_mode: false (the driver then normalises over the whole "
            "batch)."
        )


def check_choices(config: Any) -> None:
    """Every named choice exists in its rl-core registry (so a typo fails here, not mid-run)."""
    if config.adv_estimator not in ADV_ESTIMATORS and config.adv_estimator not in STEP_ESTIMATORS:
        fail(
            f"adv_estimator={config.adv_estimator!r} is not supported; valid values: {ADV_ESTIMATORS.names()} or, "
            f"with the agentic pipeline's step samples, {STEP_ESTIMATORS.names()}."
        )
    _check_registry(POLICY_LOSSES, "pg_variant", config.pg_variant)
    try:
        policy_loss_name(config)  # actor_train's worker_cls / pg_variant and importance_sampling agree with it
    except ValueError as err:
        fail(str(err))
    _check_registry(LOSS_AGGREGATIONS, "loss_agg_mode", config.loss_agg_mode)
    _check_registry(KL_ESTIMATORS, "kl_penalty", config.kl_penalty)
    _check_registry(KL_ESTIMATORS, "kl_loss_type", config.kl_loss_type)
    _check_registry(REWARD_NORMS, "reward_norm", config.reward_norm, allow_none=True)
    _check_registry(IS_LEVELS, "rollout_is_level", config.rollout_is_level)
    _check_registry(IS_MODES, "rollout_is_mode", config.rollout_is_mode)
    check_rollout_correction(config)
    check_train_infer_correction(config)
    if config.track_with not in TRACKERS:
        known = "a ROLL tracker not built here" if config.track_with in ROLL_TRACKERS else (
            f"not a tracker ROLL registers either ({', '.join(ROLL_TRACKERS)})")  # fmt: skip
        fail(f"track_with={config.track_with!r} is {known}; valid values: {TRACKERS.names()}.")
    try:
        check_source(config.model_download_type)
    except ValueError as err:
        fail(str(err))
    if config.profiler_timeline and config.profiler_memory:
        fail("profiler_timeline and profiler_memory are both true; profile one at a time (as ROLL asserts).")
    for key in ("norm_mean_type", "norm_std_type"):
        if getattr(config, key) not in NORM_TYPES:
            fail(f"{key}={getattr(config, key)!r}: use batch, group or null.")
    if config.sft_loss_coef:
        fail("sft_loss_coef needs SFT data, which the RLVR pipeline does not load; set sft_loss_coef: 0.")

"""Checks of an RLVR config that need the whole config: run them before any worker starts (the ROLL FAQ's errors, as
sentences).

``preflight(config)`` runs the shared checks of ``apps.common.preflight`` (model paths from ``pretrain``, the roles
the algorithm needs, async generation, the batch arithmetic of each training role) and RLVR's own: reward sections
that resolve to registered reward functions (and pass their own checks), placement of every role and reward worker
on the cluster, generation lengths and group size, and the reference role's share of the samples. It returns what
the pipeline needs to start (the placement plan and each training role's batch plan).
"""

from __future__ import annotations

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
from apps.rlvr.config import RLVRConfig
from apps.rlvr.data_args import check_data_args, check_video_model
from apps.rlvr.domains import domain_probs
from apps.rlvr.rewards import check_reward_sections
from apps.rlvr.vl_data import model_type
from rl_core.batch import BatchSizeError
from rl_engines.config import WorkerConfig
from rl_engines.placement import ClusterSpec, PlacementPlan
from rl_engines.roles import plan_roles
from rl_engines.vision import is_vl_model


def worker_sections(config: RLVRConfig) -> dict[str, WorkerConfig]:
    """Configured roles (and reward workers that hold devices), by placement name."""
    sections = role_sections(config)
    for name, reward in config.rewards.items():
        if reward.worker.device_mapping:
            sections[f"rewards.{name}"] = reward.worker
    return sections


def preflight(config: RLVRConfig) -> PreflightReport:
    """Every check; raises PreflightError (or the placement / strategy error, all ValueError) naming the keys."""
    fill_model_paths(config)
    check_algorithm_roles(config)
    if not config.rewards:
        raise PreflightError("no `rewards` section: RLVR needs at least one reward (e.g. rewards.math_rule).")
    check_reward_sections(config.rewards)
    domain_probs(config)
    sections = worker_sections(config)
    placement = plan_roles(ClusterSpec(config.num_nodes, config.num_gpus_per_node), sections)
    check_async(config, placement)
    _check_generation(config, placement)
    longest = config.prompt_length + config.response_length
    notes = check_token_budgets(sections, longest, "prompt_length + response_length") + device_only_notes(sections)
    notes += dropped_key_notes(config) + reward_norm_notes(config) + list(config.length_notes)
    notes += aggregation_notes(config, longest)
    report = plan_training(config, placement, sections, config.num_return_sequences_in_group)
    check_old_log_prob_switches(config, report)
    report.notes.extend(notes)
    report.notes.extend(check_data_args(config.actor_train.data_args, "actor_train"))
    check_video_model(config.actor_train.data_args, "actor_train", model_type(config))
    if config.validation is not None:
        report.notes.extend(check_data_args(config.validation.data_args, "validation"))
        report.notes.extend(validation_encoding_notes(config))
        check_video_model(config.validation.data_args, "validation", model_type(config))
    return report


def validation_encoding_notes(config: RLVRConfig) -> list[str]:
    """The ``validation.data_args`` template and columns a text model's validation does not read, where they differ
    from training's: ROLL's RLVR pipeline encodes the validation prompts with the training encode_function."""
    if config.validation is None or is_vl_model(str(config.actor_train.model_args.model_name_or_path)):
        return []  # ROLL's VLM pipeline reads validation's own
    own, train = config.validation.data_args, config.actor_train.data_args
    applied = {"template": config.global_template or train.get("template", "native"),
               "prompt": train.get("prompt"), "messages": train.get("messages")}  # fmt: skip
    where = {"template": "global_template" if config.global_template else "actor_train.data_args.template",
             "prompt": "actor_train.data_args.prompt", "messages": "actor_train.data_args.messages"}  # fmt: skip
    return [f"[preflight] validation.data_args.{key}={own[key]!r} is not read (a text model): as ROLL's RLVR "
            f"pipeline, validation prompts are encoded as training's, with {where[key]} ({applied[key]!r}); set it "
            "there to change both." for key in applied if key in own and own[key] != applied[key]]  # fmt: skip


def rollout_preflight(config: RLVRConfig) -> PreflightReport:
    """The checks of the rollout pipeline (``apps.rlvr.rollout_pipeline``, ROLL's RLVRRolloutPipeline): the
    validation set, its rewards, and actor_infer with the reward roles placed; the training roles and keys are not
    read (a note says so)."""
    if config.validation is None or not config.validation.data_args.get("file_name"):
        raise PreflightError(
            "the rollout pipeline generates for and scores the validation set, as ROLL's RLVRRolloutPipeline: give "
            "validation.data_args.file_name (and validation.generating_args for its sampling)."
        )
    fill_model_paths(config)
    if not config.rewards:
        raise PreflightError("no `rewards` section: the rollout pipeline scores with them (e.g. rewards.math_rule).")
    check_reward_sections(config.rewards)
    sections = {name: section for name, section in worker_sections(config).items()
                if name == "actor_infer" or name.startswith("rewards.")}  # fmt: skip
    placement = plan_roles(ClusterSpec(config.num_nodes, config.num_gpus_per_node), sections)
    check_rollout_only(config, sections)
    notes = device_only_notes(sections) + check_data_args(config.validation.data_args, "validation")
    notes += validation_encoding_notes(config)
    notes += [note for note in config.sampling_notes if note.startswith("[preflight] validation.")]
    check_video_model(config.validation.data_args, "validation", model_type(config))
    notes.append("[preflight] rollout pipeline: one pass over the validation set with actor_infer (validation."
                 "generating_args) and the rewards, as ROLL's RLVRRolloutPipeline; nothing trains, max_steps and "
                 "the actor_train / reference / critic sections are not read, except actor_train.data_args' "
                 "template and columns, which encode the validation prompts as in training.")  # fmt: skip
    return PreflightReport(placement, {}, {}, notes)


def _check_generation(config: RLVRConfig, placement: PlacementPlan) -> None:
    generating = config.actor_infer.generating_args  # max_new_tokens: response_length (RLVRConfig.roll_lengths)
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


def reward_norm_notes(config: RLVRConfig) -> list[str]:
    """The pre-flight line when ``norm_mean_type`` / ``norm_std_type`` are set with grpo, which overrides them."""
    pair = (config.norm_mean_type, config.norm_std_type)
    if config.adv_estimator != "grpo" or pair in ((None, None), ("group", "group")):
        return []
    return [
        f"[preflight] norm_mean_type={pair[0]!r} / norm_std_type={pair[1]!r}: adv_estimator grpo normalises each "
        "prompt group's rewards by the group's mean and std, as ROLL forces both keys to group for it; the values "
        "given change nothing (use adv_estimator: reinforce to normalise by them)."
    ]

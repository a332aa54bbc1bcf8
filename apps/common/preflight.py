"""The pre-flight checks both pipelines run before any worker starts (the ROLL FAQ's errors, as sentences).

``apps.rlvr.preflight.preflight`` and ``apps.agentic.preflight.agentic_preflight`` compose these with their own
checks: model paths filled from ``pretrain``, the roles the algorithm needs, async generation on devices of its own,
and the batch arithmetic of each training role (``plan_training``, which returns the report the pipeline starts
from: the placement plan and each training role's batch plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.common.algorithm import roll_aggregation
from apps.common.config import ROLE_KEYS, SharedConfig, critic_enabled, reference_enabled, reference_from_actor
from rl_core.batch_size import ParallelLayout, TrainBatchPlan, lr_decay_steps, plan_train_batch
from rl_engines.config import WorkerConfig
from rl_engines.placement import PlacementPlan
from rl_engines.roles import check_lora_pair, syncs_adapters
from rl_engines.strategies.train_utils import DECAYING_SCHEDULES
from rl_replay.config import RolloutMockConfig

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
    notes: list[str] = field(default_factory=list)
    """What the run does differently from what the config may suggest (the pipeline logs each line)."""


def role_sections(config: SharedConfig) -> dict[str, WorkerConfig]:
    """The roles that run (actor_train, actor_infer, reference, critic), by placement name: the configured ones,
    less a reference that ROLL's ``enable_reference`` leaves off (or a LoRA actor stands in for) and a critic that
    an estimator other than gae leaves off."""
    sections = {role: getattr(config, role) for role in ROLE_KEYS if getattr(config, role) is not None}
    if not reference_enabled(config) or reference_from_actor(config):
        sections.pop("reference", None)
    if not critic_enabled(config):
        sections.pop("critic", None)
    return sections


def replays_rollouts(config: SharedConfig) -> bool:
    """rollout_mock in mock mode: every rollout, validation's too, comes from the dump already scored, so nothing
    generates, grades or needs the trained weights on an inference engine."""
    mock = RolloutMockConfig.from_dict(config.rollout_mock)
    return mock.enable and mock.mode == "mock"


def started_sections(config: SharedConfig) -> dict[str, WorkerConfig]:
    """The roles a run starts: :func:`role_sections`, less actor_infer when :func:`replays_rollouts`."""
    sections = role_sections(config)
    if replays_rollouts(config):
        sections.pop("actor_infer", None)
    return sections


def replay_notes(config: SharedConfig) -> list[str]:
    """The log line of an inference role that a replay leaves off."""
    if not replays_rollouts(config):
        return []
    dump_dir = RolloutMockConfig.from_dict(config.rollout_mock).dump_dir
    return [
        "[preflight] actor_infer: not started (rollout_mock.mode mock replays every rollout, validation's too, "
        f"scored, from {dump_dir}: nothing generates or grades, so no weights are synced); set rollout_mock.mode: "
        "dump or enable: false to generate."
    ]


def reference_notes(config: SharedConfig) -> list[str]:
    """The log line of a configured reference that does not run (or that a LoRA actor stands in for)."""
    train, reference = config.actor_train, config.reference
    if reference_from_actor(config) and train is not None and reference is not None:
        base = train.model_args.model_name_or_path or config.pretrain
        named = reference.model_args.model_name_or_path or config.pretrain
        other = "" if named == base else (
            f" reference.model_args.model_name_or_path={named!r} is not loaded: ROLL builds no reference model when "
            f"actor_train trains LoRA adapters, so the KL is to actor_train's base model {base!r}."
        )  # fmt: skip
        return [
            "[preflight] reference: the actor's base model with its LoRA adapters disabled (actor_train computes "
            f"ref_log_probs, as ROLL does with LoRA); no separate reference copy is loaded.{other}",
        ]
    if config.reference is None or reference_enabled(config):
        return []
    return [
        "[preflight] reference: not started (enable_reference false, use_kl_loss and add_token_level_kl false, "
        "init_kl_coef 0: nothing needs it); ref_log_probs are the old_log_probs, as in ROLL. Set "
        "enable_reference: true to run it.",
    ]


def critic_notes(config: SharedConfig) -> list[str]:
    """The log line of a configured critic that an estimator other than gae leaves off."""
    if config.critic is None or critic_enabled(config):
        return []
    return [
        f"[preflight] critic: not started (adv_estimator {config.adv_estimator} reads no values; ROLL builds, scores "
        "and trains the critic only for gae). Remove the section, or set adv_estimator: gae to train it."
    ]


def lora_notes(config: SharedConfig) -> list[str]:
    """The log line of a LoRA actor: what trains and what the inference role receives."""
    train, infer = config.actor_train, config.actor_infer
    if train is None or not train.model_args.lora:
        return []
    args = train.model_args
    receives = ""
    if infer is not None and syncs_adapters(infer):
        receives = (f"; actor_infer ({infer.strategy_args.strategy_name}) serves them: each sync sends the adapters "
                    "alone")  # fmt: skip
    elif infer is not None:
        receives = (f"; actor_infer ({infer.strategy_args.strategy_name}) receives the weights with the adapters "
                    "merged in at every sync")  # fmt: skip
    return [
        f"[preflight] actor_train: LoRA adapters on {args.lora_target} (rank {args.lora_rank}, alpha "
        f"{args.alpha}) train; the base model stays frozen in {args.dtype}{receives}."
    ]


def fill_model_paths(config: SharedConfig) -> None:
    """ROLL's convention: policy roles without model_name_or_path load ``pretrain``."""
    for role in ROLE_KEYS:
        section = getattr(config, role)
        if section is not None and not section.model_args.model_name_or_path and config.pretrain:
            section.model_args.model_name_or_path = config.pretrain


def check_rollout_only(config: SharedConfig, sections: dict[str, WorkerConfig]) -> None:
    """What a rollout pipeline (nothing trains, ROLL's *RolloutPipeline) cannot run: a resume (there is nothing to
    resume) and an inference engine started with dummy weights (only a training run's weight sync fills them)."""
    if config.resume_from_checkpoint is not False:
        raise PreflightError(
            f"resume_from_checkpoint={config.resume_from_checkpoint!r}: the rollout pipeline trains nothing, so it "
            "has nothing to resume; to sample with a checkpoint's policy set pretrain (or actor_infer.model_args."
            "model_name_or_path) to its HuggingFace folder (<checkpoint>/actor_hf), and remove resume_from_checkpoint."
        )
    for role, section in sections.items():
        if section.strategy_args.strategy_config.get("load_format") == "dummy":
            raise PreflightError(
                f"{role}.strategy_args.strategy_config.load_format: dummy starts the engine with random weights, "
                "which only a training run's weight sync replaces; the rollout pipeline syncs none: set it to auto "
                "(as ROLL's rollout pipelines require)."
            )


def check_algorithm_roles(config: SharedConfig) -> None:
    """The roles the algorithm keys need: a critic for gae, a reference for any KL to it."""
    if config.adv_estimator == "gae" and config.critic is None:
        raise PreflightError("adv_estimator: gae needs a value model; add a `critic` section or use grpo / reinforce.")
    keys = [k for k in ("use_kl_loss", "add_token_level_kl", "enable_reference") if getattr(config, k)]
    if keys and config.reference is None:
        raise PreflightError(f"{' and '.join(keys)} need a `reference` section (the frozen policy the KL is to).")
    check_lora_roles(config)


def check_lora_roles(config: SharedConfig) -> None:
    """actor_infer's ``lora_*`` keys describe the adapters actor_train trains: they need a LoRA actor_train."""
    infer, train = config.actor_infer, config.actor_train
    if infer is None or not infer.model_args.lora:
        return
    if train is None or not train.model_args.lora:
        raise PreflightError(
            "actor_infer.model_args.lora_target is set, but actor_train trains full weights (its lora_target is "
            "null); set actor_train.model_args.lora_target (and lora_rank / lora_alpha) to train adapters, or remove "
            "actor_infer's lora_* keys."
        )
    try:
        check_lora_pair(train, infer)
    except ValueError as err:
        raise PreflightError(str(err)) from None


def check_async(config: SharedConfig, placement: PlacementPlan) -> None:
    """Generation ahead of training needs actor_infer on devices of its own."""
    if config.async_generation_ratio > 0 and placement.is_colocated("actor_train", "actor_infer"):
        raise PreflightError(
            f"async_generation_ratio={config.async_generation_ratio:g} needs actor_infer on devices of its own, but "
            "actor_train.device_mapping and actor_infer.device_mapping overlap; separate them (e.g. train on "
            "0-3, infer on 4-7) or set async_generation_ratio: 0."
        )


def parallel_layout(section: WorkerConfig) -> ParallelLayout:
    """A role's ranks split into tensor / pipeline / context (Ulysses) parallel groups and data-parallel ranks."""
    strategy_config = section.strategy_args.strategy_config
    return ParallelLayout(
        world_size=len(section.device_mapping),
        tensor_model_parallel_size=int(strategy_config.get("tensor_model_parallel_size", 1)),
        pipeline_model_parallel_size=int(strategy_config.get("pipeline_model_parallel_size", 1)),
        # Ulysses (fsdp2) splits sequences like Megatron's context parallelism: ranks / ulysses_size hold the data
        context_parallel_size=int(strategy_config.get("context_parallel_size", 1)) * section.model_args.ulysses_size,
    )


def train_plan(
    config: SharedConfig, role: str, section: WorkerConfig, num_return_sequences_in_group: int = 1,
    samples: int | None = None,
) -> TrainBatchPlan:  # fmt: skip
    """The batch plan of a training role (raises the FAQ's batch-size errors naming the keys).

    A step trains ``rollout_batch_size x num_return_sequences_in_group`` samples (agentic: one per episode), or
    ``samples`` when given (agentic step samples: as many as the step's turns, adjusted).
    """
    layout = parallel_layout(section)
    args = section.training_args
    return plan_train_batch(
        role,
        rollout_batch_size=config.rollout_batch_size if samples is None else samples,
        num_return_sequences_in_group=num_return_sequences_in_group,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        layout=layout,
    )


def device_only_notes(sections: dict[str, WorkerConfig]) -> list[str]:
    """The pre-flight line of each accepted option that acts only on GPU hardware (what it does there, and here)."""
    return [
        f"[preflight] {role}.offload_nccl: true frees NCCL communicator buffers while the role is offloaded (on "
        "GPUs; ROLL's current release forces it off); the gloo groups here hold no device buffers, so it changes "
        "nothing."
        for role, section in sections.items()
        if section.offload_nccl
    ]


def dropped_key_notes(config: SharedConfig) -> list[str]:
    """A pre-flight line for each top-level key ROLL's own parser drops (accepted, changing nothing)."""
    notes = []
    if config.offload_nccl is not None:
        notes.append("[preflight] offload_nccl (top level): ROLL's files interpolate it into each role's offload_nccl, "
                     "which is what is read; ROLL's config has no top-level field of that name and drops it, so it "
                     "changes nothing by itself.")  # fmt: skip
    if config.reward_system_config is not None:
        notes.append("[preflight] reward_system_config: not a field of ROLL's pipeline configs (its parser drops it; "
                     "only its remote reward-system worker reads one, from batch metadata its pipelines never set), so "
                     "it changes nothing here either.")  # fmt: skip
    notes += _old_log_prob_notes(config)
    return notes + list(config.sampling_notes)


def _old_log_prob_notes(config: SharedConfig) -> list[str]:
    """ROLL's switches of the old-log-prob pass, where given: it always runs here."""
    enable, force_off = config.enable_old_logprobs_recompute, config.force_disable_old_logprobs_recompute
    if force_off:
        return [_skipped_pass_note("force_disable_old_logprobs_recompute=true")]
    if enable is False:
        return [_skipped_pass_note("enable_old_logprobs_recompute=false")]
    given = [f"{key}={str(value).lower()}" for key, value in (("enable_old_logprobs_recompute", enable),
             ("force_disable_old_logprobs_recompute", force_off)) if value is not None]  # fmt: skip
    if not given:
        return []
    return [f"[preflight] {' and '.join(given)}: the old log-probs come from a pass of actor_train before training "
            "(train_infer_correction follows it), as they always do here."]  # fmt: skip


def _skipped_pass_note(setting: str) -> str:
    return (
        f"[preflight] {setting}: ROLL then skips the old-log-prob pass where a train step makes one optimizer "
        "step per rank (it keeps the first epoch's log-probs for later ppo_epochs) and uses that step's own "
        "log-probs of the same weights (the same values; train_infer_correction is then computed in the step). "
        "Here the pass always runs and the correction follows it: ROLL's results, one forward pass more."
    )


def check_old_log_prob_switches(config: SharedConfig, report: PreflightReport) -> None:
    """``force_disable_old_logprobs_recompute: true`` makes ROLL take each optimizer step's old log-probs from its own
    forward pass (later ppo_epochs reuse the first epoch's). With more than one optimizer step per rollout those come
    from weights the earlier steps updated,
    and a token-level KL reward (add_token_level_kl) needs them before training: either way ROLL's results differ
    from this pipeline's, which always scores them with the weights the rollout was sampled with; refused."""
    if not config.force_disable_old_logprobs_recompute:
        return
    plan = report.train_plans.get("actor_train")
    steps = plan.optimizer_steps_per_rollout if plan is not None else 1
    if steps > 1:  # (later ppo_epochs reuse the first epoch's log-probs in ROLL: the same values as a pass)
        why = (f"{steps} optimizer steps per rollout (actor_train's batch plan): ROLL then takes each step's old "
               "log-probs from that step's own forward pass, after the earlier steps' updates")  # fmt: skip
    elif config.add_token_level_kl and config.init_kl_coef > 0:
        why = (f"add_token_level_kl and init_kl_coef={config.init_kl_coef}: the KL reward is computed from the old "
               "log-probs before training, which ROLL then does not compute")  # fmt: skip
    else:
        return
    raise PreflightError(
        f"force_disable_old_logprobs_recompute: true with {why}, while this pipeline always scores them with the "
        "weights the rollout was sampled with. Remove the key (ROLL's own choice recomputes them here), or train one "
        "optimizer step per rollout without the KL reward."
    )


def check_token_budgets(sections: dict[str, WorkerConfig], longest: int, what: str) -> list[str]:
    """Dynamic batching: the longest sample the pipeline can build (``longest`` tokens, ``what`` says whence),
    rounded up to ``sequence_length_round_in_*``, must fit in one pass of ``max_tokens_per_microbatch_in_*``; with
    ``load_balance`` packing, in ``max_packed_sequence_length_*``.

    Returns a note for each budget that is not a multiple of its rounding: ROLL accepts those (its own example
    writes 49125 for a rounding of 128), and a pass then holds at most the largest multiple below the budget.
    """
    notes = []
    for role, section in sections.items():
        _check_packed_lengths(role, section, longest, what)
        for phase in ("train", "infer"):
            if not getattr(section, f"use_dynamic_batching_in_{phase}"):
                continue
            if phase == "train" and role not in TRAIN_ROLES:  # ROLL ignores it there (the engine warns)
                continue
            budget = getattr(section, f"max_tokens_per_microbatch_in_{phase}")
            round_to = getattr(section, f"sequence_length_round_in_{phase}")
            need = -(-longest // round_to) * round_to
            if need > budget:
                raise PreflightError(
                    f"{role}.max_tokens_per_microbatch_in_{phase}={budget} cannot hold one sample of {what} = "
                    f"{longest} tokens ({need} rounded to {role}.sequence_length_round_in_{phase}={round_to}); "
                    f"raise it to at least {need} (ROLL recommends sequence_length x 2 x micro_batch_size)."
                )
            if budget % round_to:
                notes.append(
                    f"[preflight] {role}.max_tokens_per_microbatch_in_{phase}={budget} is not a multiple of "
                    f"{role}.sequence_length_round_in_{phase}={round_to}: its passes hold at most "
                    f"{budget - budget % round_to} tokens (lengths are rounded up to multiples of {round_to})."
                )
            if phase == "train":
                notes.append(_train_budget_note(role, section))
    return notes


def _train_budget_note(role: str, section: WorkerConfig) -> str:
    """Where a training budget differs from ROLL's: ROLL regroups the rank's whole batch by length into optimizer
    steps of ``gradient_accumulation_steps`` passes (its own TODO calls the changed step count a limitation); here
    the mini-batches stay, as the update must equal the padded one."""
    return (
        f"[preflight] {role}.use_dynamic_batching_in_train: the budget cuts each mini-batch "
        f"({_minibatch_samples(section)} samples per "
        f"rank: per_device_train_batch_size x gradient_accumulation_steps, one optimizer step) into passes, so each "
        "update equals the padded one; ROLL instead sorts the rank's whole batch by length and makes an optimizer "
        "step of every gradient_accumulation_steps passes, so its number of steps, and which samples share one, "
        "follow the lengths."
    )


def _minibatch_samples(section: WorkerConfig) -> int:
    """Samples of one optimizer step on one rank: per_device_train_batch_size x gradient_accumulation_steps."""
    return section.training_args.per_device_train_batch_size * section.training_args.gradient_accumulation_steps


def _check_packed_lengths(role: str, section: WorkerConfig, longest: int, what: str) -> None:
    """``load_balance`` packing: ``max_packed_sequence_length_*`` must hold the longest sample, and a training
    role's ``min_num_micro_batches_train`` must not ask for more micro-batches than a mini-batch has samples (ROLL
    asserts both when the pass runs; here they fail before anything starts)."""
    args = section.sequence_packing_args
    if not section.use_sequence_packing or args.algorithm != "load_balance":
        return
    for phase in ("train", "forward"):
        length = getattr(args, f"max_packed_sequence_length_{phase}")
        if length is not None and length < longest:
            raise PreflightError(
                f"{role}.sequence_packing_args.max_packed_sequence_length_{phase}={length} is shorter than one "
                f"sample of {what} = {longest} tokens; raise it to at least {longest}."
            )
    training, samples = section.training_args, _minibatch_samples(section)
    if role in TRAIN_ROLES and args.min_num_micro_batches_train > samples:
        raise PreflightError(
            f"{role}.sequence_packing_args.min_num_micro_batches_train={args.min_num_micro_batches_train} asks for "
            f"more micro-batches than the {samples} samples of a mini-batch (per_device_train_batch_size "
            f"{training.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{training.gradient_accumulation_steps}); lower it to at most {samples}."
        )


def plan_training(
    config: SharedConfig,
    placement: PlacementPlan,
    sections: dict[str, WorkerConfig],
    num_return_sequences_in_group: int = 1,
    samples: int | None = None,
) -> PreflightReport:
    """The report: ``placement`` and the batch plan and lr decay steps of every configured training role (for
    ``samples`` per step when given, see train_plan)."""
    plans, decay = {}, {}
    notes = reference_notes(config) + critic_notes(config) + replay_notes(config) + lora_notes(config)
    notes += clip_range_notes(config)
    for role in TRAIN_ROLES:
        if role in sections:
            plans[role] = train_plan(config, role, sections[role], num_return_sequences_in_group, samples)
            decay[role] = lr_decay_steps(config.max_steps, plans[role], config.ppo_epochs)
            notes += fill_schedule_steps(config, role, sections[role], plans[role], num_return_sequences_in_group)
    return PreflightReport(placement, plans, decay, notes)


def aggregation_notes(config: SharedConfig, sequence_length: int) -> list[str]:
    """The pre-flight lines on how ``loss_agg_mode`` aggregates, where ROLL's meaning is not the name's usual one
    (see :func:`apps.common.algorithm.roll_aggregation`): seq-mean-token-sum-norm, and a critic, which ROLL
    aggregates by seq-mean-token-mean whatever the key says. ``sequence_length``: ROLL's resolved one."""
    notes = []
    mode = config.loss_agg_mode
    _, divisor = roll_aggregation(config, sequence_length)
    if divisor is not None:
        train = config.actor_train
        batched = train is not None and (train.use_dynamic_batching_in_train or train.use_sequence_packing)
        cut = (" ROLL's dynamic batching and packing divide each micro-batch by its own width instead, which its code "
               "says should be constant; here it stays one constant, so the update does not depend on how a "
               "mini-batch is cut.") if batched else ""  # fmt: skip
        notes.append(f"[preflight] loss_agg_mode seq-mean-token-sum-norm: as ROLL's agg_loss, actor_train's losses "
                     f"sum every token of a mini-batch and divide by sequence_length - 1 = {divisor:g} (the "
                     "width of ROLL's padded loss mask) alone, not also by the number of sequences as verl's mode of "
                     f"that name (rl-core's token-sum-norm).{cut}")  # fmt: skip
    if critic_enabled(config) and mode != "seq-mean-token-mean":
        notes.append(f"[preflight] critic: the value loss is seq-mean-token-mean, as ROLL's CriticWorker, which does "
                     f"not read loss_agg_mode ({mode} applies to actor_train's losses).")  # fmt: skip
    return notes


def clip_range_notes(config: SharedConfig) -> list[str]:
    """The pre-flight line when pg_clip_low / pg_clip_high are given without ROLL's use_pg_clip_range."""
    given = [key for key in ("pg_clip_low", "pg_clip_high") if getattr(config, key) is not None]
    if config.use_pg_clip_range or not given:
        return []
    return [f"[preflight] {' / '.join(given)}: ROLL clips with them only when use_pg_clip_range is true; it is false, "
            f"so pg_clip ({config.pg_clip}) clips both sides and they change nothing (set use_pg_clip_range: true to "
            "clip by them)."]  # fmt: skip


def fill_schedule_steps(
    config: SharedConfig, role: str, section: WorkerConfig, plan: TrainBatchPlan, num_return_sequences_in_group: int
) -> list[str]:
    """ROLL's ``set_max_steps``: a training role without ``training_args.max_steps`` gets ``max_steps x
    rollout_batch_size x num_return_sequences x ppo_epochs / (per_device_train_batch_size x
    gradient_accumulation_steps x data-parallel size)`` (at least 1), what a decaying schedule decays over. Returns
    the pre-flight line saying so when the schedule decays."""
    args = section.training_args
    if args.max_steps is not None:
        return []
    dp = plan.samples_per_step // plan.samples_per_dp_rank
    samples = config.max_steps * config.rollout_batch_size * num_return_sequences_in_group * config.ppo_epochs
    args.max_steps = max(1, samples // (args.per_device_train_batch_size * args.gradient_accumulation_steps * dp))
    if args.lr_scheduler_type not in DECAYING_SCHEDULES:
        return []
    return [
        f"[preflight] {role}.training_args.max_steps is not set: {args.max_steps} optimizer steps, ROLL's count "
        "(max_steps x rollout_batch_size x num_return_sequences x ppo_epochs / (per_device_train_batch_size x "
        f"gradient_accumulation_steps x data-parallel size)), is what lr_scheduler_type {args.lr_scheduler_type} "
        "decays over."
    ]

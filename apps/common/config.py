"""The top-level keys both pipelines read, as one typed dataclass: experiment, cluster, schedule, PPO / GRPO, KL,
reward shaping, rollout IS, the worker sections (``rl_engines.config.WorkerConfig``) and rollout_mock.

``apps.rlvr.config.RLVRConfig`` extends ``SharedConfig`` with the RLVR-only keys (prompt lengths, dynamic sampling,
sample masks, rewards, validation); ``apps.agentic.config.AgenticConfig`` holds one as ``base`` next to the agentic
keys. ``SharedConfig.from_dict(mapping)`` rejects unknown keys and bad values naming the key path; the single-key
checks are in ``apps.common.config_checks``, the cross-section ones that need the cluster in
``apps.common.preflight``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from apps.common.policy_args import ActorPolicyArgs, pop_policy_args
from rl_core.rollout_corr_config import RolloutCorrectionConfig
from rl_core.train_infer_correction import (
    TrainInferCorrectionConfig,
    TrainInferFilterConfig,
    TrainInferISWeightConfig,
)
from rl_engines.config import GeneratingArgs, WorkerConfig, WorkerConfigError, build_dataclass

ROLE_KEYS = ("actor_train", "actor_infer", "reference", "critic")


ROLL_PROMPT_LENGTH = 1024
"""ROLL's default ``prompt_length`` (its base config's)."""


@dataclass
class SharedConfig:
    """The top-level keys the RLVR and agentic pipelines share. Defaults follow ROLL's where it documents one."""

    # ---- experiment ------------------------------------------------------------------------------------------
    exp_name: str = "rlvr"
    """Experiment name: names output folders, logs and tracker runs."""
    seed: int = 42
    """Seed of data order, sampling and initialisation."""
    rpc_timeout: float = 3600.0
    """Seconds any remote call may take before the job fails naming the role and rank."""
    output_dir: str = "./output"
    """Checkpoints and run outputs."""
    logging_dir: str = "./output/logs"
    """Log files."""
    system_envs: dict[str, str] = field(default_factory=dict)
    """Environment variables set in every worker process."""
    profiler_timeline: bool = False
    """A torch.profiler trace of every generate / log-prob / value / train call on rank 0 of each role, written under
    ``profiler_output_dir/<exp_name>/<start time>/<role>/<method>/`` (ROLL's key; rl_engines.profiling)."""
    profiler_memory: bool = False
    """A CUDA allocator snapshot of each of those calls instead (CUDA only: logged and skipped without a GPU); not
    together with profiler_timeline."""
    profiler_output_dir: str = "./output/profiler"
    """Where the profiles go (the experiment name and the start time are appended, as ROLL does)."""
    track_with: str = "stdout"
    """Tracker: stdout, tensorboard or wandb."""
    tracker_kwargs: dict[str, Any] = field(default_factory=dict)
    """Tracker options (log_dir for tensorboard; project, tags, ... for wandb)."""
    checkpoint_config: dict[str, Any] = field(default_factory=dict)
    """Where checkpoints go (ROLL: type + output_dir); output_dir/checkpoints when empty."""
    offload_nccl: bool | None = None
    """ROLL's files set it at the top only to interpolate it into each role's ``offload_nccl`` (which is read). ROLL's
    config has no top-level field of that name and its parser drops it; so does this one (a pre-flight note says so)."""
    reward_system_config: dict[str, Any] | None = None
    """Not a field of ROLL's pipeline configs: its parser drops it (only ROLL's remote reward-system worker reads a
    ``reward_system_config``, from batch metadata its pipelines never set). Dropped here too, with a pre-flight note."""
    # ---- cluster ---------------------------------------------------------------------------------------------
    num_nodes: int = 1
    """Machines in the Ray cluster."""
    num_gpus_per_node: int = 8
    """Devices per machine (CPU worker slots on a CPU-only machine)."""
    # ---- schedule --------------------------------------------------------------------------------------------
    max_steps: int = 500
    """Pipeline steps (rollout + train) to run."""
    save_steps: int = 10000
    """Checkpoint every this many steps."""
    model_update_buffer_size_mb: int | None = None
    """ROLL's bucket size of the train -> infer weight sync, in MiB (ROLL's default 1024); null: 64 MiB, a size a
    small ``/dev/shm`` holds (colocated roles sync through shared memory). ``model_update/buckets`` reports the
    count."""
    max_ckpt_to_keep: int = 0
    """Complete checkpoints kept: after each save the older ones beyond the newest this many are deleted (ROLL's
    cleanup, with its log line); 0 keeps every one."""
    logging_steps: int = 1
    """Log metrics every this many steps."""
    eval_steps: int = 10
    """Validate every this many steps (0 disables)."""
    resume_from_checkpoint: bool | str = False
    """False; True = the latest checkpoint under the checkpoint dir; or a checkpoint path."""
    # ---- batch and lengths -----------------------------------------------------------------------------------
    rollout_batch_size: int = 64
    """Prompts per step."""
    val_batch_size: int | None = None
    """Prompts per validation batch (None = the whole validation set at once)."""
    sequence_length: int | None = None
    """Total context. RLVR: when set, it wins over response_length (= sequence_length - prompt_length, as ROLL).
    Agentic: the tokens an episode may fill (null: prompt_length + response_length when given, else 8192)."""
    async_generation_ratio: float = 0.0
    """Batches generation may run ahead of training (needs actor_infer on its own devices)."""
    pretrain: str | None = None
    """Policy model folder; fills model_name_or_path of actor_train, actor_infer, reference and critic."""
    reward_pretrain: str | None = None
    """Reward / judge model folder (referenced from reward sections)."""
    model_download_type: str | None = None
    """Where a model given as a hub id (``Qwen/Qwen2.5-7B-Instruct``, not a folder) is downloaded from before
    pre-flight: ``HUGGINGFACE_HUB`` or ``MODELSCOPE`` (needs the modelscope package); unset, ROLL's variable
    ``MODEL_DOWNLOAD_TYPE`` (system_envs or the environment), else ModelScope, as ROLL. The id is replaced by the
    downloaded folder (apps.common.model_hub)."""
    # ---- PPO / GRPO ------------------------------------------------------------------------------------------
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    max_grad_norm: float | None = None
    """Overrides actor_train / critic training_args.max_grad_norm when set."""
    adv_estimator: str = "gae"
    """rl-core advantage estimator: gae, grpo, reinforce, reinforce_plus_plus(_baseline), rloo, opo."""
    gamma: float = 1.0
    """Discount factor."""
    lambd: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = False
    """Normalise advantages to zero mean, unit variance over the batch."""
    advantage_clip: float | None = None
    """Clip advantages to [-advantage_clip, advantage_clip]."""
    pg_variant: str = "vanilla"
    """rl-core policy loss (verl loss_mode names) of ROLL's ActorWorker runs; with actor_train.worker_cls
    ActorPGWorker, actor_train.pg_variant decides (apps.common.policy_args)."""
    importance_sampling: str = "token"
    """ROLL's ActorWorker PPO ratio: token, or seq (one ratio per sequence: exp of the mean token log-ratio)."""
    pg_clip: float = 0.2
    """PPO clip epsilon."""
    use_pg_clip_range: bool = False
    """ROLL's switch for pg_clip_low / pg_clip_high: false, pg_clip clips both sides and they change nothing."""
    pg_clip_low: float | None = None
    """Lower clip epsilon with use_pg_clip_range (ROLL's default there: 0.2)."""
    pg_clip_high: float | None = None
    """Upper clip epsilon with use_pg_clip_range (DAPO clip-higher; ROLL's default there: 0.2)."""
    dual_clip_loss: bool = False
    """Dual-clip PPO as ROLL: a negative-advantage token's loss is capped at (1 + 2 pg_clip) |A|."""
    value_clip: float | None = 0.5
    """Critic value clipping range; null disables."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """How actor_train's losses aggregate over a mini-batch, as ROLL's agg_loss: token-mean, seq-mean-token-sum,
    seq-mean-token-mean, seq-mean-token-sum-norm (the token sums divided by sequence_length - 1 alone: rl-core's
    token-sum-norm), or another rl-core mode. The critic's value loss is seq-mean-token-mean, as ROLL's."""
    rl_loss_coef: float = 1.0
    """Weight of the policy-gradient loss with its KL term (ROLL's: (pg + kl_loss_coef x kl) x rl_loss_coef)."""
    entropy_loss_coef: float = 0.0
    """Weight of the entropy bonus (>= 0: ROLL adds it only when positive)."""
    sft_loss_coef: float = 0.0
    """Weight of an SFT loss (needs SFT data; not supported by the RL objective)."""
    use_kl_loss: bool = False
    """KL-to-reference as a loss term (GRPO style)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """rl-core KL estimator of the KL loss."""
    add_token_level_kl: bool = False
    """KL-to-reference subtracted from the token rewards (PPO style), weighted by the KL controller."""
    kl_penalty: str = "kl"
    """rl-core KL estimator of the in-reward KL: kl, abs, mse, low_var_kl, full."""
    init_kl_coef: float = 0.2
    """Initial in-reward KL coefficient."""
    target_kl: float | None = None
    """Adaptive KL control target; None = fixed coefficient."""
    kl_horizon: int = 10000
    """Adaptive KL control horizon."""
    enable_reference: bool = False
    """ROLL's: run the reference role. It runs anyway when a KL needs it (use_kl_loss, add_token_level_kl or
    init_kl_coef > 0, as ROLL); otherwise a configured `reference` is not started and ref_log_probs are the
    old_log_probs (every KL to it 0)."""
    critic_warmup: int = 0
    """Steps that train only the critic."""
    # ---- rewards ---------------------------------------------------------------------------------------------
    reward_clip: float | None = None
    """Clip rewards to [-reward_clip, reward_clip]."""
    reward_norm: str | None = None
    """rl-core reward normalisation: batch, group, running, or null."""
    reward_shift: bool = False
    """Normalisation only subtracts the mean."""
    reward_scale: bool = False
    """Normalisation only divides by the std."""
    norm_mean_type: str | None = None
    """ROLL: mean used to centre rewards (batch, group, or null)."""
    norm_std_type: str | None = None
    """ROLL: std used to scale rewards (batch, group, or null)."""
    whiten_rewards: bool = False
    """Whiten rewards before advantages."""
    add_len_reward: bool = False
    """Kimi k1.5 length reward."""
    use_reward_scaling: bool = False
    """Legacy ROLL switch kept for compatibility (reward_norm supersedes it)."""
    use_reward_norm: bool = False
    """Legacy ROLL switch kept for compatibility (reward_norm supersedes it)."""
    # ---- sample-mask thresholds (accepted and range-checked by both; only RLVR's masks read them) ---------------
    error_max_len_threshold: int | None = None
    """Response tokens from which a wrong sample leaves the loss (null = ROLL's 9999999999: no length limit)."""
    difficulty_low_threshold: float = 0.0
    """A group is kept only if its mean score is > this."""
    difficulty_high_threshold: float = 1.0
    """A group is kept only if its mean score is < this."""
    # ---- rollout importance sampling (verl) ------------------------------------------------------------------
    rollout_is: bool = False
    """Apply the IS weights to the loss (False = metrics only when a threshold is set)."""
    rollout_is_threshold: float | None = None
    """Upper IS threshold; null disables rollout IS entirely."""
    rollout_is_threshold_lower: float | None = None
    """Lower threshold (default 1 / upper)."""
    rollout_is_level: str = "token"
    """token, sequence or geometric."""
    rollout_is_mode: str = "truncate"
    """truncate, clip or mask."""
    rollout_is_veto_threshold: float | None = 1e-4
    """Veto a sequence when any token ratio is below this."""
    rollout_correction: RolloutCorrectionConfig | None = None
    """verl 0.9.1's rollout correction (its ``algorithm.rollout_correction`` keys: rollout_is, rollout_is_threshold,
    rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, bypass_mode, loss_type; see
    docs/rollout-importance-sampling.md): weights and rejections applied after the advantages (verl: before; the
    same advantages for grpo and rloo, see the doc), ``rollout_corr/`` metrics. Instead of the rollout_is_* keys
    above, not with them."""
    train_infer_correction: TrainInferCorrectionConfig | None = None
    """ROLL's train-infer correction (``is_weight``: an IS weight on each token's policy loss from the training and
    inference engines' log-probs, at token / geometric / sequence / segment level, clamped; ``filters``: tokens whose
    ratio or probability difference leaves a band drop out of the loss), applied after the advantages;
    ``actor/train_infer_*`` metrics (rl_core.train_infer_correction). Not with verl's rollout_correction / rollout_is_*
    keys (two corrections of the same gap)."""
    enable_old_logprobs_recompute: bool | None = None
    """ROLL: compute the old log-probs in a pass of actor_train before training (ROLL turns it on itself when a
    step takes several backward passes per rank or init_kl_coef > 0). Off, ROLL's train step uses its own log-probs of
    the same weights instead, the same values; here that pass always runs (given, a pre-flight note says so)."""
    force_disable_old_logprobs_recompute: bool | None = None
    """ROLL: keep that pass off even where ROLL would turn it on; the same note applies."""
    # ---- sections --------------------------------------------------------------------------------------------
    actor_train: WorkerConfig = field(default_factory=WorkerConfig)
    """Policy training role."""
    actor_infer: WorkerConfig = field(default_factory=WorkerConfig)
    """Generation role."""
    reference: WorkerConfig | None = None
    """Frozen reference policy (needed for any KL)."""
    critic: WorkerConfig | None = None
    """Value model (needed for gae)."""
    rollout_mock: dict[str, Any] | None = None
    """rl-replay dump / mock (enable, mode, dump_dir)."""
    actor_policy: ActorPolicyArgs = field(default_factory=ActorPolicyArgs)
    """The policy-loss keys of the actor_train section (worker_cls, pg_variant, tis_* ...), parsed apart."""
    sampling_notes: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    """Derived at load, not a key: the pre-flight lines of sampling keys a file leaves out where ROLL's defaults
    differ (:func:`sampling_default_notes`)."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SharedConfig:
        """Build and validate from a loaded config mapping; every error names the key path."""
        values = dict(values)
        sections = pop_shared_sections(values)
        config = dataclasses.replace(build_dataclass(cls, values, ""), **sections)
        validate_shared(config)
        return config


def reference_enabled(config: SharedConfig) -> bool:
    """ROLL's ``enable_reference``, forced on by any KL to the reference (``init_kl_coef`` > 0 included)."""
    kl = config.use_kl_loss or config.add_token_level_kl or config.init_kl_coef > 0
    return config.enable_reference or kl


def reference_from_actor(config: SharedConfig) -> bool:
    """A LoRA actor with a running reference: the reference is the actor's base model with its adapters disabled,
    whatever model the reference section names (ROLL's pipelines build no reference model when actor_train trains
    LoRA adapters: ``use_ref_model = enable_reference and not is_lora_training``), so no reference copy starts."""
    train, reference = config.actor_train, config.reference
    return train is not None and reference is not None and train.model_args.lora and reference_enabled(config)


def critic_enabled(config: SharedConfig) -> bool:
    """A configured critic runs only for ``adv_estimator: gae``, the one estimator that reads its values: ROLL's
    RLVR and agentic pipelines build, score and train the critic under that condition alone."""
    return config.critic is not None and config.adv_estimator == "gae"


DEAD_ROLL_KEYS = {
    key: f"{key} is declared in ROLL's config but read by none of its losses, so it changes nothing there; TOPR's "
    "weights are actor_train.topr_positive_weight / topr_negative_weight with actor_train.worker_cls "
    "roll.pipeline.rlvr.actor_pg_worker.ActorPGWorker and actor_train.pg_variant: topr. Remove it."
    for key in ("use_topr_neg_loss_coef", "positive_loss_coef", "postive_loss_coef", "use_topr_loss",
                "use_policy_loss_type")
}  # fmt: skip
"""Top-level keys of ROLL's config that no ROLL code reads: refused with where the setting really lives."""


UNREAD_SHARED_KEYS = {
    "report_length_and_rewards": (False, "ROLL only exports REPORT_LENGTH_AND_REWARDS=1 for it, which none of its code "
                                         "reads since its scheduler refactor (a TODO there)"),
}  # fmt: skip
"""Top-level keys of ROLL's BaseConfig that no ROLL code acts on: ROLL's default passes (changing nothing, as there),
any other value is refused naming why (:func:`pop_unread_roll_keys`)."""


ROLL_SAMPLING_DEFAULTS = {"temperature": 0.95, "top_p": 0.7, "top_k": 50}
"""ROLL's GeneratingArguments defaults where rl-engines' differ (1.0, 1.0, -1: plain sampling, as verl's)."""


def sampling_default_notes(sections: dict[str, Any]) -> list[str]:
    """For each ``generating_args`` mapping of a file (by its key path) that samples (temperature not 0) and leaves
    temperature / top_p / top_k out: a pre-flight line saying the value used here and ROLL's default, which differ."""
    notes = []
    for where, given in sections.items():
        if not isinstance(given, dict) or given.get("temperature") == 0:
            continue
        left_out = [key for key in ROLL_SAMPLING_DEFAULTS if key not in given]
        if not left_out:
            continue
        ours = {field.name: field.default for field in dataclasses.fields(GeneratingArgs)}
        here = ", ".join(f"{key} {ours[key]}" for key in left_out)
        roll = ", ".join(f"{key} {ROLL_SAMPLING_DEFAULTS[key]}" for key in left_out)
        notes.append(f"[preflight] {where} leaves {' / '.join(left_out)} out: this run samples with {here} (plain "
                     f"sampling, as verl's defaults); ROLL's defaults would be {roll}. Set them to sample as a ROLL "
                     "run does.")  # fmt: skip
    return notes


def pop_unread_roll_keys(values: dict[str, Any], table: dict[str, tuple[Any, str]]) -> None:
    """Drop each key of ``table`` given at ROLL's default (or null; a mapping of nulls and zeros for a section);
    refuse another value, saying why it would change nothing there and where the setting lives."""
    for key, (default, why) in table.items():
        if key not in values:
            continue
        value = values.pop(key)
        unset = value is None or (isinstance(value, dict) and all(v in (None, 0) for v in value.values()))
        if not unset and value != default:
            raise WorkerConfigError(f"{key}={value!r} changes nothing, as in ROLL: {why}. Remove it.")


LORA_VARIABLES = ("lora_target", "lora_rank", "lora_alpha", "lora_dropout")
"""Top-level keys ROLL's LoRA files define only to interpolate into the roles' model_args (``${lora_rank}``)."""


def pop_lora_variables(values: dict[str, Any]) -> None:
    """Drop ROLL's top-level LoRA variables, which configure nothing themselves; given without a LoRA actor_train
    (nothing interpolated them where they act) they are refused, naming where they belong."""
    given = [key for key in LORA_VARIABLES if key in values]
    switched_off = values.get("lora_target", "") is None  # ROLL's files may turn LoRA off through the variable
    for key in given:
        values.pop(key)
    if switched_off:
        return
    train = values.get("actor_train")
    if given and not (isinstance(train, dict) and (train.get("model_args") or {}).get("lora_target") is not None):
        raise WorkerConfigError(
            f"top-level {given} configure nothing on their own: ROLL's files interpolate them into "
            f"actor_train.model_args (lora_target: ${{lora_target}}), which has no lora_target here. Put them in "
            "actor_train.model_args (and actor_infer's), or remove them for full-parameter training."
        )


def pop_shared_sections(values: dict[str, Any]) -> dict[str, Any]:
    """Remove the worker sections and ``rollout_mock`` from ``values``; return them parsed, by key."""
    pop_lora_variables(values)
    pop_unread_roll_keys(values, UNREAD_SHARED_KEYS)
    for key in DEAD_ROLL_KEYS:
        if key in values:
            raise WorkerConfigError(DEAD_ROLL_KEYS[key])
    sections: dict[str, Any] = {}
    if "actor_policy" in values:
        raise WorkerConfigError("unknown key(s) ['actor_policy']: the policy keys (worker_cls, pg_variant, tis_*, "
                                "...) go in the actor_train section.")  # fmt: skip
    for role in ROLE_KEYS:
        if role in values:
            section = values.pop(role)
            if role == "actor_train" and isinstance(section, dict):
                section = dict(section)
                policy = pop_policy_args(section)
                sections["actor_policy"] = build_dataclass(ActorPolicyArgs, policy, "actor_train")
            sections[role] = None if section is None else WorkerConfig.from_dict(section, role)
    if "rollout_mock" in values:
        sections["rollout_mock"] = _rollout_mock(values.pop("rollout_mock"))
    if "train_infer_correction" in values:
        sections["train_infer_correction"] = _train_infer_correction(values.pop("train_infer_correction"))
    return sections


def checked_section(section: Any, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    """``section`` (the mapping at key path ``where``) when its keys are among ``allowed``; otherwise a
    :class:`WorkerConfigError` naming the key."""
    if not isinstance(section, dict):
        raise WorkerConfigError(f"{where} must be a mapping with keys {sorted(allowed)}, got {section!r}.")
    unknown = sorted(set(section) - set(allowed), key=str)
    if unknown:
        raise WorkerConfigError(f"unknown key(s) {[f'{where}.{name}' for name in unknown]}; valid keys of {where}: "
                                f"{sorted(allowed)}. Fix the spelling or remove the key.")  # fmt: skip
    return section


def _train_infer_correction(section: Any) -> TrainInferCorrectionConfig | None:
    """ROLL's ``train_infer_correction`` mapping: ``is_weight`` and the list of ``filters``, every key checked."""
    if section is None:
        return None
    key = "train_infer_correction"
    section = checked_section(section, ("is_weight", "filters"), key)
    filters = section.get("filters") or []
    if not isinstance(filters, list):
        raise WorkerConfigError(f"{key}.filters must be a list of filter rules, got {filters!r}.")
    config = TrainInferCorrectionConfig(
        is_weight=build_dataclass(TrainInferISWeightConfig, section.get("is_weight"), f"{key}.is_weight"),
        filters=[build_dataclass(TrainInferFilterConfig, rule, f"{key}.filters[{i}]")
                 for i, rule in enumerate(filters)],
    )  # fmt: skip
    try:
        config.validate(key)
    except ValueError as err:
        raise WorkerConfigError(str(err)) from None
    return config


def _rollout_mock(section: Any) -> dict[str, Any] | None:
    from rl_replay.config import RolloutMockConfig

    if section is None:
        return None
    try:
        RolloutMockConfig.from_dict(section)
    except ValueError as err:
        raise WorkerConfigError(str(err)) from None
    return dict(section)


def validate_shared(config: SharedConfig) -> None:
    """Range checks and registry lookups of the shared top-level keys; raises WorkerConfigError naming the key."""
    from apps.common.config_checks import check_choices, check_ranges

    check_ranges(config)
    check_choices(config)

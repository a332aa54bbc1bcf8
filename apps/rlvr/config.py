"""The RLVR pipeline's configuration: ROLL's top-level keys as one typed dataclass, worker sections as
``rl_engines.config.WorkerConfig``, rewards, validation and rollout_mock sections.

``RLVRConfig.from_dict(mapping)`` (the output of ``apps.common.yaml_config.load_config``) rejects unknown keys and bad
values naming the key path; ``validate()`` checks every choice against the rl-core registry that implements it.
Cross-section checks that need the cluster (device mappings, batch divisibility) live in ``apps.rlvr.preflight``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rl_engines.config import GeneratingArgs, WorkerConfig, WorkerConfigError, build_dataclass

ROLE_KEYS = ("actor_train", "actor_infer", "reference", "critic")


@dataclass
class RewardSpec:
    """The reward-specific keys of one ``rewards.<name>`` section; the rest of it is a WorkerConfig."""

    worker_cls: str | None = None
    """ROLL reward worker class path; its last component picks the registered reward (e.g. MathRuleRewardWorker)."""
    reward_type: str | None = None
    """Reward flavour passed to the reward function (e.g. ``soft`` / ``hard``)."""
    tag_included: list[str] = field(default_factory=list)
    """Data tags this reward scores; samples are routed by their ``tag`` column."""
    response_length_penalty_coef: float = 0.0
    """Penalty per response token subtracted from the reward."""
    use_local: bool = False
    """Code sandbox: run locally (accepted for ROLL compatibility)."""
    judge_prompt: str | None = None
    """LLM-judge prompt template name."""
    judge_model_type: str | None = None
    """LLM-judge serving type (e.g. ``inference``)."""
    query_filter_config: dict[str, Any] = field(default_factory=dict)
    """Dynamic filtering of prompts by this reward (ROLL ``query_filter_config``)."""


@dataclass
class RewardConfig:
    """One ``rewards.<name>`` section."""

    spec: RewardSpec
    worker: WorkerConfig

    @classmethod
    def from_dict(cls, values: Any, key: str) -> RewardConfig:
        """Split a reward section into its reward keys and its worker keys; errors name ``rewards.<name>.<key>``."""
        if not isinstance(values, dict):
            raise WorkerConfigError(f"{key} must be a mapping, got {values!r}.")
        spec_keys = {f.name for f in dataclasses.fields(RewardSpec)}
        spec = build_dataclass(RewardSpec, {k: v for k, v in values.items() if k in spec_keys}, key)
        worker = WorkerConfig.from_dict({k: v for k, v in values.items() if k not in spec_keys}, key)
        return cls(spec, worker)


@dataclass
class ValidationConfig:
    """The ``validation`` section: which data to score and how to sample for it."""

    data_args: dict[str, Any] = field(default_factory=dict)
    """template, file_name (list) of the validation set."""
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    """Sampling for validation (usually lower temperature, one sample per prompt)."""


@dataclass
class RLVRConfig:
    """Every top-level key of a ROLL RLVR config. Defaults follow ROLL's where it documents one."""

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
    track_with: str = "stdout"
    """Tracker: stdout, tensorboard or wandb."""
    tracker_kwargs: dict[str, Any] = field(default_factory=dict)
    """Tracker options (log_dir for tensorboard; project, tags, ... for wandb)."""
    checkpoint_config: dict[str, Any] = field(default_factory=dict)
    """Where checkpoints go (ROLL: type + output_dir); output_dir/checkpoints when empty."""
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
    prompt_length: int = 1024
    """Prompt tokens kept (longer prompts are truncated from the left)."""
    response_length: int = 1024
    """Response tokens generated at most."""
    sequence_length: int | None = None
    """Total context; must be >= prompt_length + response_length when set."""
    num_return_sequences_in_group: int = 1
    """Responses per prompt; samples per step = rollout_batch_size x this."""
    is_num_return_sequences_expand: bool = False
    """Expand prompts n times before generation instead of asking the engine for n samples."""
    generate_opt_level: int = 0
    """0: batch generation; 1: a request scheduler with max_running_requests."""
    max_running_requests: int = 128
    """Concurrent requests of the level-1 scheduler."""
    is_use_additional_prompts: bool = False
    """Dynamic sampling: draw extra prompts when masks drop groups."""
    max_additional_running_prompts: int = 16
    """Extra prompts in flight for dynamic sampling."""
    async_generation_ratio: float = 0.0
    """Batches generation may run ahead of training (needs actor_infer on its own devices)."""
    pretrain: str | None = None
    """Policy model folder; fills model_name_or_path of actor_train, actor_infer, reference and critic."""
    reward_pretrain: str | None = None
    """Reward / judge model folder (referenced from reward sections)."""
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
    """rl-core policy loss (ROLL pg_variant / verl loss_mode)."""
    pg_clip: float = 0.2
    """PPO clip epsilon."""
    pg_clip_low: float | None = None
    """Lower clip epsilon (default pg_clip)."""
    pg_clip_high: float | None = None
    """Upper clip epsilon (DAPO clip-higher; default pg_clip)."""
    dual_clip_loss: bool = False
    """Dual-clip PPO (constant 3)."""
    value_clip: float | None = 0.5
    """Critic value clipping range; null disables."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """rl-core loss aggregation mode."""
    rl_loss_coef: float = 1.0
    """Weight of the policy-gradient loss."""
    entropy_loss_coef: float = 0.0
    """Weight of the entropy bonus."""
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
    # ---- sample masks and weights ----------------------------------------------------------------------------
    max_len_mask: bool = False
    """Drop responses cut at response_length from the loss."""
    error_max_len_clip: bool = False
    """Keep only correct (score 1) samples and wrong (score 0) ones shorter than error_max_len_threshold."""
    error_max_len_threshold: int | None = None
    """Response tokens from which a wrong sample leaves the loss (null = response_length)."""
    difficulty_mask: bool = False
    """Drop prompt groups whose mean score is not strictly between the two thresholds."""
    difficulty_low_threshold: float = 0.0
    """A group is kept only if its mean score is > this."""
    difficulty_high_threshold: float = 1.0
    """A group is kept only if its mean score is < this."""
    difficulty_loss_weight: bool = False
    """Weight samples by 0.5 + 1.5 x the data's ``difficulty`` column (in [0, 1])."""
    length_loss_weight: bool = False
    """Weight samples by 1.5 - their min-max normalised response length (longer weighs less)."""
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
    # ---- sections --------------------------------------------------------------------------------------------
    actor_train: WorkerConfig = field(default_factory=WorkerConfig)
    """Policy training role."""
    actor_infer: WorkerConfig = field(default_factory=WorkerConfig)
    """Generation role."""
    reference: WorkerConfig | None = None
    """Frozen reference policy (needed for any KL)."""
    critic: WorkerConfig | None = None
    """Value model (needed for gae)."""
    rewards: dict[str, RewardConfig] = field(default_factory=dict)
    """Reward workers by name."""
    validation: ValidationConfig | None = None
    """Validation data and sampling."""
    rollout_mock: dict[str, Any] | None = None
    """rl-replay dump / mock (enable, mode, dump_dir)."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RLVRConfig:
        """Build and validate from a loaded config mapping; every error names the key path."""
        values = dict(values)
        sections: dict[str, Any] = {}
        for role in ROLE_KEYS:
            if role in values:
                section = values.pop(role)
                sections[role] = None if section is None else WorkerConfig.from_dict(section, role)
        rewards = values.pop("rewards", None) or {}
        if not isinstance(rewards, dict):
            raise WorkerConfigError(f"rewards must be a mapping of reward name -> section, got {rewards!r}.")
        sections["rewards"] = {name: RewardConfig.from_dict(v, f"rewards.{name}") for name, v in rewards.items()}
        if values.get("validation") is not None:
            validation = build_dataclass(ValidationConfig, values.pop("validation"), "validation")
            validation.generating_args.validate("validation.generating_args")
            sections["validation"] = validation
        if "rollout_mock" in values:
            sections["rollout_mock"] = _rollout_mock(values.pop("rollout_mock"))
        config = dataclasses.replace(build_dataclass(cls, values, ""), **sections)
        validate_rlvr(config)
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


def validate_rlvr(config: RLVRConfig) -> None:
    """Range checks and registry lookups of the top-level keys; raises WorkerConfigError naming the key."""
    from apps.rlvr.config_checks import check_choices, check_ranges

    check_ranges(config)
    check_choices(config)

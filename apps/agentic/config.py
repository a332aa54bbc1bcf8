"""The agentic pipeline's configuration: ROLL's "Agentic Pipeline" keys on top of the keys it shares with RLVR.

``AgenticConfig.from_dict(mapping)`` splits a loaded config (``apps.common.yaml_config.load_config``) into
- ``base``: an ``apps.common.config.SharedConfig`` of the keys both pipelines read (experiment, cluster, schedule,
  PPO / GRPO, KL, rollout IS, worker sections, rollout_mock), validated by the same code as RLVR's;
- the agentic keys: ``reward_normalization``, ``train_env_manager`` / ``val_env_manager``, ``custom_envs``,
  ``render_save_dir``, ``max_tokens_per_step`` and the step-sample keys (``batch_adjust_mode``, ``step_reward_gamma``,
  ``episode_reward_weight``, ``step_reward_weight``).
RLVR keys the agentic pipeline does not read (``rewards``, ``validation``, prompt data, dynamic sampling, ...) fail
naming the key. The variables ROLL's ``traj_envs.yaml`` / ``step_envs.yaml`` define only to be interpolated
(``agent_template``, ``action_pattern``, ``custom_env``, ...) are accepted and otherwise unused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from apps.agentic.env_sections import EnvManagerConfig, EnvSpec
from apps.common.config import ROLL_PROMPT_LENGTH, SharedConfig, sampling_default_notes
from rl_core.agentic_rewards import AGENTIC_GROUPINGS, AGENTIC_NORM_METHODS, NORM_TYPES
from rl_engines.config import WorkerConfigError, build_dataclass

DEFAULT_SEQUENCE_LENGTH = 8192
"""Tokens an episode may fill when ``sequence_length`` and ``response_length`` are null."""

# Variables of ROLL's examples/config/*.yaml (traj_envs, step_envs, the GEM families) that exist to be interpolated
# into custom_env sections.
TEMPLATE_VARIABLES = frozenset({
    "all_response_pattern", "action_pattern", "think_action_pattern", "max_actions_per_traj",
    "sokoban_format_penalty", "frozen_format_penalty", "env_manager_cls", "agent_runner_cls", "custom_env",
    "default_history_length", "pre_step_template", "next_step_template", "gem_math", "gem_code", "gem_qa",
    "gem_games", "gem_rg", "math_agent_system_template", "math_agent_template", "code_agent_system_template",
    "code_agent_template", "qa_agent_system_template", "qa_agent_template", "game_agent_system_template",
    "game_agent_template", "rg_agent_system_template", "rg_agent_template",
    "agent_system_template", "agent_template", "single_prompt_agent_system_template", "single_prompt_agent_template",
})  # fmt: skip

# RLVR keys the agentic pipeline does not read: -> how to say it instead.
RLVR_ONLY = {
    "rewards": "agentic rewards come from the environments (custom_envs.<tag>.env_config)",
    "validation": "validation runs the environments of val_env_manager every eval_steps",
    "num_return_sequences_in_group": "group_size of train_env_manager sets how many episodes share a seed",
    "is_num_return_sequences_expand": "episodes of one group are separate environments already",
    "generate_opt_level": "every turn of every environment is sent to actor_infer as one batch",
    "max_running_requests": "every turn of every environment is sent to actor_infer as one batch",
    "is_use_additional_prompts": "dynamic sampling is an RLVR feature",
    "max_additional_running_prompts": "dynamic sampling is an RLVR feature",
    "difficulty_mask": "difficulty masks are an RLVR feature",
    "difficulty_loss_weight": "difficulty masks are an RLVR feature",
    "error_max_len_clip": "length masks are an RLVR feature",
    "max_len_mask": "length masks are an RLVR feature",
    "length_loss_weight": "length weights are an RLVR feature",
    "rl_loss_coef": "ROLL's agentic config has no rl_loss_coef (its parser drops it and its agentic actor workers "
    "never scale the loss by it)",
}
ROLL_AGENTIC_IGNORED = {
    "importance_sampling": (
        "token",
        "ROLL's agentic config has no importance_sampling (its parser drops it and "
        "its agentic actor workers take the token ratio, or the segment ratio with "
        "ratio_type: segment)",
    ),
    "add_len_reward": (
        False,
        "ROLL's agentic pipeline reads add_len_reward nowhere (episode rewards are the environments' scores)",
    ),
}
"""Shared keys ROLL's agentic pipeline drops or never reads: their defaults pass (they change nothing there either),
another value is refused."""

BATCH_ADJUST_MODES = ("copy", "delete", "auto", "random_sample")


@dataclass
class RewardNormalization:
    """``reward_normalization``: how episode scores are normalised before advantages (rl-core)."""

    grouping: str = "batch"
    """Which episodes share statistics: batch (ROLL's default: all of them), state (= traj_group_id: one env
    group), inductive (= tags)."""
    method: str = "identity"
    """What is done within a group: identity, mean, mean_std, asym_clip (= mean_std, as in ROLL since its agentic
    norm refactor of Nov 2025; rl-core's own asym_clip, RAGEN's clamp to [-1, 3], is not what ROLL runs)."""
    norm_mean_type: str | None = None
    """ROLL: whose mean is subtracted, batch or group (null: as method says)."""
    norm_std_type: str | None = None
    """ROLL: whose std divides, batch or group (null: as method says)."""

    @property
    def core_method(self) -> str:
        """The rl-core method that does what ROLL does with ``method``."""
        return "mean_std" if self.method == "asym_clip" else self.method


@dataclass
class AgenticConfig:
    """Every key of a ROLL agentic config: ``base`` holds the ones shared with RLVR."""

    base: SharedConfig
    """Experiment, cluster, schedule, algorithm and worker keys (same meaning as in RLVR)."""
    reward_normalization: RewardNormalization = field(default_factory=RewardNormalization)
    """Episode score normalisation (rl-core agentic_rewards)."""
    train_env_manager: EnvManagerConfig = field(default_factory=EnvManagerConfig)
    """Environments of training rollouts."""
    val_env_manager: EnvManagerConfig | None = None
    """Environments of validation (held-out seeds; sampled with its generating_args, else actor_infer's); null = no
    validation."""
    custom_envs: dict[str, EnvSpec] = field(default_factory=dict)
    """Environment types by tag."""
    render_save_dir: str | None = None
    """Validation trajectories are written here as text and PNG frames (null = not rendered)."""
    max_tokens_per_step: int | None = None
    """Overrides every custom_envs entry's max_tokens_per_step when set."""
    prompt_length: int | None = None
    """ROLL's shared length key: enters only a null ``sequence_length``, derived as ``prompt_length`` (1024 when
    null) + ``response_length``, as ROLL's config derives it; with ``sequence_length`` set it changes nothing (ROLL
    drops it; its files set the pair to interpolate ``${response_length}``). A pre-flight note says which."""
    response_length: int | None = None
    """ROLL's shared length key: see ``prompt_length``. Each turn generates at most ``max_tokens_per_step``."""
    batch_adjust_mode: str = "copy"
    """How a step's sample count (episodes, or turns with step samples) is made a multiple of ROLL's size_divide,
    the lcm of the training batch and the log-prob passes' infer_batch_size x data-parallel size (copy, delete,
    auto, random_sample), as ROLL adjusts every batch."""
    step_reward_gamma: float = 0.95
    """gigpo / step_reinforce: discount of later turns' rewards in a turn's return."""
    episode_reward_weight: float = 1.0
    """gigpo: weight of the normalised episode score."""
    step_reward_weight: float = 1.0
    """gigpo: weight of the normalised step return (within its anchor-state group)."""
    ratio_type: str = "token"
    """PPO's ratio: token, or segment (one ratio per assistant turn: exp of the turn's mean token log-ratio; ROLL's
    agentic key, rl-core's segment_ppo)."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AgenticConfig:
        """Build and validate from a loaded config mapping; every error names the key path."""
        values = {k: v for k, v in values.items() if k not in TEMPLATE_VARIABLES}
        for key, instead in RLVR_ONLY.items():
            if key in values:
                raise WorkerConfigError(f"{key} is not an agentic pipeline key: {instead}. Remove it.")
        for key, (default, why) in ROLL_AGENTIC_IGNORED.items():
            if key in values and values[key] != default:
                raise WorkerConfigError(f"{key}={values[key]!r} changes nothing in an agentic run: {why}. Remove it.")
        own = {f.name for f in dataclasses.fields(cls)} - {"base"}
        agentic = {k: values.pop(k) for k in list(values) if k in own}
        config = cls(base=SharedConfig.from_dict(_manager_sampling(values, agentic)))
        config.base.sampling_notes = tuple(sampling_default_notes(_sampling_sections(values, agentic)))
        if "reward_normalization" in agentic:
            config.reward_normalization = build_dataclass(RewardNormalization, agentic["reward_normalization"],
                                                          "reward_normalization")  # fmt: skip
        for name in ("train_env_manager", "val_env_manager"):
            if agentic.get(name) is not None:
                setattr(config, name, EnvManagerConfig.from_dict(agentic[name], name))
        if "train_env_manager" not in agentic:
            raise WorkerConfigError("train_env_manager is missing; give its tags, num_env_groups and group_size.")
        envs = agentic.get("custom_envs") or {}
        if not isinstance(envs, dict):
            raise WorkerConfigError(f"custom_envs must be a mapping of tag -> environment, got {envs!r}.")
        config.custom_envs = {tag: build_dataclass(EnvSpec, spec, f"custom_envs.{tag}") for tag, spec in envs.items()}
        scalars = ("render_save_dir", "max_tokens_per_step", "batch_adjust_mode", "step_reward_gamma",
                   "episode_reward_weight", "step_reward_weight", "ratio_type", "prompt_length",
                   "response_length")  # fmt: skip
        picked = build_dataclass(_Scalars, {k: agentic[k] for k in scalars if k in agentic}, "")
        for name in scalars:
            setattr(config, name, getattr(picked, name))
        validate_agentic(config)
        return config

    @property
    def derived_sequence_length(self) -> int | None:
        """ROLL's ``sequence_length`` when the file leaves it null: ``prompt_length`` + ``response_length``."""
        if self.base.sequence_length is not None or self.response_length is None:
            return None
        return (self.prompt_length or ROLL_PROMPT_LENGTH) + self.response_length

    @property
    def sequence_length(self) -> int:
        """Tokens an episode may fill (first prompt and every turn): ``sequence_length``; when null, ROLL's
        ``prompt_length + response_length``, else 8192 (pre-flight checks that a turn fits)."""
        return self.base.sequence_length or self.derived_sequence_length or DEFAULT_SEQUENCE_LENGTH

    def mode(self, manager: EnvManagerConfig) -> str:
        """The sample layout of a manager's episodes (its tags share one, checked by validate_agentic)."""
        return self.custom_envs[manager.tags[0]].mode

    def visual(self, manager: EnvManagerConfig) -> bool:
        """Some of a manager's tags run under the vision-language env manager (VLTrajEnvManager)."""
        return any(self.custom_envs[tag].visual for tag in manager.tags)

    def env_spec(self, tag: str) -> EnvSpec:
        """The spec of ``tag`` with the top-level overrides (max_tokens_per_step) applied."""
        spec = self.custom_envs[tag]
        if self.max_tokens_per_step is not None:
            spec = dataclasses.replace(spec, max_tokens_per_step=self.max_tokens_per_step)
        return spec


@dataclass
class _Scalars:
    """The scalar agentic keys, type-checked by build_dataclass (defaults: AgenticConfig's)."""

    render_save_dir: str | None = None
    max_tokens_per_step: int | None = None
    batch_adjust_mode: str = "copy"
    step_reward_gamma: float = 0.95
    episode_reward_weight: float = 1.0
    step_reward_weight: float = 1.0
    ratio_type: str = "token"
    prompt_length: int | None = None
    response_length: int | None = None


def _sampling_sections(values: dict[str, Any], agentic: dict[str, Any]) -> dict[str, Any]:
    """The ``generating_args`` mappings the episodes sample with, by the key path the file gives them at:
    train_env_manager's (else actor_infer's) for training, val_env_manager's when it has its own."""
    sections = {}
    for name in ("train_env_manager", "val_env_manager"):
        given = (agentic.get(name) or {}).get("generating_args")
        if given:
            sections[f"{name}.generating_args"] = given
    if "train_env_manager.generating_args" not in sections:
        sections["actor_infer.generating_args"] = (values.get("actor_infer") or {}).get("generating_args") or {}
    return sections


def _manager_sampling(values: dict[str, Any], agentic: dict[str, Any]) -> dict[str, Any]:
    """ROLL's precedence of ``generating_args``: ``train_env_manager``'s become ``actor_infer``'s. ROLL lets
    ``actor_infer``'s silently override both managers' own, so giving both is refused."""
    infer = values.get("actor_infer") or {}
    managers = {name: (agentic.get(name) or {}).get("generating_args") for name in ("train_env_manager",
                                                                                      "val_env_manager")}  # fmt: skip
    given = [name for name, args in managers.items() if args]
    if given and isinstance(infer, dict) and infer.get("generating_args"):
        raise WorkerConfigError(
            f"actor_infer.generating_args and {given[0]}.generating_args are both set; ROLL samples every manager "
            "with actor_infer's and ignores the manager's. Keep one: actor_infer's for all episodes, or the "
            "managers' (train_env_manager's sample training, val_env_manager's validation)."
        )
    if managers["train_env_manager"] and isinstance(infer, dict):
        values = {**values, "actor_infer": {**infer, "generating_args": managers["train_env_manager"]}}
    return values


def validate_agentic(config: AgenticConfig) -> None:
    """Cross-key checks of the agentic keys; raises WorkerConfigError naming the key."""
    for registry, key in ((AGENTIC_GROUPINGS, "grouping"), (AGENTIC_NORM_METHODS, "method")):
        value = getattr(config.reward_normalization, key)
        if value not in registry:
            raise WorkerConfigError(f"reward_normalization.{key}={value!r}; valid values: {registry.names()}.")
    for key in ("norm_mean_type", "norm_std_type"):
        value = getattr(config.reward_normalization, key)
        if value is not None and value not in NORM_TYPES:
            raise WorkerConfigError(f"reward_normalization.{key}={value!r}; use batch, group or null.")
    for tag, spec in config.custom_envs.items():
        spec.validate(f"custom_envs.{tag}")
    managers = [("train_env_manager", config.train_env_manager), ("val_env_manager", config.val_env_manager)]
    for name, manager in managers:
        if manager is None:
            continue
        missing = [tag for tag in manager.tags if tag not in config.custom_envs]
        if missing:
            raise WorkerConfigError(
                f"{name}.tags names {missing}, which custom_envs does not define "
                f"(defined: {sorted(config.custom_envs)})."
            )
        _check_tools(config, name, manager)
    _validate_modes(config)
    if config.max_tokens_per_step is not None and config.max_tokens_per_step < 1:
        raise WorkerConfigError(f"max_tokens_per_step must be >= 1, got {config.max_tokens_per_step}.")
    for key in ("prompt_length", "response_length"):
        if getattr(config, key) is not None and getattr(config, key) < 1:
            raise WorkerConfigError(f"{key} must be >= 1, got {getattr(config, key)} (or leave it out).")
    episodes = config.base.rollout_batch_size
    slots = config.train_env_manager.num_envs
    if episodes % slots:
        raise WorkerConfigError(
            f"rollout_batch_size ({episodes}) must be a multiple of train_env_manager.num_env_groups x group_size "
            f"({slots}): every environment runs the same number of episodes per step."
        )
    val = config.val_env_manager
    if val is not None and config.base.val_batch_size is not None and config.base.val_batch_size % val.num_envs:
        raise WorkerConfigError(
            f"val_batch_size ({config.base.val_batch_size}) must be a multiple of val_env_manager.num_env_groups x "
            f"group_size ({val.num_envs}), or null (one episode per validation environment)."
        )
    per_env, limit = episodes // slots, config.train_env_manager.max_traj_per_env
    if limit != -1 and per_env > limit:
        raise WorkerConfigError(
            f"rollout_batch_size ({episodes}) needs {per_env} episodes per environment, above "
            f"train_env_manager.max_traj_per_env ({limit}); add env groups or raise the limit."
        )


def _check_tools(config: AgenticConfig, name: str, manager: EnvManagerConfig) -> None:
    """The tool wrappers of the tags a manager runs: their keys, and a manager that builds tool turns (one sample
    per episode, text observations)."""
    from apps.agentic.envs.tools import parse_tool_wrapper

    for tag in manager.tags:
        spec = config.custom_envs[tag]
        if spec.tool_wrapper is None:
            continue
        where = f"custom_envs.{tag}.tool_wrapper"
        parse_tool_wrapper(spec.tool_wrapper, where)
        if spec.mode != "trajectory" or spec.visual:
            raise WorkerConfigError(
                f"{where}: tool calls are built for TrajEnvManager (one sample per episode, the tool's result a "
                f"message of the conversation); {name} runs {tag} under {spec.env_manager_cls}. Use TrajEnvManager "
                "or a tag without tool_wrapper."
            )


def _validate_modes(config: AgenticConfig) -> None:
    """One sample layout per manager; the step-level estimators and knobs only with step samples."""
    from rl_core.step_rewards import STEP_ESTIMATORS

    for name in ("train_env_manager", "val_env_manager"):
        manager = getattr(config, name)
        if manager is None:
            continue
        modes = {tag: config.custom_envs[tag].mode for tag in manager.tags}
        if len(set(modes.values())) > 1:
            raise WorkerConfigError(
                f"{name}.tags mix env managers ({modes}): one manager's samples are either whole episodes "
                "(TrajEnvManager) or single turns (StepEnvManager, AgentNativeStepEnvManager); give its tags the "
                "same custom_envs.<tag>.env_manager_cls."
            )
    estimator, mode = config.base.adv_estimator, config.mode(config.train_env_manager)
    if estimator in STEP_ESTIMATORS and mode == "trajectory":
        raise WorkerConfigError(
            f"adv_estimator: {estimator} needs step samples: set custom_envs.<tag>.env_manager_cls to "
            "roll.pipeline.agentic.env_manager.step_env_manager.StepEnvManager for the train_env_manager tags "
            f"{config.train_env_manager.tags}, or use grpo / reinforce with whole episodes."
        )
    if config.batch_adjust_mode not in BATCH_ADJUST_MODES:
        raise WorkerConfigError(
            f"batch_adjust_mode={config.batch_adjust_mode!r}; valid values: {list(BATCH_ADJUST_MODES)}."
        )
    if not 0.0 <= config.step_reward_gamma <= 1.0:
        raise WorkerConfigError(f"step_reward_gamma must be in [0, 1], got {config.step_reward_gamma}.")
    from apps.common.policy_args import policy_loss_name

    try:
        policy_loss_name(config.base, config.ratio_type)
    except ValueError as err:
        raise WorkerConfigError(str(err)) from None

"""The agentic config's per-environment sections: ``custom_envs.<tag>`` (:class:`EnvSpec`: the environment, its
templates and env manager class) and ``train_env_manager`` / ``val_env_manager`` (:class:`EnvManagerConfig`: which
environments run, grouped how), with ROLL's default templates and the env manager classes built here.
:mod:`apps.agentic.config` composes them into the whole config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl_engines.config import GeneratingArgs, WorkerConfigError, build_dataclass

DEFAULT_SYSTEM_TEMPLATE = (
    "You're a helpful assistant. You are a good game player. You are aiming to get high reward in the game."
)
DEFAULT_AGENT_TEMPLATE = (
    "Turn {turn_idx}:\nObservation:\n{observation}\nStrictly follow this format:\n"
    "1. output format is '<answer> [your answer] </answer>' with no extra text.\n2. You have {actions_left} actions "
    "left.\n3. Max response length: {max_response_length} words (tokens).\nDecide the next action:\n"
)
TEMPLATE_FIELDS = ("turn_idx", "observation", "actions_left", "max_response_length", "suffix")

# ROLL's env manager classes (custom_env.env_manager_cls, train_env_manager.worker_cls) by their last component ->
# the sample layout ours runs: "trajectory" (one multi-turn conversation per episode, one sample), "step" (each turn
# its own sample, its prompt rebuilt from agent_template with a window of earlier turns) or "native" (each turn its
# own sample, its prompt the conversation the environment keeps).
ENV_MANAGER_CLASSES = {"TrajEnvManager": "trajectory", "EnvManager": "trajectory", "AgenticEnvManager": "trajectory",
                       "EnvironmentWorker": "trajectory", "VLTrajEnvManager": "trajectory", "StepEnvManager": "step",
                       "AgentNativeStepEnvManager": "native", "StepConcatEnvManager": "concat"}  # fmt: skip
# ROLL managers not built here -> what to use instead.
UNBUILT_ENV_MANAGERS = {
    "ProxyEnvManager": "LLM-proxy environments are not built",
}
VISION_MANAGER = "VLTrajEnvManager"
"""ROLL's vision-language trajectory manager: each turn's user message is pre_step_template, the observation (a
picture with ``render_mode: rgb_array``) and next_step_template (:mod:`apps.agentic.vision`)."""
MODES = ("trajectory", "step", "native", "concat")
"""native (AgentNativeStepEnvManager): step samples whose prompt is the conversation the environment keeps; concat
(StepConcatEnvManager, GEM's observation-concatenating wrapper): step samples whose prompt shows the earlier
observations and the current one with the environment's suffix."""
STEP_TEMPLATE_FIELDS = (*TEMPLATE_FIELDS, "env_instruction", "step_count", "history_length", "history",
                        "current_step", "current_observation")  # fmt: skip
CONCAT_TEMPLATE_FIELDS = ("history", "current_observation")
"""The fields ROLL's StepConcatEnvManager fills (it formats agent_template with these two only)."""


@dataclass
class EnvManagerConfig:
    """``train_env_manager`` / ``val_env_manager``: which environments run, grouped how."""

    num_env_groups: int = 1
    """Environment groups (ROLL guide: env_groups). Episodes of one group share env config and seed."""
    group_size: int = 1
    """Environments per group."""
    tags: list[str] = field(default_factory=list)
    """custom_envs tags to run (e.g. [SimpleSokoban, FrozenLake])."""
    num_groups_partition: list[int] | None = None
    """Groups per tag (ROLL guide: n_groups); null = the groups divided equally over the tags."""
    max_env_num_per_worker: int = 0
    """Environments stepped by one env-manager worker (0 = all in one)."""
    max_traj_per_env: int = -1
    """Episodes one environment may run in a step (-1 = no limit)."""
    format_penalty: float | None = None
    """ROLL declares it and reads it nowhere: each environment's ``env_config.format_penalty`` is the reward of a
    malformed action (ROLL's files set both). Accepted, changing nothing, with a pre-flight note."""
    worker_cls: str | None = None
    """ROLL's env worker class (EnvironmentWorker; trajectory manager names are accepted too)."""
    generating_args: GeneratingArgs | None = None
    """Sampling of this manager's episodes (ROLL). train_env_manager's become actor_infer's; val_env_manager's
    sample validation (null: actor_infer's, as ROLL gives both managers actor_infer's). Not together with
    actor_infer.generating_args, which ROLL lets override both."""

    @classmethod
    def from_dict(cls, values: Any, key: str) -> EnvManagerConfig:
        """Accept the guide's spellings ``env_groups`` / ``n_groups`` as well as the example files'."""
        values = dict(values or {})
        for alias, name in (("env_groups", "num_env_groups"), ("n_groups", "num_groups_partition")):
            if alias in values:
                if name in values and values[name] != values[alias]:
                    raise WorkerConfigError(f"{key}.{alias} and {key}.{name} are the same setting; keep one.")
                values[name] = values.pop(alias)
        config = build_dataclass(cls, values, key)
        config.validate(key)
        return config

    def validate(self, key: str) -> None:
        """Ranges and the partition's arithmetic, naming ``key``."""
        for name in ("num_env_groups", "group_size"):
            if getattr(self, name) < 1:
                raise WorkerConfigError(f"{key}.{name} must be >= 1, got {getattr(self, name)}.")
        if not self.tags:
            raise WorkerConfigError(f"{key}.tags is empty; list the custom_envs tags to run, e.g. [FrozenLake].")
        if self.num_groups_partition is not None:
            if len(self.num_groups_partition) != len(self.tags):
                raise WorkerConfigError(
                    f"{key}.num_groups_partition has {len(self.num_groups_partition)} entries for "
                    f"{len(self.tags)} tags {self.tags}; give one group count per tag."
                )
            if sum(self.num_groups_partition) != self.num_env_groups:
                raise WorkerConfigError(
                    f"{key}.num_groups_partition {self.num_groups_partition} sums to "
                    f"{sum(self.num_groups_partition)}, not num_env_groups={self.num_env_groups}."
                )
        if self.max_env_num_per_worker < 0 or self.max_traj_per_env == 0 or self.max_traj_per_env < -1:
            raise WorkerConfigError(
                f"{key}: max_env_num_per_worker must be >= 0 and max_traj_per_env >= 1 or -1, got "
                f"{self.max_env_num_per_worker} and {self.max_traj_per_env}."
            )
        if self.worker_cls is not None and check_env_manager_cls(self.worker_cls, f"{key}.worker_cls") != "trajectory":
            raise WorkerConfigError(
                f"{key}.worker_cls={self.worker_cls!r}: worker_cls is ROLL's env worker (EnvironmentWorker); choose "
                "step samples per tag with custom_envs.<tag>.env_manager_cls."
            )
        if self.generating_args is not None:
            self.generating_args.validate(f"{key}.generating_args")
            if self.generating_args.num_return_sequences != 1:
                raise WorkerConfigError(
                    f"{key}.generating_args.num_return_sequences is {self.generating_args.num_return_sequences}; "
                    "an episode samples one response per turn: set it to 1 (group_size sets the group)."
                )

    def rounds(self, episodes: int | None) -> int:
        """Episodes each environment runs for ``episodes`` in all (None: one each)."""
        return 1 if episodes is None else episodes // self.num_envs

    def partition(self) -> list[int]:
        """Groups per tag: the explicit partition, or num_env_groups divided as equally as possible."""
        if self.num_groups_partition is not None:
            return list(self.num_groups_partition)
        share, extra = divmod(self.num_env_groups, len(self.tags))
        return [share + (1 if i < extra else 0) for i in range(len(self.tags))]

    @property
    def num_envs(self) -> int:
        """Environments run at once: groups x group size."""
        return self.num_env_groups * self.group_size


def check_env_manager_cls(path: str, key: str) -> str:
    """The mode of a ROLL env-manager class path (named by its last component), or an error naming the key."""
    name = path.rsplit(".", 1)[-1]
    if name in UNBUILT_ENV_MANAGERS:
        raise WorkerConfigError(f"{key}={path!r}: {UNBUILT_ENV_MANAGERS[name]}.")
    if name not in ENV_MANAGER_CLASSES:
        raise WorkerConfigError(
            f"{key}={path!r} is not an env manager this pipeline has; use one of {list(ENV_MANAGER_CLASSES)} "
            "(e.g. roll.pipeline.agentic.env_manager.traj_env_manager.TrajEnvManager) or remove the key."
        )
    return ENV_MANAGER_CLASSES[name]


@dataclass
class EnvSpec:
    """``custom_envs.<tag>``: one environment type with its settings (ROLL's custom_env entries)."""

    env_type: str = ""
    """Registered environment type (apps.agentic.envs.ENV_TYPES: sokoban, frozen_lake, or your own)."""
    max_steps: int = 10
    """Turns per episode at most."""
    max_tokens_per_step: int = 128
    """Tokens the model may generate per turn."""
    env_manager_cls: str | None = None
    """ROLL env-manager class path: TrajEnvManager (default: one sample per episode), StepEnvManager (one sample
    per turn, the prompt rebuilt each turn with a window of earlier turns) or AgentNativeStepEnvManager (one sample
    per turn, the prompt the conversation the environment keeps)."""
    history_length: int | None = None
    """StepEnvManager: turns in a prompt's window, the current one included (ROLL: the last history_length - 1
    earlier turns are shown); null = none."""
    agent_runner_cls: str | None = None
    """ROLL agent runner (must be null: the env manager runs the conversation)."""
    use_thread_lock: bool = True
    """ROLL: serialise env steps of this type (environments here are stepped by one thread per worker)."""
    agent_system_template: str | None = DEFAULT_SYSTEM_TEMPLATE
    """System message of every episode; null: none (the tokenizer's chat template decides, e.g. Qwen2.5's default)."""
    agent_template: str = DEFAULT_AGENT_TEMPLATE
    """User message of every turn; fields {turn_idx}, {observation}, {actions_left}, {max_response_length}, {suffix}
    (the environment's prompt for the next move: GEM's info["suffix"], else empty); with StepEnvManager also
    {env_instruction}, {step_count}, {history_length}, {history}, {current_step}, {current_observation}; with
    StepConcatEnvManager only {history} (the earlier observations, one per line) and {current_observation} (the
    observation, a newline and the suffix)."""
    env_config: dict[str, Any] = field(default_factory=dict)
    """Keys of the environment's own config (dim_room, is_slippery, action_pattern, format_penalty, ...)."""
    max_env_step_concurrent: int | None = None
    """ROLL: concurrent env steps of this type (accepted; steps here are cheap and local)."""
    tool_wrapper: dict[str, Any] | None = None
    """ROLL / GEM tool use around the environment: ``wrapper_args`` (tool_reward, tool_success_reward,
    max_tool_uses) and ``tool_configs`` (``[{tool_id: python_code, tool_args: {...}}]``); see
    apps.agentic.envs.tools. Checked for the tags a manager runs (TrajEnvManager only)."""
    pre_step_template: str | None = None
    """VLTrajEnvManager: the text before each turn's observation; field {turn_idx} (the first turn's also starts
    with the environment's instructions)."""
    next_step_template: str | None = None
    """VLTrajEnvManager: the text after each turn's observation; fields {actions_left}, {max_response_length}."""

    def validate(self, key: str) -> None:
        """Env type registered, templates formattable, lengths positive."""
        from apps.agentic.envs import ENV_TYPES
        from apps.agentic.envs.gem_env import check_gem_env, is_gem_id

        if self.env_type not in ENV_TYPES and is_gem_id(self.env_type):
            try:
                check_gem_env(self.env_type)
            except ValueError as err:
                raise WorkerConfigError(f"{key}.{err}") from None
        elif self.env_type not in ENV_TYPES:
            raise WorkerConfigError(
                f"{key}.env_type={self.env_type!r} is not a registered environment; registered: {ENV_TYPES.names()}. "
                "Register your own class with @apps.agentic.envs.ENV_TYPES.register('<name>')."
            )
        if self.max_steps < 1 or self.max_tokens_per_step < 1:
            raise WorkerConfigError(f"{key}.max_steps and {key}.max_tokens_per_step must be >= 1.")
        if self.agent_runner_cls is not None:
            raise WorkerConfigError(
                f"{key}.agent_runner_cls={self.agent_runner_cls!r}: agent runners are not supported (the env "
                "manager runs the conversation); set it to null."
            )
        if self.env_manager_cls is not None:
            check_env_manager_cls(self.env_manager_cls, f"{key}.env_manager_cls")
        if self.history_length is not None and self.history_length < 1:
            raise WorkerConfigError(f"{key}.history_length must be >= 1 or null, got {self.history_length}.")
        if self.mode == "native":
            self._check_native(key)
            return  # the environment writes the conversation: agent_template is not used (ROLL: a placeholder)
        self._check_pictures(key)
        if self.visual:
            return  # the turns are pre_step_template, the observation, next_step_template
        fields = {"step": STEP_TEMPLATE_FIELDS, "concat": CONCAT_TEMPLATE_FIELDS}.get(self.mode, TEMPLATE_FIELDS)
        try:
            self.agent_template.format(**dict.fromkeys(fields, 0))
        except (KeyError, IndexError, ValueError) as err:
            raise WorkerConfigError(
                f"{key}.agent_template cannot be formatted ({err!r}); with {self.mode} samples it may use "
                f"{{{'}, {'.join(fields)}}} and must double literal braces."
            ) from None

    def _check_pictures(self, key: str) -> None:
        """VLTrajEnvManager's templates format; pictures (``render_mode: rgb_array``) only with it."""
        pictures = self.env_config.get("render_mode") == "rgb_array"
        if pictures and not self.visual:
            raise WorkerConfigError(
                f"{key}.env_config.render_mode=rgb_array makes the observations pictures, which only the "
                "vision-language env manager shows the model: set env_manager_cls to roll.pipeline.agentic."
                "env_manager.vl_traj_env_manager.VLTrajEnvManager, or render_mode: text."
            )
        if not self.visual:
            return
        for name, fields in (("pre_step_template", ("turn_idx",)),
                             ("next_step_template", ("actions_left", "max_response_length"))):  # fmt: skip
            template = getattr(self, name)
            if template is None:
                raise WorkerConfigError(f"{key}.{name} is not set; VLTrajEnvManager builds every turn from it.")
            try:
                template.format(**dict.fromkeys(fields, 0))
            except (KeyError, IndexError, ValueError) as err:
                raise WorkerConfigError(
                    f"{key}.{name} cannot be formatted ({err!r}); it may use {{{'}, {'.join(fields)}}} and must "
                    "double literal braces."
                ) from None

    @property
    def visual(self) -> bool:
        """Episodes run by the vision-language env manager (VLTrajEnvManager)."""
        return self.env_manager_cls is not None and self.env_manager_cls.rsplit(".", 1)[-1] == VISION_MANAGER

    def _check_native(self, key: str) -> None:
        from apps.agentic.envs.base import resolve_env_class

        if not getattr(resolve_env_class(self.env_type), "keeps_conversation", False):
            raise WorkerConfigError(
                f"{key}: env_manager_cls AgentNativeStepEnvManager needs an environment that keeps its own "
                f"conversation (e.g. env_type: sokoban_native_env); {self.env_type!r} does not. Use StepEnvManager."
            )

    @property
    def mode(self) -> str:
        """``trajectory`` or ``step``: the sample layout of this environment's episodes (env_manager_cls)."""
        if self.env_manager_cls is None:
            return "trajectory"
        return ENV_MANAGER_CLASSES.get(self.env_manager_cls.rsplit(".", 1)[-1], "trajectory")

"""The RLVR pipeline's configuration: ROLL's top-level keys as one typed dataclass, ``RLVRConfig``, which extends
``apps.common.config.SharedConfig`` (the keys the agentic pipeline reads too: experiment, cluster, schedule,
algorithm, worker sections as ``rl_engines.config.WorkerConfig``, rollout_mock) with the RLVR-only keys: prompt and
response lengths, dynamic sampling, sample masks, and the rewards and validation sections.

``RLVRConfig.from_dict(mapping)`` (the output of ``apps.common.yaml_config.load_config``) rejects unknown keys and bad
values naming the key path; ``validate_rlvr`` checks ranges and every choice against the rl-core registry that
implements it. Cross-section checks that need the cluster (device mappings, batch divisibility) live in
``apps.rlvr.preflight``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from apps.common.config import (
    ROLL_PROMPT_LENGTH,
    SharedConfig,
    pop_shared_sections,
    pop_unread_roll_keys,
    sampling_default_notes,
    validate_shared,
)
from rl_engines.config import GeneratingArgs, WorkerConfig, WorkerConfigError, build_dataclass


@dataclass
class RewardSpec:
    """The reward-specific keys of one ``rewards.<name>`` section; the rest of it is a WorkerConfig."""

    worker_cls: str | None = None
    """ROLL reward worker class path; its last component picks the registered reward (e.g. MathRuleRewardWorker)."""
    reward_type: str | None = None
    """Reward flavour passed to the reward function (CrossThinkQA: ``loose`` / ``soft`` / ``strict``)."""
    tag_included: list[str] = field(default_factory=list)
    """Data tags this reward scores; samples are routed by their ``tag`` column."""
    response_length_penalty_coef: float = 0.0
    """Penalty per response token subtracted from the reward (not from the score)."""
    use_local: bool = True
    """Code sandbox: grade in local sandboxed processes (ROLL's remote HTTP sandbox, ``false``, is not built)."""
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
    eval_steps: int | None = None
    """Found in ROLL's files but read nowhere by ROLL (the top-level eval_steps schedules validation): accepted
    when it equals eval_steps, refused otherwise."""


UNREAD_RLVR_KEYS = {
    "val_greedy": (False, "ROLL's RLVRConfig declares it and reads it nowhere; validation decodes greedily with "
                          "validation.generating_args.temperature: 0"),
    "val_n_sample": (1, "ROLL's RLVRConfig declares it and reads it nowhere; responses per validation prompt are "
                        "validation.generating_args.num_return_sequences"),
    "dataset_filter": ({}, "ROLL's RLVRConfig declares it (source, min_difficulty, max_difficulty, num_samples) and "
                           "reads it nowhere; filter the data files themselves"),
    "balance_length": (False, "ROLL's RLVRConfig declares it and reads it nowhere"),
    "minibatch_data_iter_num": (1, "ROLL's RLVRConfig declares it and reads it nowhere; passes over each batch are "
                                   "ppo_epochs"),
}  # fmt: skip
"""RLVR keys of ROLL's config that no ROLL code reads: their defaults pass, another value is refused."""


@dataclass
class RLVRConfig(SharedConfig):
    """Every top-level key of a ROLL RLVR config: the shared ones (``SharedConfig``) and these RLVR-only ones (prompts
    and lengths, dynamic sampling, sample masks, rewards, validation). Defaults follow ROLL's where it documents one."""

    # ---- batch and lengths -----------------------------------------------------------------------------------
    global_template: str | None = None
    """Chat template of every prompt (training and validation), over ``actor_train.data_args.template``."""
    tag_to_template: dict[str, str] = field(default_factory=dict)
    """Chat template of the prompts whose ``tag`` column names it (training and validation, a text model's
    ``messages`` column), over ``global_template`` / ``actor_train.data_args.template`` (ROLL's RLVR
    encode_function; its VLM pipeline reads no such key, nor does a vision-language model's run here)."""
    prompt_length: int = ROLL_PROMPT_LENGTH
    """Longest prompt in tokens: as ROLL's ``preprocess_dataset``, a text model's training and validation prompts
    with more tokens, or with 5 or fewer, are dropped when the data is loaded (a log line says how many); a
    vision-language model's are kept and cut from the left."""
    response_length: int = 1024
    """Response tokens generated at most: actor_infer's and validation's ``generating_args.max_new_tokens`` are set
    to it, as ROLL sets them to ``sequence_length - prompt_length``; a ``sequence_length`` given beside it wins
    (ROLL discards ``response_length`` then), so it is ``sequence_length - prompt_length`` (pre-flight notes)."""
    val_prompt_length: int | None = None
    """ROLL's validation lengths, set together with ``val_sequence_length``: validation's
    ``generating_args.max_new_tokens`` is ``val_sequence_length - val_prompt_length`` (training's budget otherwise).
    Validation prompts are still kept or dropped by ``prompt_length``, as ROLL's RLVR pipeline does."""
    val_sequence_length: int | None = None
    """See ``val_prompt_length``."""
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
    # ---- sample masks and weights ----------------------------------------------------------------------------
    max_len_mask: bool = False
    """Drop responses cut at response_length from the loss."""
    error_max_len_clip: bool = False
    """Keep only correct (score 1) samples and wrong (score 0) ones shorter than error_max_len_threshold."""
    difficulty_mask: bool = False
    """Drop prompt groups whose mean score is not strictly between the two thresholds."""
    difficulty_loss_weight: bool = False
    """Weight samples by 0.5 + 1.5 x the data's ``difficulty`` column (in [0, 1])."""
    length_loss_weight: bool = False
    """Weight samples by 1.5 - their min-max normalised response length (longer weighs less)."""
    # ---- sections --------------------------------------------------------------------------------------------
    rewards: dict[str, RewardConfig] = field(default_factory=dict)
    """Reward workers by name."""
    validation: ValidationConfig | None = None
    """Validation data and sampling."""
    length_notes: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    """Derived at load, not a key: the pre-flight lines of ROLL's length rules applied (:func:`roll_lengths`)."""
    rollout_dump_dir: str | None = None
    """ROLL's rollout dump: each step's scored rollouts as ``rollout_dump_data.step_<N>.jsonl`` in this folder (one
    JSON object of columns: the data's id / prompt / messages / ground_truth / tag ... columns, the decoded responses,
    their scores and the sampling parameters; apps/rlvr/rollout_dump.py). An absolute path: ROLL writes only there;
    null or empty: no dump."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RLVRConfig:
        """Build and validate from a loaded config mapping; every error names the key path."""
        values = dict(values)
        pop_unread_roll_keys(values, UNREAD_RLVR_KEYS)
        given = _given_max_new_tokens(values)
        sampling = {
            f"{section}.generating_args": (values.get(section) or {}).get("generating_args") or {}
            for section in ("actor_infer", "validation")
            if section == "actor_infer" or values.get(section)
        }
        sections = pop_shared_sections(values)
        rewards = values.pop("rewards", None) or {}
        if not isinstance(rewards, dict):
            raise WorkerConfigError(f"rewards must be a mapping of reward name -> section, got {rewards!r}.")
        sections["rewards"] = {name: RewardConfig.from_dict(v, f"rewards.{name}") for name, v in rewards.items()}
        if values.get("validation") is not None:
            validation = build_dataclass(ValidationConfig, values.pop("validation"), "validation")
            validation.generating_args.validate("validation.generating_args")
            sections["validation"] = validation
        config = dataclasses.replace(build_dataclass(cls, values, ""), **sections)
        validate_rlvr(config)
        config = roll_lengths(config, given)
        config.sampling_notes = tuple(sampling_default_notes(sampling))
        return config


def _given_max_new_tokens(values: dict[str, Any]) -> dict[str, Any]:
    """``generating_args.max_new_tokens`` of actor_infer and validation as the file gives them (absent: None)."""
    out = {}
    for section in ("actor_infer", "validation"):
        generating = (values.get(section) or {}).get("generating_args") or {}
        out[section] = generating.get("max_new_tokens") if isinstance(generating, dict) else None
    return out


def _generating_at_most(section: Any, tokens: int) -> Any:
    """``section`` (a worker or the validation section) with ``generating_args.max_new_tokens`` = ``tokens``."""
    return dataclasses.replace(section, generating_args=dataclasses.replace(section.generating_args,
                                                                            max_new_tokens=tokens))  # fmt: skip


def roll_lengths(config: RLVRConfig, given: dict[str, Any]) -> RLVRConfig:
    """ROLL's length rules (its base config and RLVR config ``__post_init__``): a ``sequence_length`` wins over
    ``response_length`` (the budget is ``sequence_length - prompt_length``), and actor_infer's and validation's
    ``generating_args.max_new_tokens`` are that budget whatever the file says (ROLL rewrites them with a warning).
    ``given``: the file's max_new_tokens, for the pre-flight lines."""
    notes = []
    if config.sequence_length is not None:
        budget = config.sequence_length - config.prompt_length
        notes.append(f"[preflight] sequence_length ({config.sequence_length}) sets the response budget: "
                     f"response_length = sequence_length - prompt_length = {budget}, as in ROLL, which discards a "
                     "response_length given beside it.")  # fmt: skip
        config = dataclasses.replace(config, response_length=budget)
    budget = config.response_length
    config = dataclasses.replace(config, actor_infer=_generating_at_most(config.actor_infer, budget))
    budgets = {"actor_infer": (budget, "sequence_length - prompt_length")}
    if config.validation is not None:
        budgets["validation"] = budgets["actor_infer"]
        if config.val_sequence_length is not None and config.val_prompt_length is not None:
            budgets["validation"] = (config.val_sequence_length - config.val_prompt_length,
                                     "val_sequence_length - val_prompt_length")  # fmt: skip
        config = dataclasses.replace(config, validation=_generating_at_most(config.validation,
                                                                            budgets["validation"][0]))  # fmt: skip
    for section, value in given.items():
        if section not in budgets:
            continue
        tokens, rule = budgets[section]
        if value != tokens:
            said = "not given (128 by default)" if value is None else f"{value}"
            notes.append(f"[preflight] {section}.generating_args.max_new_tokens is {said}; it is {tokens} "
                         f"({rule}), as ROLL sets it whatever the file says.")  # fmt: skip
    config.length_notes = tuple(notes)
    return config


def validate_rlvr(config: RLVRConfig) -> None:
    """The shared keys' checks, then those of the RLVR-only keys; raises WorkerConfigError naming the key."""
    from apps.rlvr.config_checks import check_rlvr_ranges

    validate_shared(config)
    check_rlvr_ranges(config)

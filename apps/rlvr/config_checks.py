"""Single-key checks of the RLVR-only keys of an ``RLVRConfig`` (the shared keys' checks are in
``apps.common.config_checks``)."""

from __future__ import annotations

from typing import Any

from apps.common.config_checks import check_minimum, fail
from apps.rlvr.data import KNOWN_TEMPLATES
from apps.rlvr.reward_stage import ROLL_REWARD_NORMS
from rl_core.step_rewards import STEP_ESTIMATORS

# key -> smallest allowed value
MINIMUM = {
    "num_return_sequences_in_group": 1, "prompt_length": 1, "response_length": 1, "max_running_requests": 1,
    "max_additional_running_prompts": 0,
}  # fmt: skip


def check_rlvr_ranges(config: Any) -> None:
    """Numeric bounds of the RLVR-only keys, with the key and the allowed range in the message."""
    check_minimum(config, MINIMUM)
    if config.adv_estimator in STEP_ESTIMATORS:
        fail(
            f"adv_estimator: {config.adv_estimator} rewards single turns of agentic episodes (the agentic pipeline "
            "with StepEnvManager); RLVR responses are one turn each: use grpo, reinforce, rloo, ..."
        )
    check_reward_norm(config)
    if config.sequence_length is not None and config.sequence_length <= config.prompt_length:
        fail(
            f"sequence_length ({config.sequence_length}) must exceed prompt_length ({config.prompt_length}): ROLL "
            "generates sequence_length - prompt_length tokens at most. Raise it, or remove it and set response_length."
        )
    if config.rollout_dump_dir and not config.rollout_dump_dir.startswith("/"):
        fail(
            f"rollout_dump_dir={config.rollout_dump_dir!r} is not an absolute path: ROLL writes its rollout dumps "
            "only to an absolute one (it skips any other); give an absolute path, or remove the key."
        )
    if config.global_template is not None and config.global_template not in KNOWN_TEMPLATES:
        fail(
            f"global_template={config.global_template!r} is not supported; use one of {list(KNOWN_TEMPLATES)} (each "
            "applies the tokenizer's own chat template)."
        )
    if (config.val_prompt_length is None) != (config.val_sequence_length is None):
        fail(
            f"val_prompt_length ({config.val_prompt_length}) and val_sequence_length ({config.val_sequence_length}) "
            "are set together, as ROLL asserts; give both (validation generates val_sequence_length - "
            "val_prompt_length tokens at most) or neither."
        )
    lengths = (config.val_prompt_length, config.val_sequence_length)
    if lengths[0] is not None and lengths[1] is not None and not 0 < lengths[0] < lengths[1]:
        fail(
            f"val_sequence_length ({lengths[1]}) must exceed val_prompt_length ({lengths[0]}) > 0: validation "
            "generates their difference at most."
        )
    if not isinstance(config.tag_to_template, dict):
        fail(f"tag_to_template must map a data tag to a template name, got {config.tag_to_template!r}.")
    for tag, template in config.tag_to_template.items():
        if template not in KNOWN_TEMPLATES:
            fail(f"tag_to_template.{tag}={template!r} is not supported; use one of {list(KNOWN_TEMPLATES)}.")
    validation = config.validation
    if validation is not None and validation.eval_steps is not None and validation.eval_steps != config.eval_steps:
        fail(
            f"validation.eval_steps ({validation.eval_steps}) differs from eval_steps ({config.eval_steps}): ROLL "
            "validates every top-level eval_steps and reads validation.eval_steps nowhere; set eval_steps and drop "
            "validation.eval_steps."
        )
    if config.generate_opt_level not in (0, 1):
        fail(
            f"generate_opt_level must be 0 (batch generate) or 1 (request scheduler), got {config.generate_opt_level}."
        )


def check_reward_norm(config: Any) -> None:
    """ROLL's ``norm_mean_type`` / ``norm_std_type`` (what RLVR normalises rewards by) against this project's
    ``reward_norm`` / ``reward_shift`` / ``reward_scale`` (the older guide's spelling) and ``adv_estimator``."""
    pair = (config.norm_mean_type, config.norm_std_type)
    # reward_norm none / None is rl-core's identity (ROLL's RAFT++ guide example sets it beside grpo): nothing replaced
    ours = config.reward_norm not in (None, "none", "None") or config.reward_shift or config.reward_scale
    if config.adv_estimator != "grpo" and pair != (None, None) and pair not in ROLL_REWARD_NORMS:  # grpo: replaced
        fail(
            f"norm_mean_type={pair[0]!r} with norm_std_type={pair[1]!r} is not built: ROLL's reward_norm broadcasts "
            "a group std over the flat batch unless the mean is the group's too (its result has the wrong shape), "
            "and a group mean with the batch std is not built here; use batch / batch, group / group, a mean alone "
            "(norm_std_type: null), or norm_mean_type: null with norm_std_type: batch."
        )
    if config.adv_estimator == "grpo" and ours:
        fail(
            f"reward_norm={config.reward_norm!r} / reward_shift / reward_scale with adv_estimator: grpo: grpo "
            "normalises each prompt group's rewards itself (ROLL forces norm_mean_type / norm_std_type to group), so "
            "they would be replaced; remove them, or use adv_estimator: reinforce with a reward normalisation."
        )
    if pair != (None, None) and ours:
        fail(
            "norm_mean_type / norm_std_type (ROLL's keys) and reward_norm / reward_shift / reward_scale (the older "
            "spelling) both set a reward normalisation; keep one."
        )

"""Single-key checks of the RLVR-only keys of an ``RLVRConfig`` (the shared keys' checks are in
``apps.common.config_checks``)."""

from __future__ import annotations

from typing import Any

from apps.common.config_checks import check_minimum, fail
from apps.rlvr.data import KNOWN_TEMPLATES
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
    if config.sequence_length is not None and config.sequence_length < config.prompt_length + config.response_length:
        fail(
            f"sequence_length ({config.sequence_length}) must be >= prompt_length + response_length "
            f"({config.prompt_length} + {config.response_length}); raise it or shorten the lengths."
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

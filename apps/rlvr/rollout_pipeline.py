"""``python -m apps.rlvr.rollout_pipeline --config_path DIR --config_name NAME [key=value ...]``: one scored pass
over the validation set, nothing trained (ROLL's RLVRRolloutPipeline, ``examples/start_rlvr_rollout_pipeline.py``,
which ROLL runs with a training file such as ``rlvr_config_8gpus.yaml``).

actor_infer (the weights of ``pretrain`` / ``actor_infer.model_args``; to evaluate a trained checkpoint, point
``pretrain`` at its ``actor_hf`` folder) generates for every ``validation.data_args`` prompt with
``validation.generating_args``, ``val_batch_size`` prompts a call (all at once by default, as ROLL), and the
``rewards`` sections grade the responses, exactly as training's validation does (:mod:`apps.rlvr.validation`).
Logged once, as step 0: ROLL's ``val_correct/all/mean`` and ``val_correct/<tag>/mean`` (fraction of score-1
answers), ``val/score/mean`` and ``val/score/<reward section>``, ``time/step_generate``; and the first ten prompts
with their responses as one JSON log line, as ROLL; metrics.jsonl and the tracker as in training, under
``<output_dir>/rollout_pipeline`` (:data:`OUTPUTS`). Only actor_infer and the reward roles start; ``max_steps`` and
the training sections are not read, except ``actor_train.data_args``' template and prompt columns, which encode
a text model's validation prompts as in training. ``rollout_mock`` dumps or replays the validation rollout (split
``val``) as in training.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from apps.common.loop import cli_main, run_loop
from apps.common.model_hub import resolve_config_models
from apps.common.preflight import replays_rollouts
from apps.common.profiler import worker_envs
from apps.common.timeline import Timeline
from apps.common.training import start_pipeline_ray, stop_pipeline_roles
from apps.rlvr.config import RLVRConfig
from apps.rlvr.preflight import rollout_preflight
from apps.rlvr.rewards import RewardRouter
from apps.rlvr.rollout import PromptSource
from apps.rlvr.validation import Validator
from apps.rlvr.video_data import VideoOptions
from apps.rlvr.vl_data import image_processor, model_type
from rl_core.batch import RolloutBatch
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_replay import RolloutReplay

SHOWN = ("val_correct/all/mean", "val/score/mean", "time/step_generate")
OUTPUTS = "rollout_pipeline"
"""Its metrics.jsonl and timeline go to ``<output_dir>/rollout_pipeline`` and its tracker run is
``<exp_name>_rollout_pipeline``: the training run's files in output_dir stay as they are."""
EXAMPLES = 10
"""Prompts of the JSON log line (ROLL logs ten)."""


class RLVRRolloutPipeline:
    """Scores the validation set once; pre-flight runs first (a bad config fails before Ray starts)."""

    def __init__(self, config: RLVRConfig, log: Callable[[str], None] = print, progress_bar: bool | None = None):
        self.config, self.log, self.progress_bar = config, log, progress_bar
        resolve_config_models(
            config, log, [(f"rewards.{name}", reward.worker) for name, reward in config.rewards.items()]
        )
        self.report = rollout_preflight(config)
        for note in self.report.notes:
            log(note)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(config.actor_infer.model_args.model_name_or_path))
        data_args = config.actor_train.data_args  # a text model's validation prompts are encoded with these
        self.prompt_key, self.messages_key = data_args.get("prompt"), data_args.get("messages")
        template = str(config.global_template or data_args.get("template", "native"))
        no_records = PromptSource([], self.tokenizer, template, self.prompt_key, self.messages_key,
                                  config.prompt_length, image_processor(config), model_type(config),
                                  VideoOptions.from_data_args(data_args), dict(config.tag_to_template))  # fmt: skip
        self.router = RewardRouter(config.rewards)
        replay = RolloutReplay.from_config(config.rollout_mock)
        self.validator = Validator.from_config(config, no_records, self.router, replay, log)
        self.roles: Roles | None = None
        self._started_ray = False
        self.timeline = Timeline()

    def start(self) -> None:
        """Start Ray (CPU device slots when there is no GPU), actor_infer, the LLM judges and the reward workers
        (none of them when a replay gives the scored rollout)."""
        cluster = ClusterSpec(self.config.num_nodes, self.config.num_gpus_per_node)
        self._started_ray = start_pipeline_ray(cluster)
        replaying = replays_rollouts(self.config)
        sections = {} if replaying else {"actor_infer": self.config.actor_infer, **self.router.role_sections()}
        envs = worker_envs(self.config, self.log)
        self.roles = Roles(cluster, sections, rpc_timeout=self.config.rpc_timeout, system_envs=envs)
        if not replaying:
            self.router.start(self.roles, self.config.rpc_timeout, envs, self.prompt_key, self.messages_key)

    def stop(self) -> None:
        """Stop every worker, and Ray when start() started it."""
        self.router.shutdown()
        stop_pipeline_roles(self.roles, self._started_ray)
        self.roles = None

    def run(self) -> list[dict[str, float]]:
        """The one pass (step 0); returns its metrics in a list, as the training pipeline returns its steps'."""
        return run_loop(self, self.config, "rlvr rollout", SHOWN, curves=(), steps=1, subdir=OUTPUTS)

    def validates_at(self, step: int) -> bool:
        """Never apart from the step itself, which is the validation pass."""
        return False

    def validate(self, step: int) -> dict[str, float]:
        return {}

    def step(self, step: int) -> dict[str, float]:
        """Generate for and grade every validation prompt; returns the metrics."""
        assert self.roles is not None, "call start() first"
        timings: dict[str, float] = {}
        with self.timeline.timer(timings, step)("step_generate"):
            rollout = self.validator.get_rollout(roles=self.roles, step=step)
        self.log(json.dumps(examples(rollout, self.tokenizer), ensure_ascii=False))
        return {**self.validator.metrics(rollout), **timings}


def examples(rollout: RolloutBatch, tokenizer: Any) -> list[dict[str, str]]:
    """The first :data:`EXAMPLES` samples' prompt and response text (special tokens dropped), as ROLL logs them."""
    rows = range(min(EXAMPLES, len(rollout)))
    prompts, responses = rollout.batch["prompts"], rollout.batch["responses"]
    width = prompts.shape[1]
    kept = rollout.batch["attention_mask"].bool()
    return [{"prompt": tokenizer.decode(prompts[row][kept[row, :width]], skip_special_tokens=True),
             "response": tokenizer.decode(responses[row][kept[row, width:]], skip_special_tokens=True)}
            for row in rows]  # fmt: skip


def build(mapping: dict[str, Any]) -> RLVRRolloutPipeline:
    """The pipeline of a loaded config mapping (pre-flight runs here: errors exit 2)."""
    return RLVRRolloutPipeline(RLVRConfig.from_dict(mapping))


def main(argv: Sequence[str] | None = None) -> int:
    """Load, validate, run; a config error exits 2 with its message (no traceback)."""
    return cli_main(argv, "python -m apps.rlvr.rollout_pipeline", "Score the validation set (no training).", build)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m apps.agentic.rollout_pipeline --config_path DIR --config_name NAME [key=value ...]``: episodes only,
nothing trains (ROLL's AgenticRolloutPipeline, ``examples/start_agentic_rollout_pipeline.py``).

Each of ``max_steps`` steps samples ``rollout_batch_size`` episodes of the ``train_env_manager`` environments with
actor_infer (the weights of ``pretrain`` / ``actor_infer.model_args``, its ``generating_args``; to evaluate a trained
checkpoint, point ``pretrain`` at its ``actor_hf`` folder) and logs ROLL's metrics of them: ``val/score/mean|max|min``
over the episodes' scores (one per episode, also of step samples), the same per tag ``val/<tag>/score/...``, the
environments' metrics under ``val/`` (success rate, turns, valid actions, truncation), ``time/step_rollout`` and
``system/samples`` (episodes so far); every ``logging_steps`` steps the first ten episodes (prompt, response,
episode_score) as one JSON log line, as ROLL. Metrics go to metrics.jsonl and the trackers as in training, under
``<output_dir>/rollout_pipeline`` (:data:`OUTPUTS`). Only actor_infer starts: the training sections and keys are not
read (a pre-flight note says so), nothing is saved, and ``resume_from_checkpoint`` is refused. ``rollout_mock``
dumps or replays the episodes as in training (ROLL's rollout scheduler does the same).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager
from apps.agentic.pipeline import build_runner
from apps.agentic.preflight import rollout_preflight
from apps.agentic.rollout import episode_metrics, episode_rows
from apps.common.loop import cli_main, run_loop
from apps.common.model_hub import resolve_config_models
from apps.common.preflight import replays_rollouts
from apps.common.profiler import worker_envs
from apps.common.timeline import Timeline
from apps.common.training import start_pipeline_ray, stop_pipeline_roles
from rl_core.batch import RolloutBatch
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_replay import RolloutReplay

SHOWN = ("val/score/mean", "val/success_rate", "val/num_turns/mean", "time/step_rollout")
OUTPUTS = "rollout_pipeline"
"""Its metrics.jsonl, curves and timeline go to ``<output_dir>/rollout_pipeline`` and its tracker run is
``<exp_name>_rollout_pipeline``: a training run's files in output_dir stay as they are."""
EXAMPLES = 10
"""Episodes of the JSON log line every ``logging_steps`` (ROLL logs ten)."""


class AgenticRolloutPipeline:
    """Samples ``config.base.max_steps`` batches of episodes; pre-flight runs first (a bad config fails before Ray)."""

    def __init__(self, config: AgenticConfig, log: Callable[[str], None] = print, progress_bar: bool | None = None):
        self.config, self.base, self.log, self.progress_bar = config, config.base, log, progress_bar
        resolve_config_models(config.base, log)
        self.report = rollout_preflight(config)
        for note in self.report.notes:
            log(note)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.base.actor_infer.model_args.model_name_or_path))
        self.envs = EnvManager(config, config.train_env_manager, "train")
        self.rounds = config.train_env_manager.rounds(self.base.rollout_batch_size)
        self.runner = build_runner(config, config.train_env_manager, self.envs, self.tokenizer,
                                   self.base.actor_infer.generating_args, record_frames=False)  # fmt: skip
        self.replay = RolloutReplay.from_config(self.base.rollout_mock)
        self.get_rollout = self._rollout if self.replay is None else self.replay.wrap(self._rollout, step="step")
        if self.replay is not None and self.replay.mode == "mock":
            self.replay.check_max_steps(self.base.max_steps)
        self.roles: Roles | None = None
        self._started_ray = False
        self.timeline = Timeline()
        self.episodes = 0

    def start(self) -> None:
        """Start Ray (CPU device slots when there is no GPU) and actor_infer (none when a replay gives the
        episodes)."""
        cluster = ClusterSpec(self.base.num_nodes, self.base.num_gpus_per_node)
        self._started_ray = start_pipeline_ray(cluster)
        sections = {} if replays_rollouts(self.base) else {"actor_infer": self.base.actor_infer}
        self.roles = Roles(cluster, sections, rpc_timeout=self.base.rpc_timeout,
                           system_envs=worker_envs(self.base, self.log))  # fmt: skip
        self.log(f"[agentic rollout] environments: {self.envs.describe()}")

    def stop(self) -> None:
        """Stop actor_infer (and Ray when start() started it), close the environments."""
        stop_pipeline_roles(self.roles, self._started_ray)
        self.roles = None
        self.envs.close()

    def run(self) -> list[dict[str, float]]:
        """All steps; returns each step's metrics (also logged and appended to metrics.jsonl)."""
        curves = [("val/score/mean", "mean episode score"), ("val/success_rate", "success rate")]
        return run_loop(self, self.base, "agentic rollout", SHOWN, curves, subdir=OUTPUTS)

    def validates_at(self, step: int) -> bool:
        """Never: every step's episodes are what the run measures (ROLL logs them under ``val/``)."""
        return False

    def validate(self, step: int) -> dict[str, float]:
        return {}

    def _rollout(self, *, step: int) -> RolloutBatch:
        """The step's episodes as samples with ``scores`` (rollout_mock dumps or replays this layer)."""
        assert self.roles is not None, "call start() first"
        episodes = self.runner.run(self.roles["actor_infer"], step, self.rounds)
        return self.runner.to_batch(episodes)

    def step(self, step: int) -> dict[str, float]:
        """One batch of episodes; returns its metrics."""
        timings: dict[str, float] = {}
        with self.timeline.timer(timings, step)("step_rollout"):
            rollout = self.get_rollout(step=step)
        self.episodes += len(episode_rows(rollout))
        metrics = {**rollout_metrics(rollout), **timings, "system/samples": float(self.episodes)}
        if step % self.base.logging_steps == 0:
            self.log(json.dumps(examples(rollout, self.tokenizer), ensure_ascii=False))
        return metrics


def rollout_metrics(rollout: RolloutBatch) -> dict[str, float]:
    """ROLL's rollout-pipeline metrics of a batch: the environments' under ``val/`` and the episode scores' mean /
    max / min, overall and per tag."""
    metrics = episode_metrics(rollout, "val")
    rows = episode_rows(rollout)
    scores, tags = episode_scores(rollout, rows), np.asarray([rollout.non_tensor_batch["tag"][row] for row in rows])
    for prefix, chosen in [("val", scores), *((f"val/{tag}", scores[tags == tag]) for tag in sorted(set(tags)))]:
        metrics.update({f"{prefix}/score/mean": float(chosen.mean()), f"{prefix}/score/max": float(chosen.max()),
                        f"{prefix}/score/min": float(chosen.min())})  # fmt: skip
    return metrics


def episode_scores(rollout: RolloutBatch, rows: Sequence[int]) -> np.ndarray:
    """The score of each episode (its summed rewards), one per row of ``rows``."""
    columns = rollout.non_tensor_batch
    if "episode_scores" in columns:  # step samples: every turn carries its episode's score
        return np.asarray([columns["episode_scores"][row] for row in rows], dtype=np.float64)
    return rollout.batch["scores"].numpy()[list(rows)].astype(np.float64)


def examples(rollout: RolloutBatch, tokenizer: Any) -> list[dict[str, Any]]:
    """The first :data:`EXAMPLES` episodes as ROLL logs them: prompt and response text (special tokens dropped)
    and the episode's score."""
    rows = episode_rows(rollout)[:EXAMPLES]
    scores = episode_scores(rollout, rows)
    prompts, responses = rollout.batch["prompts"], rollout.batch["responses"]
    prompt_mask, response_mask = rollout.batch["attention_mask"].bool(), response_tokens(rollout)
    return [{"prompt": tokenizer.decode(prompts[row][prompt_mask[row, : prompts.shape[1]]], skip_special_tokens=True),
             "response": tokenizer.decode(responses[row][response_mask[row]], skip_special_tokens=True),
             "episode_score": float(score)} for row, score in zip(rows, scores, strict=True)]  # fmt: skip


def response_tokens(rollout: RolloutBatch) -> Any:
    """Where a row's ``responses`` hold tokens (sampled and environment text), not padding."""
    width = rollout.batch["prompts"].shape[1]
    return rollout.batch["attention_mask"][:, width:].bool()


def build(mapping: dict[str, Any]) -> AgenticRolloutPipeline:
    """The pipeline of a loaded config mapping (pre-flight runs here: errors exit 2)."""
    return AgenticRolloutPipeline(AgenticConfig.from_dict(mapping))


def main(argv: Sequence[str] | None = None) -> int:
    """Load, validate, run; a config error exits 2 with its message (no traceback)."""
    return cli_main(argv, "python -m apps.agentic.rollout_pipeline", "Sample episodes with actor_infer (no training).",
                    build)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

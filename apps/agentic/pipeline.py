"""The agentic training loop: episodes in environments -> normalised episode rewards -> log-probs / values ->
advantages -> PPO epochs -> weight sync, on the roles of rl-engines (ROLL's AgenticPipeline).

Rollouts come from ``TrajectoryRunner`` (one sample per episode) or ``StepRunner`` (StepEnvManager: one sample per
turn; ``apps.agentic.step_batch`` adds the step returns, resizes the batch and computes gigpo / step_reinforce
rewards) over the ``train_env_manager`` environments, queued ``async_generation_ratio``
steps ahead (``apps.common.generation_queue``; the episodes of a step run on a background thread while the driver
trains) and wrapped by rl-replay's rollout_mock at the scheduler layer. Validation every ``eval_steps`` runs the
``val_env_manager`` environments on held-out seeds (the queue drains first) and renders them to
``render_save_dir``. Metrics, checkpoints and resume work as in RLVR.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apps.agentic.config import AgenticConfig
from apps.agentic.env_manager import EnvManager
from apps.agentic.env_sections import EnvManagerConfig
from apps.agentic.preflight import agentic_preflight
from apps.agentic.render import render_episodes
from apps.agentic.rollout import TrajectoryRunner, episode_metrics
from apps.agentic.step_batch import adjust_batch, size_divisor, step_sample_rewards, train_plans, with_step_returns
from apps.agentic.step_rollout import ConcatRunner, NativeRunner, StepRunner
from apps.agentic.vision import VisionTrajectoryRunner, load_vl_processor
from apps.common.algorithm import AlgorithmSettings, TargetBuilder
from apps.common.checkpoint_space import checkpoint_space_warning
from apps.common.generation_queue import GenerationQueue, PendingRollout, staleness_metrics
from apps.common.loop import run_loop
from apps.common.model_hub import resolve_config_models
from apps.common.preflight import replays_rollouts, role_sections, started_sections
from apps.common.profiler import worker_envs
from apps.common.sampler_state import SamplerState
from apps.common.timeline import Timeline
from apps.common.training import (
    checkpoint_dir,
    load_roles,
    save_checkpoint,
    score_with_roles,
    start_pipeline_ray,
    stop_pipeline_roles,
    sync_bucket_bytes,
    train_roles,
)
from rl_core.batch import RolloutBatch
from rl_core.batch_size import TrainBatchPlan
from rl_engines.config import GeneratingArgs
from rl_engines.model_update import ModelUpdater
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_replay import RolloutReplay

RUNNERS: dict[str, type[TrajectoryRunner]] = {"trajectory": TrajectoryRunner, "step": StepRunner,
                                               "native": NativeRunner, "concat": ConcatRunner}  # fmt: skip
"""The runner of each sample layout (apps.agentic.env_sections.ENV_MANAGER_CLASSES)."""
OUTCOME_AS_REINFORCE = {"grpo": "reinforce", "gigpo": "reinforce", "step_reinforce": "reinforce"}

LOGGED = ("env/success_rate", "critic/score/mean", "actor/pg_loss", "actor/grad_norm", "env/num_turns/mean",
          "val/success_rate", "time/step")  # fmt: skip


def build_runner(config: AgenticConfig, section: EnvManagerConfig, envs: EnvManager, tokenizer: Any,
                 sampling: GeneratingArgs, record_frames: bool) -> TrajectoryRunner:  # fmt: skip
    """The runner of a manager's sample layout; VLTrajEnvManager tags: the vision-language runner, with the actor's
    image processor."""
    if config.visual(section):
        model = str(config.base.actor_infer.model_args.model_name_or_path)
        return VisionTrajectoryRunner(envs, tokenizer, sampling, config.sequence_length,
                                      load_vl_processor(model, "actor_infer"), record_frames)  # fmt: skip
    return RUNNERS[config.mode(section)](envs, tokenizer, sampling, config.sequence_length,
                                         record_frames=record_frames)  # fmt: skip


class _Episodes:
    """A background rollout as the generation queue expects it (``get()`` returns the batch)."""

    def __init__(self, future: Future[RolloutBatch]) -> None:
        self.future = future

    def get(self) -> RolloutBatch:
        return self.future.result()


class AgenticPipeline:
    """Runs ``config.base.max_steps`` agentic steps. Pre-flight runs first: a bad config fails before Ray starts."""

    def __init__(self, config: AgenticConfig, log: Callable[[str], None] = print, progress_bar: bool | None = None):
        self.config, self.base, self.log, self.progress_bar = config, config.base, log, progress_bar
        resolve_config_models(config.base, log)
        self.report = agentic_preflight(config)
        for note in self.report.notes:
            log(note)
        if warning := checkpoint_space_warning(config.base):
            log(warning)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.base.actor_train.model_args.model_name_or_path))
        self.sequence_length = config.sequence_length
        self.train_envs = EnvManager(config, config.train_env_manager, "train")
        self.rounds = config.train_env_manager.rounds(self.base.rollout_batch_size)
        generating = self.base.actor_infer.generating_args
        self.step_mode = config.mode(config.train_env_manager) != "trajectory"
        self.divisor = size_divisor(config, role_sections(self.base))
        self.runner = self._runner(config.train_env_manager, self.train_envs, generating, record_frames=False)
        self.val_envs, self.val_runner = self._validation(config.val_env_manager)
        self.replay = RolloutReplay.from_config(self.base.rollout_mock)
        self.get_rollout = self._rollout if self.replay is None else self.replay.wrap(self._rollout, step="step")
        self.get_val_rollout = (
            self._val_rollout if self.replay is None else self.replay.wrap(self._val_rollout, split="val", step="step")
        )
        if self.replay is not None and self.replay.mode == "mock":
            self.replay.check_max_steps(self.base.max_steps)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="episodes")
        self.queue = GenerationQueue(self._submit, int(self.base.async_generation_ratio), self.base.max_steps - 1)
        settings = AlgorithmSettings.from_config(self.base, temperature=generating.temperature or 1.0,
                                                 ratio_type=config.ratio_type,
                                                 sequence_length=config.sequence_length)  # fmt: skip
        # ROLL's agentic advantage stage: grpo / gigpo / step_reinforce are reinforce returns of rewards that the
        # reward normalisation (or the step estimator) already made relative to their group.
        self.settings = replace(settings, adv_estimator=OUTCOME_AS_REINFORCE.get(settings.adv_estimator,
                                                                                 settings.adv_estimator))  # fmt: skip
        self.targets = TargetBuilder(self.settings, self.base)
        self.output_dir = Path(self.base.output_dir)
        self.roles: Roles | None = None
        self.updater: ModelUpdater | None = None
        self._started_ray = False
        self.timeline = Timeline()
        self._waits: dict[str, float] = {}

    def _validation(self, section: EnvManagerConfig | None) -> tuple[EnvManager | None, TrajectoryRunner | None]:
        """Validation environments (held-out seeds) sampled with val_env_manager.generating_args, else with
        actor_infer's (ROLL gives both managers actor_infer's), frames recorded when rendering."""
        if section is None or not self.base.eval_steps:
            return None, None
        envs = EnvManager(self.config, section, "val")
        sampling = section.generating_args or self.base.actor_infer.generating_args
        return envs, self._runner(section, envs, sampling, record_frames=self.config.render_save_dir is not None)

    def _runner(self, section: EnvManagerConfig, envs: EnvManager, sampling: GeneratingArgs,
                record_frames: bool) -> TrajectoryRunner:  # fmt: skip
        return build_runner(self.config, section, envs, self.tokenizer, sampling, record_frames)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start Ray (CPU device slots when there is no GPU) and every role."""
        cluster = ClusterSpec(self.base.num_nodes, self.base.num_gpus_per_node)
        self._started_ray = start_pipeline_ray(cluster)
        # a reference that enable_reference leaves off does not start, nor actor_infer in a replay
        sections = started_sections(self.base)
        envs = worker_envs(self.base, self.log)
        self.roles = Roles(cluster, sections, rpc_timeout=self.base.rpc_timeout, system_envs=envs)
        bucket_bytes = sync_bucket_bytes(self.base)
        self.updater = None if replays_rollouts(self.base) else self.roles.model_updater(bucket_bytes=bucket_bytes)
        self.log(f"[agentic] train environments: {self.train_envs.describe()}")

    def stop(self) -> None:
        """Wait for background episodes, stop every worker (and Ray when start() started it), close the environments."""
        self.executor.shutdown(wait=True)
        stop_pipeline_roles(self.roles, self._started_ray)
        self.roles = None
        for envs in (self.train_envs, self.val_envs):
            if envs is not None:
                envs.close()

    def run(self) -> list[dict[str, float]]:
        """All steps; returns each step's metrics (also logged and appended to metrics.jsonl)."""
        curves = [("env/success_rate", "success rate"), ("val/success_rate", "validation success rate"),
                  ("actor/pg_loss", "policy loss"), ("time/step", "seconds per step")]  # fmt: skip
        return run_loop(self, self.base, "agentic", LOGGED, curves)

    def validates_at(self, step: int) -> bool:
        """Validation runs every ``eval_steps`` when ``val_env_manager`` is configured."""
        return self.val_runner is not None and step % self.base.eval_steps == 0

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Training roles, the policy as a HuggingFace folder, and the driver's state (KL controller, moments)."""
        assert self.roles is not None
        folder = checkpoint_dir(self.base, step)
        state = {"step": step, "kl_controller": self.targets.kl_controller.state_dict(),
                 "running_moments": self.targets.running.state_dict()}  # fmt: skip
        save_checkpoint(self.roles, folder, state)
        self.log(f"[agentic] saved checkpoint {folder} (HF model: {folder / 'actor_hf'})")
        return folder

    def resume(self, folder: Path) -> int:
        """Restore roles and driver state; environments are seeded by step, so nothing else is needed."""
        assert self.roles is not None
        state = json.loads((folder / "pipeline_state.json").read_text())
        load_roles(self.roles, folder)
        self.targets.kl_controller.load_state_dict(state["kl_controller"])
        self.targets.running.load_state_dict(state["running_moments"])
        self._sync_weights()
        self.log(f"[agentic] resumed from {folder} (step {state['step']})")
        return int(state["step"])

    # ---- rollouts ------------------------------------------------------------------------------------------
    def _submit(self, step: int, version: int) -> PendingRollout:
        """Run ``step``'s episodes on the background thread with the weights after ``version`` training steps."""
        assert self.roles is not None
        if not self.queue.ratio:
            self.roles.activate("actor_infer")
        infer = self.roles["actor_infer"]
        future = self.executor.submit(self._episodes, infer, step)
        return PendingRollout(step, version, None, _Episodes(future), SamplerState())  # episodes: no padding rows

    def _episodes(self, infer: Any, step: int) -> RolloutBatch:
        episodes = self.runner.run(infer, step, self.rounds)
        return self.runner.to_batch(episodes)

    def _rollout(self, *, step: int) -> RolloutBatch:
        """The scheduler layer: the step's episodes as samples with ``scores``. rollout_mock dumps or replays it."""
        rollout, self._waits = self.queue.take(step)
        return rollout

    def _val_rollout(self, *, step: int) -> RolloutBatch:
        assert self.roles is not None and self.val_runner is not None
        self.roles.activate("actor_infer")
        assert self.config.val_env_manager is not None
        rounds = self.config.val_env_manager.rounds(self.base.val_batch_size)
        episodes = self.val_runner.run(self.roles["actor_infer"], step, rounds)
        if self.config.render_save_dir is not None:
            folder = render_episodes(episodes, Path(self.config.render_save_dir) / f"step_{step}")
            self.log(f"[agentic] rendered {len(episodes)} validation episodes to {folder}")
        return self.val_runner.to_batch(episodes)

    def validate(self, step: int) -> dict[str, float]:
        """Episodes on the validation environments (sampled with val_env_manager's generating_args, else
        actor_infer's) with the weights synced last (called before ``step`` trains, as ROLL); the queue drains
        first."""
        paused = self.queue.drain()
        metrics = episode_metrics(self.get_val_rollout(step=step), "val")
        metrics["val/score/mean"] = metrics["val/episode_reward/mean"]
        if self.queue.ratio:
            metrics["time/validation_pause"] = paused
        return metrics

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """One agentic step; returns its metrics."""
        assert self.roles is not None, "call start() first"
        timings: dict[str, float] = {}
        timer = self.timeline.timer(timings, step)
        self._waits = {}
        with timer("rollout"):
            episodes = self.get_rollout(step=step)
        rollout, plans, adjusted = self._samples(episodes, step)
        with timer("logprobs"):
            passes = score_with_roles(self.roles, rollout, self.base, self.settings.actor.temperature)
        with timer("advantages"):
            groups = list(rollout.non_tensor_batch["traj_group_id"])
            normalized, reward_metrics = step_sample_rewards(rollout, self.config)
            metrics = {**self.targets(rollout, normalized, groups), **passes}
        with timer("train"):
            if metrics.get("mask/final_mask_sum_eq_0"):  # rollout_correction rejected every token: nothing to learn
                self.log(f"[agentic] step {step}: no token is left to train on; skipping training")
            else:
                rollout.batch["sample_scores"] = episode_scores(rollout)
                metrics.update(train_roles(self.roles, rollout, self.base, self.settings, plans, step))
        with timer("sync"):
            metrics.update(self._sync(step))
        timings["time/step"] = sum(timings.values())
        metrics.update(timings)
        metrics.update(self._waits)
        metrics.update(adjusted)
        metrics.update(reward_metrics)
        metrics.update(episode_metrics(episodes, "env"))
        lengths = rollout.batch["response_mask"].sum(dim=-1).float()  # sampled tokens per sample
        # critic/score/mean: each episode's score once (with step samples too: not per turn, no batch_adjust copies).
        metrics.update({"critic/score/mean": metrics["env/episode_reward/mean"],
                        "response_length/mean": float(lengths.mean()),
                        "critic/normalized_score/mean": float(normalized.mean())})  # fmt: skip
        metrics.update(staleness_metrics(rollout, step))
        return metrics

    def _samples(
        self, rollout: RolloutBatch, step: int
    ) -> tuple[RolloutBatch, dict[str, TrainBatchPlan], dict[str, float]]:
        """The samples to train on, their batch plans and the adjustment metrics: the episodes (step samples with
        their step returns), resized by ``batch_adjust_mode`` as ROLL resizes every batch (apps.agentic.step_batch)."""
        samples = rollout
        if self.step_mode:
            samples = with_step_returns(rollout.index(slice(None)), self.config.step_reward_gamma)
        rng = np.random.default_rng([self.base.seed, step, 0xAD])
        samples, counts = adjust_batch(samples, self.config.batch_adjust_mode, self.divisor, rng)
        if self.step_mode:
            counts["system/step_samples"] = float(len(rollout))
        elif len(samples) == len(rollout):
            return samples, self.report.train_plans, counts
        return samples, train_plans(self.config, role_sections(self.base), len(samples)), counts

    def _sync_weights(self) -> dict[str, float]:
        """The trained weights to actor_infer (nothing when a replay left it off)."""
        return {} if self.updater is None else self.updater.sync()

    def _sync(self, step: int) -> dict[str, float]:
        """Weights to actor_infer every ``model_update_frequency`` steps. Episodes running ahead finish first, so
        no episode mixes two policies (``time/sync_wait``)."""
        if (step + 1) % self.base.actor_infer.model_update_frequency:
            return {}
        start = time.perf_counter()
        self.queue.drain()
        waited = time.perf_counter() - start
        metrics = self._sync_weights()
        return {**metrics, "time/sync_wait": waited} if self.queue.ratio else dict(metrics)


def episode_scores(rollout: RolloutBatch) -> torch.Tensor:
    """Each sample's episode score ``[B]`` (a step sample's is its episode's summed rewards), which splits TOPR's
    positive and negative samples as ROLL's agentic PG worker does (``get_episode_scores``)."""
    if "episode_scores" in rollout.non_tensor_batch:
        return torch.as_tensor(np.asarray(rollout.non_tensor_batch["episode_scores"], dtype=np.float32))
    return rollout.batch["scores"]

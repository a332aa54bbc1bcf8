"""The RLVR training loop: sample prompts -> generate -> verifiable rewards -> log-probs / values -> advantages ->
PPO epochs -> weight sync, on the roles of rl-engines.

Generation goes through a ``GenerationQueue`` (``async_generation_ratio`` steps ahead; 0 = synchronous) wrapped
by rl-replay's rollout_mock at the scheduler layer; validation every ``eval_steps``; resumable checkpoints every
``save_steps``; metrics to ``<output_dir>/metrics.jsonl`` (the format ``rl-replay compare-metrics`` reads) and the
configured tracker; a Perfetto ``timeline.json`` and a ``curves.png`` at the end.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from apps.common.algorithm import AlgorithmSettings, TargetBuilder
from apps.common.checkpoint_space import checkpoint_space_warning
from apps.common.generation_queue import GenerationQueue, PendingRollout, staleness_metrics
from apps.common.loop import run_loop
from apps.common.model_hub import resolve_config_models
from apps.common.padding import padded_indices
from apps.common.preflight import replays_rollouts, started_sections
from apps.common.profiler import worker_envs
from apps.common.sample_filters import SampleShaping, apply_sample_masks, apply_sample_weights
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
from apps.rlvr.config import RLVRConfig
from apps.rlvr.data import PromptSampler, load_records, record_layout
from apps.rlvr.domains import DomainSampler, domain_probs
from apps.rlvr.dynamic_sampling import DynamicSampler
from apps.rlvr.preflight import preflight
from apps.rlvr.reward_stage import rlvr_reward_stage
from apps.rlvr.rewards import Grade, RewardRouter, part_metrics
from apps.rlvr.rollout import PromptSource
from apps.rlvr.rollout_dump import dump_columns, write_dump
from apps.rlvr.validation import Validator
from apps.rlvr.video_data import VideoOptions
from apps.rlvr.vl_data import image_processor, model_type
from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs
from rl_engines.model_update import ModelUpdater
from rl_engines.placement import ClusterSpec
from rl_engines.request_scheduler import ScheduledGeneration
from rl_engines.roles import Roles
from rl_replay import RolloutReplay

Timer = dict[str, float]
LOGGED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "mismatch/mismatch_kl",
          "response_length/mean", "time/step")  # fmt: skip


class RLVRPipeline:
    """Runs ``config.max_steps`` RLVR steps. ``preflight`` runs first: a bad config fails before Ray starts."""

    def __init__(
        self, config: RLVRConfig, log: Callable[[str], None] = print, progress_bar: bool | None = None
    ) -> None:
        self.config = config
        self.log = log
        self.progress_bar = progress_bar  # None: shown when stderr is a terminal
        rewards = [(f"rewards.{name}", reward.worker) for name, reward in config.rewards.items()]
        resolve_config_models(config, log, rewards)
        self.report = preflight(config)
        for note in self.report.notes:
            log(note)
        if warning := checkpoint_space_warning(config):
            log(warning)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(config.actor_train.model_args.model_name_or_path))
        data_args = config.actor_train.data_args
        self.prompt_key, self.messages_key = data_args.get("prompt"), data_args.get("messages")
        files = data_args.get("file_name")
        if not files:
            raise ValueError("actor_train.data_args.file_name is not set; point it at the training prompts.")
        records = load_records(files, prompt_key=self.prompt_key, messages_key=self.messages_key,
                               layout=record_layout(data_args, "actor_train"))  # fmt: skip
        template = str(config.global_template or data_args.get("template", "native"))
        self.prompts, dropped = PromptSource(
            records,
            self.tokenizer,
            template,
            self.prompt_key,
            self.messages_key,
            config.prompt_length,
            image_processor(config),
            model_type(config),
            VideoOptions.from_data_args(data_args),
            dict(config.tag_to_template),
        ).within_prompt_length("training")
        if dropped:
            log(dropped)
        records = self.prompts.records
        self.router = RewardRouter(config.rewards)
        self.router.check_records(records, "training")
        probs = domain_probs(config)  # ROLL's domain_interleave_probs: each domain's share of every batch
        self.sampler: PromptSampler | DomainSampler = (
            PromptSampler(len(records), config.seed) if probs is None
            else DomainSampler(probs, [self.router.section_for(r) for r in records], config.seed)
        )  # fmt: skip
        # rollout_mock (rl-replay) at the scheduler layer: everything after the rollout does not know.
        self.replay = RolloutReplay.from_config(config.rollout_mock)
        self.get_rollout = self._rollout if self.replay is None else self.replay.wrap(self._rollout, step="step")
        self.dynamic = DynamicSampler.from_config(config, lambda i: self.router.section_for(self.prompts.records[i]))
        self.queue = GenerationQueue(self._submit, int(config.async_generation_ratio), config.max_steps - 1)
        if self.replay is not None and self.replay.mode == "mock":
            self.replay.check_max_steps(config.max_steps)
        self.validator = (
            Validator.from_config(config, self.prompts, self.router, self.replay, log)
            if config.validation and config.eval_steps
            else None
        )
        generating = config.actor_infer.generating_args
        settings = AlgorithmSettings.from_config(config, temperature=generating.temperature or 1.0)
        self.settings = rlvr_reward_stage(settings, config)  # ROLL's reward normalisation and grpo
        self.targets = TargetBuilder(self.settings, config, domains=None if probs is None else list(probs))
        self.shaping = SampleShaping.from_config(config)
        self.output_dir = Path(config.output_dir)
        self.roles: Roles | None = None
        self.updater: ModelUpdater | None = None
        self._started_ray = False
        self.timeline = Timeline()
        self._waits: dict[str, float] = {}
        self._reward_spans: list[tuple[str, tuple[float, float]]] = []
        self._graded: dict[str, list[Grade]] = {}  # the step's grades by reward section (their parts' metrics)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start Ray (CPU device slots when there is no GPU) and every role."""
        cluster = ClusterSpec(self.config.num_nodes, self.config.num_gpus_per_node)
        self._started_ray = start_pipeline_ray(cluster)
        # a reference that enable_reference leaves off does not start, nor what a replay has no use for (the
        # inference role, the LLM judges and the reward workers: the dumped rollouts come scored)
        sections = started_sections(self.config)
        replaying = replays_rollouts(self.config)
        if not replaying:
            sections.update(self.router.role_sections())  # LLM judges: a model role each (rewards.<name>)
        envs = worker_envs(self.config, self.log)
        self.roles = Roles(cluster, sections, rpc_timeout=self.config.rpc_timeout, system_envs=envs)
        self.updater = None if replaying else self.roles.model_updater(bucket_bytes=sync_bucket_bytes(self.config))
        if not replaying:
            self.router.start(self.roles, self.config.rpc_timeout, envs, self.prompt_key, self.messages_key)

    def stop(self) -> None:
        """Stop every worker, and Ray when start() started it."""
        self.router.shutdown()
        stop_pipeline_roles(self.roles, self._started_ray)
        self.roles = None

    def run(self) -> list[dict[str, float]]:
        """All steps; returns each step's metrics (also logged and appended to metrics.jsonl)."""
        return run_loop(self, self.config, "rlvr", LOGGED)

    def validates_at(self, step: int) -> bool:
        """Validation runs every ``eval_steps`` when a validation section is configured."""
        return self.validator is not None and step % self.config.eval_steps == 0

    def validate(self, step: int) -> dict[str, float]:
        """Validation with the weights synced last (called before ``step`` trains, as ROLL validates after its weight
        sync); generation running ahead pauses (drains) first."""
        assert self.roles is not None and self.validator is not None
        paused = self.queue.drain()
        metrics = self.validator(self.roles, step)
        if self.queue.ratio:
            metrics["time/validation_pause"] = paused
        return metrics

    def resume(self, folder: Path) -> int:
        """Restore roles, data position, KL controller and reward moments from ``folder``; returns its step.

        The inference role then receives the restored weights, so the next step continues exactly where the
        saved run would have.
        """
        assert self.roles is not None
        state = json.loads((folder / "pipeline_state.json").read_text())
        load_roles(self.roles, folder)
        self.sampler.state = SamplerState(**state["sampler"])
        self.targets.load_state_dict(state)
        self._sync_weights()
        self.log(f"[rlvr] resumed from {folder} (step {state['step']})")
        return int(state["step"])

    def checkpoint_dir(self, step: int) -> Path:
        """``checkpoint_config.output_dir`` (ROLL) or ``<output_dir>/checkpoints``, then ``checkpoint-<step>``."""
        return checkpoint_dir(self.config, step)

    def save(self, step: int) -> Path:
        """Atomic resumable checkpoints of the training roles, a HuggingFace folder of the policy, and the
        driver's own state (data position, KL controller, running reward moments)."""
        assert self.roles is not None
        folder = self.checkpoint_dir(step)
        state = {
            "step": step,
            "sampler": dataclasses.asdict(self.queue.resume_state() or self.sampler.state),
            **self.targets.state_dict(),
        }
        save_checkpoint(self.roles, folder, state)
        self.log(f"[rlvr] saved checkpoint {folder} (HF model: {folder / 'actor_hf'})")
        return folder

    # ---- one step ------------------------------------------------------------------------------------------
    def _rollout(self, *, step: int) -> RolloutBatch:
        """The scheduler layer: prompts -> responses -> verifiable ``scores``. rollout_mock dumps or replays it."""
        rollout, waited = self.queue.take(step)
        rollout = self._scored(rollout, step)
        if self.dynamic.active:  # query filters / extra prompts: refill with fresh generations of this policy
            more = lambda prompts: self._scored(self._submit(step, step, prompts).result(), step)  # noqa: E731
            rollout, metrics = self.dynamic.fill(rollout, more)
            waited.update(metrics)
        self._waits = waited
        return rollout

    def _scored(self, rollout: RolloutBatch, step: int) -> RolloutBatch:
        self.prompts.grade(rollout, self.router, step, self.config.max_steps)
        self._reward_spans += list(self.router.spans.items())
        for name, grades in self.router.graded.items():
            self._graded.setdefault(name, []).extend(grades)
        if self.shaping.difficulty_loss_weight:
            rollout.non_tensor_batch["difficulty"] = self.prompts.column(rollout, "difficulty")
        return rollout

    def _submit(self, step: int, version: int, count: int | None = None) -> PendingRollout:
        """Draw ``step``'s prompts (the step's batch plus the extra prompts of dynamic sampling, or ``count``)
        and queue their generation on actor_infer (the weights after ``version`` training steps)."""
        assert self.roles is not None
        self.roles.activate("actor_infer")
        before = dataclasses.replace(self.sampler.state)
        prompts = self._prompt_batch(count or self.config.rollout_batch_size + self.dynamic.extra)
        generating = self._generating(step)
        group = self.roles["actor_infer"]
        if self.config.generate_opt_level == 1:  # chunks to whichever worker has room
            chunk = self.config.actor_infer.infer_batch_size
            future: Any = ScheduledGeneration(group, prompts, generating, chunk_prompts=chunk,
                                              max_running_requests=self.config.max_running_requests)  # fmt: skip
        else:  # equal shares: pad with repeated prompts (dropped again: they come last; ROLL runs 64 on 12 workers)
            padded = prompts.index(padded_indices(list(range(len(prompts))), group.world_size))
            future = group.call_async("generate", padded, generating, dispatch="dp_split")
        return PendingRollout(step, version, len(prompts) * generating.num_return_sequences, future, before)

    def _generating(self, step: int) -> GeneratingArgs:
        generating = self.config.actor_infer.generating_args
        if generating.seed is None:  # a seed per step: a resumed run samples what the uninterrupted one did
            generating = replace(generating, seed=self.config.seed * 100_003 + step)
        if self.config.is_num_return_sequences_expand:
            generating = replace(generating, num_return_sequences=1)
        return generating

    def _prompt_batch(self, count: int) -> RolloutBatch:
        indices, uids = self.sampler.draw(count)
        batch = self.prompts.batch(indices, uids)
        if self.config.is_num_return_sequences_expand:
            batch = batch.repeat(self.config.num_return_sequences_in_group, interleave=True)
        return batch

    def step(self, step: int) -> dict[str, float]:
        """One RLVR step; returns its metrics."""
        assert self.roles is not None, "call start() first"
        timings: Timer = {}
        timer = self.timeline.timer(timings, step)
        self._waits = {}
        self._reward_spans = []
        self._graded = {}
        with timer("rollout"):
            rollout = self.get_rollout(step=step)
        if self.config.rollout_dump_dir:
            with timer("rollout_dump"):
                self._dump(rollout, step)
        grading: dict[str, float] = {}  # per reward section, inside the rollout phase (so not in time/step)
        for name, (start, end) in self._reward_spans:
            grading[f"time/reward/{name}"] = grading.get(f"time/reward/{name}", 0.0) + end - start
            self.timeline.span(f"reward/{name}", start, end, step, track=1)
        scores = rollout.batch["scores"]
        rewards = rollout.batch.get("response_level_rewards", scores)  # a dump from before rewards had their own key
        with timer("logprobs"):
            passes = self._score_with_roles(rollout)
        with timer("advantages"):
            groups = list(rollout.non_tensor_batch["prompt_uid"])
            generated = rollout.batch["response_mask"]  # ROLL's KL controller follows every response's KL
            scores, metrics = apply_sample_masks(rollout, scores, groups, self.shaping)
            metrics.update(passes)
            metrics.update(self.targets(rollout, rewards, groups, scores=scores, domains=self._domains(rollout),
                                        kl_mask=generated))  # fmt: skip
            metrics.update(apply_sample_weights(rollout, self.shaping))
        with timer("train"):
            if metrics.get("mask/final_mask_sum_eq_0"):  # every sample masked: nothing to learn from (ROLL skips)
                self.log(f"[rlvr] step {step}: the sample masks left no token to train on; skipping training")
            else:
                metrics.update(self._train(rollout, step))
        with timer("sync"):  # actor_infer.model_update_frequency: steps between weight syncs
            if (step + 1) % self.config.actor_infer.model_update_frequency == 0:
                metrics.update(self._sync_weights())
        timings["time/step"] = sum(timings.values())
        metrics.update(timings)
        metrics.update(grading)
        metrics.update(part_metrics(self._graded))  # e.g. Video-R1's <section>/acc_reward and fmt_reward
        metrics.update(self._waits)
        metrics.update(_response_metrics(rollout))
        metrics.update(staleness_metrics(rollout, step))
        return metrics

    def _dump(self, rollout: RolloutBatch, step: int) -> None:
        """ROLL's rollout_dump_dir: the step's scored rollouts as a JSON file (apps/rlvr/rollout_dump.py)."""
        assert self.config.rollout_dump_dir
        records = self.prompts.records_of(rollout)
        columns = dump_columns(rollout, records, self._record_domains(records), self.prompts.response_texts(rollout),
                               self._generating(step), step)  # fmt: skip
        write_dump(self.config.rollout_dump_dir, step, columns, self.log)

    def _sync_weights(self) -> dict[str, float]:
        """The trained weights to actor_infer (nothing when a replay left it off)."""
        return {} if self.updater is None else self.updater.sync()

    def _domains(self, rollout: RolloutBatch) -> list[str] | None:
        """Each sample's domain when the batches are drawn by domain (``domain_interleave_probs``), else None."""
        if not isinstance(self.sampler, DomainSampler):
            return None
        return self._record_domains(self.prompts.records_of(rollout))

    def _record_domains(self, records: list[dict[str, Any]]) -> list[str]:
        """Each record's domain: its ``domain`` column, else its reward section."""
        return [self.router.section_for(record) for record in records]

    def _score_with_roles(self, rollout: RolloutBatch) -> dict[str, float]:
        assert self.roles is not None
        return score_with_roles(self.roles, rollout, self.config, self.settings.actor.temperature)

    def _train(self, rollout: RolloutBatch, step: int) -> dict[str, float]:
        assert self.roles is not None
        rollout.batch["sample_scores"] = rollout.batch["scores"]  # TOPR's split (ROLL: scores > 0)
        return train_roles(self.roles, rollout, self.config, self.settings, self.report.train_plans, step)


def _response_metrics(rollout: RolloutBatch) -> dict[str, Any]:
    lengths = rollout.batch["response_mask"].sum(dim=-1).float()
    reasons = np.asarray(rollout.non_tensor_batch["finish_reasons"])
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": float((reasons == "length").mean()),
    }

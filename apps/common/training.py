"""The half of a pipeline step both apps share: log-probs / values of a scored rollout on the roles, PPO epochs of
the training roles, and where checkpoints live. Rollouts differ (prompts vs environments); this does not."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from apps.common.config import critic_enabled, reference_from_actor
from rl_core.batch import RolloutBatch
from rl_core.batch_size import TrainBatchPlan
from rl_core.seqlen_balance import balanced_minibatch_order
from rl_engines.disk_space import SAVE_FIX, OutOfSpaceError, error_code, out_of_space_cause, out_of_space_message
from rl_engines.placement import ClusterSpec
from rl_engines.ray_cluster import cpu_device_resources, start_ray, stop_ray
from rl_engines.roles import Roles
from rl_engines.weight_sync import DEFAULT_BUCKET_BYTES
from rl_engines.worker_group import WorkerGroup

TRAIN_ROLES = ("actor_train", "critic")
PIPELINE_STATE = "pipeline_state.json"
"""The driver's state in a checkpoint folder, written last: a folder without it is not a complete checkpoint."""


def score_with_roles(roles: Roles, rollout: RolloutBatch, config: Any, temperature: float) -> dict[str, float]:
    """``old_log_probs`` (actor_train), ``ref_log_probs`` (reference) and ``values`` (critic) into ``rollout``.
    In verl's bypass mode (``rollout_correction.bypass_mode``) the old log-probs are the rollout engine's: no pass.
    Returns ROLL's ``dynamic_batching/<role>/<method>/*`` metrics of the passes that ran with a token budget."""
    metrics: dict[str, float] = {}
    roles.activate("actor_train")
    correction = getattr(config, "rollout_correction", None)
    if correction is not None and correction.bypass_mode:
        if "rollout_log_probs" not in rollout.batch:
            raise ValueError("rollout_correction.bypass_mode: true trains against the rollout log-probs, but this "
                             "rollout has none (its engine or replay did not record them).")  # fmt: skip
        rollout.batch["old_log_probs"] = rollout.batch["rollout_log_probs"].clone()
    else:
        rollout.batch["old_log_probs"] = balanced_call(
            roles["actor_train"], "compute_log_probs", rollout, temperature, metrics=metrics
        )
    if "reference" in roles.groups:
        rollout.batch["ref_log_probs"] = balanced_call(
            roles["reference"], "compute_log_probs", rollout, temperature, metrics=metrics
        )
    elif reference_from_actor(config):  # LoRA: the base model, i.e. the actor with its adapters disabled
        rollout.batch["ref_log_probs"] = balanced_call(
            roles["actor_train"], "compute_log_probs", rollout, temperature, disable_adapter=True, metrics=metrics
        )
    elif config.reference is not None:  # configured, left off by enable_reference: ROLL's stand-in, every KL 0
        rollout.batch["ref_log_probs"] = rollout.batch["old_log_probs"].clone()
    if critic_enabled(config):
        rollout.batch["values"] = balanced_call(roles["critic"], "compute_values", rollout, output="values",
                                                metrics=metrics)  # fmt: skip
    return metrics


def real_tokens(rollout: RolloutBatch) -> list[int]:
    """Each sample's real (prompt + response) tokens: what ROLL balances ranks by."""
    return [int(n) for n in rollout.batch["attention_mask"].sum(dim=-1).tolist()]


def balanced_call(
    group: WorkerGroup, method: str, rollout: RolloutBatch, *args: Any, output: str = "log_probs",
    metrics: dict[str, float] | None = None, **kwargs: Any,
) -> Any:  # fmt: skip
    """``group``'s per-sample ``output`` of ``method`` on ``rollout``, the samples sent to the ranks in token-balanced
    shards (ROLL's batch_balance before a log-prob pass) and the outputs put back in ``rollout``'s order. The
    workers' metrics of the pass (``meta_info["metrics"]``, already summed over the ranks) go into ``metrics``."""
    if len(rollout) < group.world_size or len(rollout) % group.world_size:  # the dispatch refuses it, with the fix
        order = None
        result = group.call(method, rollout, *args, dispatch="dp_split", **kwargs)
    else:
        order, _ = balanced_minibatch_order(real_tokens(rollout), group.world_size, 1)
        result = group.call(method, rollout.index(order), *args, dispatch="dp_split", **kwargs)
    if metrics is not None:
        metrics.update(result.meta_info.get("metrics") or {})
    if order is None:
        return result.batch[output]
    restored = result.batch[output].clone()
    restored[order] = result.batch[output]
    return restored


def train_roles(
    roles: Roles, rollout: RolloutBatch, config: Any, settings: Any, plans: dict[str, TrainBatchPlan], step: int
) -> dict[str, float]:
    """``ppo_epochs`` passes: the critic (when it runs: gae), then the actor once ``critic_warmup`` steps passed."""
    metrics: dict[str, float] = {}
    for _ in range(config.ppo_epochs):
        if critic_enabled(config):
            metrics.update(train_role(roles, "critic", rollout, settings.critic, plans["critic"]))
        if step >= config.critic_warmup:
            metrics.update(train_role(roles, "actor_train", rollout, settings.actor, plans["actor_train"]))
    return metrics


def train_role(
    roles: Roles, role: str, rollout: RolloutBatch, objective: Any, plan: TrainBatchPlan
) -> dict[str, float]:
    """One PPO epoch of ``role``. The samples are reordered so that every optimizer step's mini-batch is the same
    set of samples whatever the data-parallel size (ranks cut their shards into mini-batches), split over the ranks
    by tokens (ROLL's batch_balance, per mini-batch); ROLL's ``global_seqlen/<role>/*`` metrics come back too."""
    shards = plan.samples_per_step // plan.samples_per_dp_rank
    order, balance = balanced_minibatch_order(
        real_tokens(rollout), shards, plan.optimizer_steps_per_rollout, prefix=f"global_seqlen/{role}"
    )
    metrics: dict[str, float] = roles[role].call("train_step", rollout.index(order), objective, dispatch="dp_split")[0]
    return {**metrics, **balance}


def checkpoint_dir(config: Any, step: int) -> Path:
    """``checkpoint_config.output_dir`` (ROLL) or ``<output_dir>/checkpoints``, then ``checkpoint-<step>``."""
    root = config.checkpoint_config.get("output_dir") or Path(config.output_dir) / "checkpoints"
    return Path(root) / f"checkpoint-{step}"


def resume_folder(config: Any) -> Path | None:
    """The checkpoint ``resume_from_checkpoint`` names: a path, or (true) the latest complete one."""
    value = config.resume_from_checkpoint
    if value is False:
        return None
    if value is not True:
        folder = Path(str(value))
    else:
        root = checkpoint_dir(config, 0).parent
        done = [p for p in root.glob("checkpoint-*") if (p / PIPELINE_STATE).exists()]
        if not done:
            raise FileNotFoundError(
                f"resume_from_checkpoint: true, but {root} holds no complete checkpoint; run without it first."
            )
        folder = max(done, key=lambda p: int(p.name.split("-")[-1]))
    if not (folder / PIPELINE_STATE).exists():
        raise FileNotFoundError(
            f"resume_from_checkpoint={value!r}: {folder} is not a complete checkpoint (no pipeline_state.json)."
        )
    return folder


def start_pipeline_ray(cluster: ClusterSpec) -> bool:
    """Start Ray for a pipeline's ``cluster`` (CPU device slots for it when there is no GPU). False when Ray was found
    running (a test session's, a notebook's): it is shared, and :func:`stop_pipeline_roles` leaves it running."""
    if torch.cuda.is_available():
        return start_ray()
    return start_ray(num_cpus=2, resources=cpu_device_resources(cluster))


def stop_pipeline_roles(roles: Roles | None, started_ray: bool) -> None:
    """Stop every worker of ``roles``, then Ray when the pipeline started it."""
    if roles is not None:
        roles.shutdown()
    if started_ray:
        stop_ray(remove_temp_dir=True)


def sync_bucket_bytes(config: Any) -> int:
    """Bytes of one weight-sync bucket: ``model_update_buffer_size_mb`` MiB, else rl-engines' default."""
    size = config.model_update_buffer_size_mb
    return DEFAULT_BUCKET_BYTES if size is None else int(size) * 2**20


def prune_checkpoints(config: Any) -> list[int]:
    """ROLL's ``max_ckpt_to_keep``: the newest that many complete checkpoints stay; every other ``checkpoint-<step>``
    folder of an older step (complete, or left half-written by a killed save) is deleted. Returns the steps deleted
    (none when the key is 0)."""
    keep = int(config.max_ckpt_to_keep)
    root = checkpoint_dir(config, 0).parent
    if keep <= 0 or not root.is_dir():
        return []
    folders = {int(p.name.split("-")[-1]): p for p in root.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()}
    complete = sorted((step for step, p in folders.items() if (p / PIPELINE_STATE).exists()), reverse=True)
    if len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    doomed = sorted(step for step in folders if step < oldest_kept)
    for step in doomed:
        shutil.rmtree(folders[step], ignore_errors=True)
    return doomed


def save_checkpoint(roles: Roles, folder: Path, state: dict[str, Any]) -> None:
    """Resumable checkpoints of the training roles, the policy as a HuggingFace folder (``actor_hf``), then the
    driver's ``state`` (``pipeline_state.json``, which marks the folder complete).

    A save that fails (a full disk: an ``OutOfSpaceError`` from the failing rank, naming the path and the sizes)
    removes ``folder``: no half-written checkpoint stays behind, and earlier checkpoints are untouched.
    """
    (folder / PIPELINE_STATE).unlink(missing_ok=True)  # an older run's marker must not complete a partial folder
    try:
        save_roles(roles, folder)
        write_pipeline_state(folder / PIPELINE_STATE, state)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def write_pipeline_state(path: Path, state: dict[str, Any]) -> None:
    """``state`` as JSON at ``path``, atomically; out of space is an ``OutOfSpaceError`` naming path and sizes."""
    text = json.dumps(state, indent=2)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        cause = out_of_space_cause(exc)
        if cause is None:
            raise
        message = out_of_space_message("the driver could not write", path, cause, needed=len(text.encode()),
                                       cleaned="The checkpoint folder is removed.", fix=SAVE_FIX)  # fmt: skip
        raise OutOfSpaceError(error_code(cause), message, str(path)) from None


def save_roles(roles: Roles, folder: Path) -> None:
    """Resumable checkpoints of the training roles and a HuggingFace folder of the policy (``actor_hf``)."""
    for role in TRAIN_ROLES:
        if role in roles.groups:
            roles[role].call("save_checkpoint", str(folder / role))
    roles["actor_train"].call("save_hf", str(folder / "actor_hf"))


def load_roles(roles: Roles, folder: Path) -> None:
    """Restore the training roles saved by :func:`save_roles`."""
    for role in TRAIN_ROLES:
        if role in roles.groups:
            roles[role].call("load_checkpoint", str(folder / role))

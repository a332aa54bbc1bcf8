"""Pre-flight check of the checkpoint folder's free space: a warning naming both numbers, before any worker starts.

One ``checkpoint-<step>`` folder holds, per training role, its fp32 weights (4 bytes a parameter) and AdamW's two
moments (8 bytes), summed over the role's ranks, plus the policy exported as a HuggingFace folder in fp32 (4 bytes
a parameter). Parameters are counted from the safetensors headers of each model folder (nothing is loaded); a model
whose size cannot be read this way (a hub id) is not checked.
"""

from __future__ import annotations

from typing import Any

from apps.common.training import TRAIN_ROLES, checkpoint_dir
from rl_engines.disk_space import format_bytes, free_bytes, weights_numel

ROLE_BYTES_PER_PARAMETER = 4 + 8
"""fp32 weights + AdamW's exp_avg and exp_avg_sq, over all ranks of a role (sharded or written once)."""
EXPORT_BYTES_PER_PARAMETER = 4
"""The actor's HuggingFace export (``actor_hf``), in fp32."""


def checkpoint_bytes(config: Any) -> int | None:
    """About the size of one checkpoint folder of ``config`` (an RLVR-style config: ``actor_train``, ``critic``);
    None when a training role's model size cannot be read."""
    total = 0
    for role in TRAIN_ROLES:
        section = getattr(config, role, None)
        if section is None:
            continue
        numel = weights_numel(str(section.model_args.model_name_or_path or ""))
        if numel is None:
            return None
        total += numel * (ROLE_BYTES_PER_PARAMETER + (EXPORT_BYTES_PER_PARAMETER if role == "actor_train" else 0))
    return total


def saves_of_run(config: Any) -> int:
    """How many checkpoints the run writes: every ``save_steps`` steps and after the last one."""
    steps, every = int(config.max_steps), max(int(config.save_steps), 1)
    return steps // every + (1 if steps % every else 0)


def checkpoints_on_disk(config: Any) -> int:
    """The most checkpoints the run holds at once: every one it writes, or with ``max_ckpt_to_keep`` N, N + 1 (the
    older ones are deleted after the new one is complete)."""
    saves, keep = saves_of_run(config), int(getattr(config, "max_ckpt_to_keep", 0))
    return saves if keep <= 0 else min(saves, keep + 1)


def checkpoint_space_warning(config: Any) -> str | None:
    """A warning when the file system of the checkpoint folder has less free space than one checkpoint needs (or
    than the checkpoints the run holds at once, :func:`checkpoints_on_disk`); None when they fit or the size is
    unknown."""
    one = checkpoint_bytes(config)
    if not one:
        return None
    root = checkpoint_dir(config, 0).parent
    free, saves = free_bytes(root), checkpoints_on_disk(config)
    if free >= one * saves:
        return None
    fits = free // one
    what = f"room for {fits} of the {saves} checkpoints this run holds" if fits else "the first save will fail"
    return (
        f"[preflight] warning: {root} has {format_bytes(free)} free, but one checkpoint needs about "
        f"{format_bytes(one)} (model + optimizer states of the training roles over all ranks, plus the HuggingFace "
        f"export of the policy): {what}. Free space there, point output_dir (or checkpoint_config.output_dir) at a "
        "larger disk, or save less often (raise save_steps) or keep fewer (max_ckpt_to_keep)."
    )

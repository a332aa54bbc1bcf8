"""Moving a DeepSpeed engine's state to host memory and back, so a colocated role can use the GPU.

ZeRO 1 and 2: DeepSpeed's ``engine.offload_states()`` moves everything (low-precision parameters and gradients,
fp32 master partitions, optimizer state). ZeRO 3: DeepSpeed moves master partitions and optimizer state only for
its own FusedAdam, so it moves parameters and gradient buffers and this module moves the torch AdamW state and the
fp32 master partitions. Stage 0 (no ZeRO optimizer): the module and the AdamW state move. Only tensors that were
on the device move, and exactly those go back. DeepSpeed is imported only inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rl_engines.strategies.train_utils import offload_optimizer_state, reload_optimizer_state


@dataclass
class OffloadRecord:
    """What :func:`offload_engine` moved off the device."""

    optimizer_state: list[tuple[int, str, torch.device]] = field(default_factory=list)
    """(state index, key, device) of each AdamW state tensor moved (train_utils.offload_optimizer_state)."""
    masters: list[tuple[torch.Tensor, torch.device]] = field(default_factory=list)
    """ZeRO-3 fp32 master partitions moved, with their device."""


def offload_engine(engine: Any, zero_stage: int) -> OffloadRecord:
    """Move ``engine``'s device state to host memory; returns what moved."""
    record = OffloadRecord()
    if zero_stage in (1, 2):
        engine.offload_states()
        return record
    if zero_stage == 0:
        engine.module.to("cpu")
        record.optimizer_state = offload_optimizer_state(engine.optimizer)
        return record
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    engine.offload_states(
        include=[OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads,
                 OffloadStateTypeEnum.contiguous_grad_buffer]
    )  # fmt: skip
    for master in engine.optimizer.fp32_partitioned_groups_flat:
        if master.device.type != "cpu":
            record.masters.append((master, master.device))
            master.data = master.data.to("cpu")
    record.optimizer_state = offload_optimizer_state(engine.optimizer.optimizer)
    return record


def reload_engine(engine: Any, zero_stage: int, record: OffloadRecord, device: torch.device) -> None:
    """Undo :func:`offload_engine`."""
    if zero_stage == 0:
        engine.module.to(device)
        reload_optimizer_state(engine.optimizer, record.optimizer_state)
        return
    engine.reload_states()
    for master, where in record.masters:
        master.data = master.data.to(where)
    if zero_stage == 3:
        reload_optimizer_state(engine.optimizer.optimizer, record.optimizer_state)

"""Adapter-only weight sync into vLLM (ROLL's vllm strategy with ``actor_infer.model_args.lora_*``).

vLLM keeps the base model it loaded from ``model_name_or_path`` and serves every request through one LoRA adapter.
A sync sends the actor's adapters alone (PEFT names, ``...q_proj.lora_A.weight``; a few MB instead of the model);
they collect here and, before the next generation or scoring, are written as a PEFT adapter folder under the
engine's cache dir and registered with vLLM under a new id (the previous adapter and folder are dropped). The
engine is started with ``enable_lora``, one adapter slot, and the smallest rank vLLM accepts that holds
``lora_rank``. Importing this module imports no vLLM.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from rl_engines.config import ModelArgs
from rl_engines.strategies.lora import peft_config, write_adapter

FACTOR = re.compile(r"^(?P<module>.+)\.lora_[AB]\.weight$")
"""An adapter tensor's name as train strategies send it (PEFT's file names)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


def is_adapter_weight(name: str) -> bool:
    """Whether ``name`` is a LoRA factor (adapter-only sync) rather than a base model weight."""
    return FACTOR.match(name) is not None


def lora_engine_kwargs(args: ModelArgs, role: str) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments that enable one LoRA adapter of rank ``lora_rank`` (ROLL: ``max_loras 1``)."""
    fits = [rank for rank in VLLM_LORA_RANKS if rank >= args.lora_rank]
    if not fits:
        raise ValueError(f"{role}.model_args.lora_rank={args.lora_rank} is above vLLM's largest {VLLM_LORA_RANKS[-1]}.")
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": fits[0]}


class AdapterSlot:
    """The adapter vLLM serves: factors received since the last activation, and the folder / request in use."""

    def __init__(self, args: ModelArgs, root: Path, role: str) -> None:
        self.args, self.role = args, role
        self.root = root
        self.pending: dict[str, torch.Tensor] = {}
        self.expected: set[str] | None = None
        self.version = 0
        self.request: Any = None
        self.folder: Path | None = None
        self.received_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Keep one received factor (a copy: the sync's buffer is reused)."""
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()

    def activate(self) -> Any:
        """Register the received adapter with vLLM (when one arrived); returns the ``LoRARequest`` to serve with
        (None before the first sync: the base model, which a fresh adapter equals)."""
        if not self.pending:
            return self.request
        names = set(self.pending)
        if self.expected is not None and names != self.expected:
            missing, extra = sorted(self.expected - names)[:3], sorted(names - self.expected)[:3]
            raise RuntimeError(
                f"{self.role}: an adapter sync sent other LoRA tensors than the first one (missing {missing}, new "
                f"{extra}); a sync must send the whole adapter."
            )
        self.expected = names
        from vllm.lora.request import LoRARequest

        self.version += 1
        folder = self.root / f"adapter-{os.getpid()}-{self.version}"
        self._write(folder)
        self.request = LoRARequest(f"{self.role}-{self.version}", self.version, str(folder))
        self._drop_folder()
        self.folder, self.pending = folder, {}
        return self.request

    def _write(self, folder: Path) -> None:
        modules = sorted({FACTOR.match(n)["module"].rsplit(".", 1)[-1] for n in self.pending})  # type: ignore[index]
        ranks = {int(t.shape[0]) for n, t in self.pending.items() if ".lora_A." in n}
        if ranks != {self.args.lora_rank}:
            raise ValueError(
                f"{self.role}.model_args.lora_rank={self.args.lora_rank}, but the adapters synced have rank "
                f"{sorted(ranks)}: give actor_infer the lora_rank of actor_train."
            )
        write_adapter(folder, self.pending, peft_config(self.args, modules))

    def _drop_folder(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def close(self) -> None:
        """Remove the adapter folder (the engine is shut down)."""
        self._drop_folder()
        self.pending = {}

"""``fsdp2_infer``: a frozen model sharded with FSDP2 over the role's ranks (ROLL's fsdp2_infer, e.g. the
reference of an fsdp2 run). Same loading, sharding options (``strategy_config``: fsdp_size, param_dtype,
reduce_dtype, reshard_after_forward, offload_policy, wrap_policy) and micro-batch plans as ``fsdp2_train``, without
optimizer, gradients or training. It generates with transformers' ``generate`` on the sharded model (every rank
steps until all have finished, as ZeRO-3 / FSDP generation must), which suits a judge or a small model; vLLM and
SGLang are the engines for rollouts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs, WorkerConfig
from rl_engines.objectives import Objective
from rl_engines.strategies.base import STRATEGIES, ensure_process_group, worker_device
from rl_engines.strategies.fsdp2 import Fsdp2TrainStrategy
from rl_engines.strategies.generation import generate_batch
from rl_engines.strategies.micro_batches import require_no_training
from rl_engines.strategies.model_io import load_model, load_tokenizer
from rl_engines.strategies.tiled_mlp import apply_tiled_mlp


@STRATEGIES.register("fsdp2_infer")
class Fsdp2InferStrategy(Fsdp2TrainStrategy):
    """Score with one FSDP2-sharded copy of the model spread over the role's ranks (a collective per pass)."""

    kind = "infer"
    lora = None
    router_loss = False
    phases = ("infer",)  # no training passes: only the _forward / _in_infer keys apply

    def __init__(self, config: WorkerConfig, role: str) -> None:
        require_no_training(config, role, "fsdp2_infer")
        super().__init__(config, role)

    def initialize(self) -> None:
        """Load the weights in fp32 (``param_dtype`` / ``model_args.dtype`` is the compute dtype), frozen, and
        shard them."""
        ensure_process_group()
        self.device = worker_device()
        model = load_model(self.config.model_args, self.role, dtype=torch.float32, value_head=self.value_head)
        model.requires_grad_(False)
        apply_tiled_mlp(model, self.options)
        self._split_experts(model)
        self._setup_ulysses(model)
        self.model = self._shard(model.to(self.device))
        self.model.eval()
        self.tokenizer = load_tokenizer(str(self.config.model_args.model_name_or_path))

    def train_step(self, batch: RolloutBatch, objective: Objective) -> dict[str, float]:
        raise RuntimeError(f"{self.role} runs fsdp2_infer, which does not train; use fsdp2_train for a training role.")

    @torch.no_grad()
    def generate(self, batch: RolloutBatch, generating_args: GeneratingArgs | None = None) -> RolloutBatch:
        """As :meth:`rl_engines.strategies.hf_infer.HfInferStrategy.generate`, on the sharded model; every rank of
        the role must call it with as many prompts (slices of infer_batch_size)."""
        args = generating_args or self.config.generating_args
        args.validate(f"{self.role}.generating_args")
        if self.ulysses is not None:
            raise RuntimeError(f"{self.role}: fsdp2_infer does not generate with model_args.ulysses_size > 1 (nor "
                               "does ROLL's); set it to 1 for a generating role.")  # fmt: skip
        self.reload()
        synced = dist.is_initialized() and dist.get_world_size() > 1
        return generate_batch(self.model, self.tokenizer, batch, args, self.device, self.config.infer_batch_size,
                              synced=synced)  # fmt: skip

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full named tensors (HF names, as a train strategy's named_weights gives them) into this rank's
        shards; an unknown name or another shape is an error naming the weight. Every rank gets every tensor and
        keeps its own shard (no communication)."""
        self.reload()
        targets = self.model.state_dict(keep_vars=True)
        loaded = 0
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise KeyError(
                    f"{self.role}: weight {name!r} from the train strategy has no counterpart in the inference "
                    f"model ({type(self.model).__name__}); are actor_train and {self.role} the same architecture?"
                )
            if name in self.expert_names and self.expert_mesh is not None:  # the full stack: keep this rank's experts
                tensor = _own_experts(name, tensor, target, self.expert_mesh, self.role)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{self.role}: weight {name!r} has shape {tuple(tensor.shape)} in the train strategy but "
                    f"{tuple(target.shape)} here; the two roles must load the same model."
                )
            value = tensor.to(device=self.device, dtype=target.dtype)
            if isinstance(target, DTensor):
                shard = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(value)
            loaded += 1
        return loaded

    def save_checkpoint(self, path: str) -> None:
        """Nothing to save: the weights are the model folder's (a frozen role)."""

    def load_checkpoint(self, path: str) -> None:
        """Nothing to restore (see :meth:`save_checkpoint`)."""


def _own_experts(name: str, tensor: torch.Tensor, target: torch.Tensor, mesh: Any, role: str) -> torch.Tensor:
    """This ``ep`` rank's experts of a synced stack (every expert, in order); a stack of another size is an error
    naming the weight."""
    if tensor.shape[0] != target.shape[0] * mesh.ep:
        raise ValueError(
            f"{role}: weight {name!r} stacks {tensor.shape[0]} experts in the train strategy but {target.shape[0]} "
            f"x ep_size {mesh.ep} here; the two roles must load the same model."
        )
    return tensor.narrow(0, mesh.ep_rank * target.shape[0], target.shape[0])

"""``hf_infer``: generation and scoring with plain HuggingFace transformers (ROLL's hf_infer), CPU or GPU.

Serves actor_infer (sampling with the sampled tokens' log-probs and finish reasons) and reference (log-probs
of given tokens with a frozen copy). Weights arrive from the train strategy through :meth:`load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs, WorkerConfig
from rl_engines.strategies.base import STRATEGIES, reject_unknown_keys, worker_device
from rl_engines.strategies.generation import generate_batch
from rl_engines.strategies.micro_batches import pass_name, planner, require_no_training, require_no_ulysses
from rl_engines.strategies.model_io import TORCH_DTYPES, fused_expert_slice, load_model, load_tokenizer


@STRATEGIES.register("hf_infer")
class HfInferStrategy:
    """Frozen HF model in eval mode on this worker's device."""

    kind = "infer"
    lora = "merged"
    """LoRA on the actor: this engine receives the weights with the adapters merged in at every sync."""
    shares_process = True
    """No process group and no process-wide state: may run in a colocated role's processes (shared_processes)."""
    loads_any_subset = True
    """``load_weights`` loads each named tensor on its own: a weight sync may leave frozen weights out."""

    def __init__(self, config: WorkerConfig, role: str) -> None:
        self.config = config
        self.role = role
        reject_unknown_keys(config.strategy_args.strategy_config, set(), f"{role}.strategy_args.strategy_config")
        require_no_training(config, role, "hf_infer")
        require_no_ulysses(config, role, "hf_infer")
        self.infer_planner = planner(config, role, "infer", agree=False)
        self.device = torch.device("cpu")
        self.model: Any = None
        self.tokenizer: Any = None
        self._offloaded = False

    def initialize(self) -> None:
        """Load the model in ``model_args.dtype`` and its tokenizer."""
        self.device = worker_device()
        dtype = TORCH_DTYPES[self.config.model_args.dtype]
        self.model = load_model(self.config.model_args, self.role, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(str(self.config.model_args.model_name_or_path))

    @torch.no_grad()
    def compute_log_probs(
        self, batch: RolloutBatch, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> RolloutBatch:
        """``log_probs [B, R]`` (and ``entropy``) of the batch's responses, in infer_batch_size slices, by the
        token budget of ``use_dynamic_batching_in_infer`` or packed (see micro_batches); each rank on its own: no
        collective in the forward."""
        self.reload()
        plan = self.infer_planner
        out = plan.map(
            batch,
            lambda micro: plan.forward(
                self.model, micro, self.device, value_head=False, temperature=temperature, with_entropy=with_entropy
            ),
        )
        out.meta_info["metrics"] = plan.dynamic_batching_metrics(pass_name(self.role, "compute_log_probs"))
        return out

    @torch.no_grad()
    def generate(self, batch: RolloutBatch, generating_args: GeneratingArgs | None = None) -> RolloutBatch:
        """Sample ``num_return_sequences`` responses per prompt (``input_ids`` / ``attention_mask``, left-padded).

        Returns the rollout layout (see :mod:`rl_engines.strategies.model_io`) with ``rollout_log_probs [B*n, R]``
        (log-softmax of logits / temperature at each sampled token, 0 at padding) and ``finish_reasons``
        (``"stop"`` or ``"length"``); non-tensor entries are repeated per sample, samples of a prompt adjacent.
        """
        args = generating_args or self.config.generating_args
        args.validate(f"{self.role}.generating_args")
        self.reload()
        return generate_batch(self.model, self.tokenizer, batch, args, self.device, self.config.infer_batch_size)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The model's weights under HF names (tied weights appear under both names)."""
        return self.model.state_dict().items()  # type: ignore[no-any-return]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors into the model (cast to its dtype / device); unknown names are an error."""
        self.reload()
        targets = self.model.state_dict(keep_vars=True)
        loaded = 0
        for name, tensor in weights:
            expert = fused_expert_slice(targets, name)  # a MoE expert under its checkpoint name (Megatron sends them)
            target = expert if expert is not None else targets.get(name)
            if target is None:
                raise KeyError(
                    f"{self.role}: weight {name!r} from the train strategy has no counterpart in the inference "
                    f"model ({type(self.model).__name__}); are actor_train and {self.role} the same architecture?"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{self.role}: weight {name!r} has shape {tuple(tensor.shape)} in the train strategy but "
                    f"{tuple(target.shape)} here; the two roles must load the same model."
                )
            target.data.copy_(tensor, non_blocking=True)
            loaded += 1
        return loaded

    def offload(self) -> None:
        """Move weights to host memory (no-op on CPU devices)."""
        if self.device.type != "cpu" and not self._offloaded:
            self.model.to("cpu")
            self._offloaded = True
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring offloaded weights back to the device."""
        if self._offloaded:
            self.model.to(self.device)
            self._offloaded = False

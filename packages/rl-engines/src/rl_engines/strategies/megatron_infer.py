"""``megatron_infer``: a frozen Megatron-core model for scoring (ROLL's reference role), tensor- and
pipeline-parallel over ranks (megatron_pipeline: a forward-only pass through the stages).

``compute_log_probs`` is the point of the strategy (vocabulary-parallel log-softmax, equal to the HF model's).
``generate`` works but is a slow reference path (no KV cache; see megatron_generate); ROLL's megatron_infer does
not generate, and actor_infer should use vllm / sglang (or hf_infer). Weights arrive from the train strategy as
HF-named full tensors through :meth:`load_weights` and are resharded onto this rank with rl_ckpt's mapping.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs, WorkerConfig
from rl_engines.strategies.base import STRATEGIES, ensure_process_group, require_engine_package, worker_device
from rl_engines.strategies.generation import sample_responses
from rl_engines.strategies.megatron_config import check_world_size, parse_megatron_options
from rl_engines.strategies.megatron_generate import MegatronGenerator, load_generation_config
from rl_engines.strategies.megatron_model import MegatronModel, build_model, check_local_model, init_model_parallel
from rl_engines.strategies.megatron_weights import sharded_names
from rl_engines.strategies.micro_batches import pass_name, planner, require_no_training, require_no_ulysses
from rl_engines.strategies.model_io import TORCH_DTYPES, load_tokenizer, resolve_model_path
from rl_engines.strategies.train_utils import gather_batch
from rl_engines.vision import is_visual


@STRATEGIES.register("megatron_infer")
class MegatronInferStrategy:
    """Frozen Megatron GPTModel in ``model_args.dtype``, split over ``tensor_model_parallel_size`` x
    ``pipeline_model_parallel_size`` ranks."""

    kind = "infer"

    def __init__(self, config: WorkerConfig, role: str) -> None:
        self.config = config
        self.role = role
        require_no_training(config, role, "megatron_infer")
        require_no_ulysses(config, role, "megatron_infer")
        # The model-parallel ranks of a replica plan the same pooled batch alike; replicas need not agree.
        self.planner = planner(config, role, "infer", agree=False)
        self.options = parse_megatron_options(
            dict(config.strategy_args.strategy_config), role, train=False, dtype=config.model_args.dtype
        )
        check_local_model(config, self.options, role)
        self.device = torch.device("cpu")
        self.megatron: MegatronModel = None  # type: ignore[assignment]
        self.model: MegatronGenerator = None  # type: ignore[assignment]
        self.tokenizer: Any = None
        self.dp_rank = 0
        self._offloaded = False

    def initialize(self) -> None:
        """Set up Megatron's groups and load this rank's shards in ``model_args.dtype``."""
        require_engine_package("megatron", "megatron_infer", "megatron")
        from megatron.core import parallel_state

        ensure_process_group()
        check_world_size(self.options, dist.get_world_size(), self.role)
        self.device = worker_device()
        dtype = TORCH_DTYPES[self.config.model_args.dtype]
        seed = self.config.training_args.seed
        init_model_parallel(self.options, seed, self.role)
        path = resolve_model_path(self.config.model_args, self.role)
        self.megatron = build_model(path, self.options, role=self.role, params_dtype=dtype, device=self.device,
                                    value_head=False, seed=seed)  # fmt: skip
        self.megatron.module.eval()
        self.megatron.module.requires_grad_(False)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.model = MegatronGenerator(
            self.megatron, load_generation_config(path, self.megatron.layout.spec.hf_config or {})
        )
        self.tokenizer = load_tokenizer(path)

    @torch.no_grad()
    def compute_log_probs(
        self, batch: RolloutBatch, *, temperature: float = 1.0, with_entropy: bool = False
    ) -> RolloutBatch:
        """``log_probs [B, R]`` (and ``entropy``) of the batch's responses, in infer_batch_size slices (or by the
        token budget of ``use_dynamic_batching_in_infer``)."""
        self.reload()
        return self.megatron.score(batch, self.planner, pass_name(self.role, "compute_log_probs"),
                                   temperature=temperature, with_entropy=with_entropy)  # fmt: skip

    @torch.no_grad()
    def generate(self, batch: RolloutBatch, generating_args: GeneratingArgs | None = None) -> RolloutBatch:
        """Sample ``num_return_sequences`` responses per prompt (slow reference path; see the module docstring).

        Same output layout as hf_infer's generate; the TP x PP ranks of a replica pool their prompts and sample them
        in lockstep, each returning the rows of its own prompts.
        """
        args = generating_args or self.config.generating_args
        args.validate(f"{self.role}.generating_args")
        if is_visual(batch):
            raise ValueError(
                f"{self.role}: megatron_infer generates from text prompts only (its reference sampler runs no vision "
                "tower between steps); generate vision-language prompts with hf_infer or vllm and score them here."
            )
        self.reload()
        pooled, own = gather_batch(batch, self.megatron.mp_group)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if args.seed is not None:  # offset by data-parallel rank: replicas must not draw the same numbers
                torch.manual_seed(args.seed + self.dp_rank)
            parts = [
                sample_responses(self.model, self.tokenizer, micro, args, self.device)
                for micro in pooled.split(self.config.infer_batch_size)
            ]
        out = RolloutBatch.concat(parts)
        n = args.num_return_sequences
        return out.index(list(range(own.start * n, own.stop * n)))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named weights, gathered over the TP group and the pipeline stages (every rank must iterate)."""
        self.reload()
        model = self.megatron
        params = dict(model.module.named_parameters())
        return model.export(params, sharded_names(model.module))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reshard HF-named full tensors onto this rank (cast to its dtype / device); unknown names are an error.

        q / k / v and gate / up are fused in Megatron, so they are written once all parts arrived (parts may come in
        different calls, as weight-sync buckets do). Under pipeline parallelism each stage keeps its own layers and
        checks, then skips, the others'. Returns the number of HF tensors taken.
        """
        self.reload()
        return self.megatron.loader.load(weights)

    def offload(self) -> None:
        """Move weights to host memory (no-op on CPU devices)."""
        if self.device.type != "cpu" and not self._offloaded:
            self.megatron.module.to("cpu")
            self._offloaded = True
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring offloaded weights back to the device."""
        if self._offloaded:
            self.megatron.module.to(self.device)
            self._offloaded = False

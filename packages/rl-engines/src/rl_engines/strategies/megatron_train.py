"""``megatron_train``: train one role's model with Megatron-core tensor (TP) x pipeline (PP) x data (DP) parallelism.

The model is megatron-core's ``GPTModel`` (local layer spec) loaded from the HF folder with rl_ckpt's mapping; each
rank holds its TP shards of its pipeline stage's layers. Parallel layout and memory keys are ROLL's (see
megatron_config); context parallelism is rejected with a message (it needs Transformer Engine). With
``virtual_pipeline_model_parallel_size`` each stage holds several model chunks and the schedule interleaves them.

Batches: ``dp_split`` gives each rank a chunk; the ranks of one model replica (its TP x PP group) pool their
chunks, so a data-parallel replica trains on its TP x PP ranks' chunks together (ROLL: global batch =
per_device_train_batch_size x gradient_accumulation_steps x world / (TP x PP)). A mini-batch's micro-batches run
through the stages with the 1F1B schedule of megatron_pipeline; the last stage computes the losses. Gradient
semantics as in fsdp2_train: each micro-batch loss is its share of the mini-batch loss (rl-core GlobalBatchInfo
over DP ranks), gradients are summed over DP ranks and accumulation steps (and, for tied embeddings under PP, over
the first stage's embedding and the last stage's copy, as Megatron does). Optimizer: torch AdamW over each rank's
own shards (elementwise, so identical to AdamW on the full tensors), replicated over DP ranks; with
``use_distributed_optimizer: true`` its state is partitioned over the DP ranks instead (ZeRO stage 1, as
Megatron's DistributedOptimizer), with the same update. The gradient norm is global: over TP shards and stages.
With ``model_args.lora_target`` (ROLL's LoRA keys) only adapters on the tensor-parallel linears train (sharded like
their base weights, :mod:`rl_engines.strategies.megatron_lora`); the base stays frozen in the compute dtype, with no
fp32 masters and no optimizer state, and checkpoints hold the adapters alone.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfig
from rl_engines.objectives import Objective
from rl_engines.strategies import lora, megatron_checkpoint
from rl_engines.strategies.base import STRATEGIES, ensure_process_group, require_engine_package, worker_device
from rl_engines.strategies.megatron_config import check_world_size, describe_unused_switches, parse_megatron_options
from rl_engines.strategies.megatron_lora import MegatronLora
from rl_engines.strategies.megatron_model import (
    MegatronModel,
    build_model,
    check_local_model,
    init_model_parallel,
    read_spec,
)
from rl_engines.strategies.megatron_ops import (
    chained_optimizer,
    clip_gradients,
    grad_norm,
    local_optimizer,
    sum_gradients,
)
from rl_engines.strategies.megatron_pipeline import broadcast_object_from_last
from rl_engines.strategies.megatron_router import router_loss_coef, set_micro_weight, tracked_layer_mean
from rl_engines.strategies.megatron_vision import freeze_parameters
from rl_engines.strategies.megatron_weights import sharded_names
from rl_engines.strategies.micro_batches import pass_name, planner, require_no_ulysses
from rl_engines.strategies.model_io import (
    TORCH_DTYPES,
    load_tokenizer,
    resolve_model_path,
    response_length,
    widen,
)
from rl_engines.strategies.train_utils import (
    MetricAccumulator,
    TrainScoring,
    build_optimizer,
    build_scheduler,
    check_minibatch,
    check_objective,
    gather_batch,
    minibatch_info,
    offload_optimizer_state,
    reload_optimizer_state,
    run_minibatches,
    token_share,
)

logger = logging.getLogger(__name__)


@STRATEGIES.register("megatron_train")
class MegatronTrainStrategy(TrainScoring):
    """Megatron-core TP x PP x DP training of a dense decoder (or its critic, with a ``score`` value head), or of a
    Qwen3-MoE / Qwen2-MoE model with its experts split over ``expert_model_parallel_size`` ranks."""

    kind = "train"
    lora: str | None = "adapters"
    """LoRA (``model_args.lora_target``): adapters on the tensor-parallel linears (:mod:`.megatron_lora`)."""
    router_loss = True
    """Mixture-of-experts models: Megatron's router load-balancing loss (:mod:`.megatron_router`)."""

    def __init__(self, config: WorkerConfig, role: str) -> None:
        self.config = config
        self.role = role
        # The model-parallel ranks of a replica plan the same pooled batch alike; data-parallel replicas need not
        # agree on a count (their gradients are reduced once per optimizer step, after every pass).
        require_no_ulysses(config, role, "megatron_train")
        self.planners = {phase: planner(config, role, phase, agree=False) for phase in ("train", "infer")}
        self.options = parse_megatron_options(
            dict(config.strategy_args.strategy_config), role, train=True, dtype=config.model_args.dtype
        )
        check_local_model(config, self.options, role)
        self.value_head = role == "critic" or config.model_args.model_type in ("critic", "trl")
        check_megatron_lora(config, role, self.value_head, self.options)
        if config.model_args.frozen_prefixes() and config.model_args.lora:
            raise ValueError(
                f"{role}.model_args.freeze_module_prefix with lora_target: under LoRA only the adapters train "
                "already; remove freeze_module_prefix."
            )
        self.adapters: MegatronLora | None = None
        """The LoRA adapters (``lora_target`` set): then the only masters."""
        self.device = torch.device("cpu")
        self.global_step = 0
        self.model: MegatronModel = None  # type: ignore[assignment]
        self.masters: dict[str, torch.nn.Parameter] = {}
        """fp32 weights the optimizer updates, by Megatron name (the parameters themselves when computing in fp32)."""
        self.frozen: set[str] = set()
        """HF names of the vision-tower weights ``model_args.freeze_module_prefix`` froze (weight syncs send them
        once); frozen language-model weights keep being sent (their HF tensors may be fused with trained ones)."""
        self.sharded: set[str] = set()
        """Names of the masters split over TP ranks."""
        self.base_sharded: set[str] = set()
        """Names of the model's own parameters split over TP ranks."""
        self._tp_partial: set[str] = set()
        """Replicated weights whose gradient each TP rank computes from its part only, summed over TP ranks as
        Megatron's finalize_model_grads does: norms under sequence parallelism (its slice of the sequence) and the
        per-head q / k norms (qk_layernorm: its heads)."""
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.tokenizer: Any = None
        self.dp_rank, self.dp_group = 0, None
        self.dp_size = 1
        self.experts: set[str] = set()
        """MoE: names of the expert masters (each expert-parallel rank holds its own experts)."""
        self.ep_group: Any = None
        self.expert_dp_group: Any = None
        self.checkpoint_writer = True
        """Whether this rank writes its model shards (data-parallel rank 0; with expert parallelism, the first
        replica of each expert-parallel rank's experts)."""
        self.embedding_group: Any = None
        """First and last pipeline stage, which sum the gradients of tied embeddings (PP > 1 only)."""
        self._offloaded_state: list[tuple[int, str, torch.device]] = []
        self._offloaded = False
        self.aux_loss_coef = 0.0
        """Megatron's router load-balancing loss coefficient (a MoE model; set in initialize)."""

    # ---- setup ---------------------------------------------------------------------------------------------
    def initialize(self) -> None:
        """Set up Megatron's groups, load this rank's fp32 master shards, build AdamW (its state partitioned over
        DP ranks with use_distributed_optimizer) and the LR schedule."""
        require_engine_package("megatron", "megatron_train", "megatron")
        from megatron.core import parallel_state

        ensure_process_group()
        self.dp_size = check_world_size(self.options, dist.get_world_size(), self.role)
        if self.options.unused_switches and dist.get_rank() == 0:
            logger.warning(describe_unused_switches(self.options, self.role))
        self.device = worker_device()
        args = self.config.model_args
        seed = self.config.training_args.seed
        init_model_parallel(self.options, seed, self.role)
        path = resolve_model_path(args, self.role)
        spec = read_spec(path, self.role)
        self.aux_loss_coef = router_loss_coef(self.config, self.role, spec, self.options.moe_aux_loss_coeff)
        self.model = build_model(path, self.options, role=self.role, params_dtype=TORCH_DTYPES[args.dtype],
                                 device=self.device, value_head=self.value_head, seed=seed,
                                 aux_loss_coef=self.aux_loss_coef)  # fmt: skip
        module = self.model.module
        self.base_sharded = sharded_names(module)
        if args.lora:  # the adapters are the only trained weights; the base stays in the compute dtype, frozen
            if self.model.layout.spec.moe:
                raise ValueError(
                    f"{self.role}.model_args.lora_target is set on a mixture-of-experts model ({path}): megatron_train "
                    "has no LoRA on experts yet; train it full-parameter (remove the lora_* keys)."
                )
            module.requires_grad_(False)
            self.adapters = MegatronLora(module, self.model.layout, args, self.role, seed, self.device)
            self.masters, self._pairs = dict(self.adapters.named_parameters()), []
            self.sharded = self.adapters.sharded_names()
        else:
            self.frozen = freeze_parameters(self.model, args.frozen_prefixes())
            self.masters, self._pairs = fp32_masters(module)
            self.sharded = set(self.base_sharded)
            self._tp_partial = tp_partial_names(module, self.masters, self.options.tensor_model_parallel_size)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group() if dist.get_world_size() > 1 else None
        self.experts = {name for name in self.masters if ".mlp.experts." in name}
        if self.experts and dist.get_world_size() > 1:
            self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        if self.options.expert_model_parallel_size > 1:
            self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.checkpoint_writer = (parallel_state.get_expert_data_parallel_rank() if self.experts else self.dp_rank) == 0
        layout = self.model.layout
        tied = "embedding.word_embeddings.weight" if layout.first else "output_layer.weight"
        if layout.tied_copy and (layout.first or layout.last) and tied in self.masters:
            self.embedding_group = parallel_state.get_embedding_group()
        self.optimizer = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, self.config.training_args, self.role)
        self.tokenizer = load_tokenizer(path)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the masters; a MoE model's dense and expert masters in two chained parts, as in Megatron,
        because with ``use_distributed_optimizer`` their state partitions over different groups: the data-parallel
        ranks, and the ranks holding the same experts (at DP = 1, or a group of one, a part stays plain AdamW)."""
        args = self.config.training_args
        dense = [master for name, master in self.masters.items() if name not in self.experts]
        parts = [(build_optimizer(dense, args), self.dp_group)]
        if self.experts:
            experts = [master for name, master in self.masters.items() if name in self.experts]
            parts.append((build_optimizer(experts, args), self.expert_dp_group))
        return chained_optimizer(parts, self.options.use_distributed_optimizer)

    # ---- forward -------------------------------------------------------------------------------------------
    def _infer(self, batch: RolloutBatch, method: str, *, temperature: float, with_entropy: bool,
               disable_adapter: bool = False) -> RolloutBatch:  # fmt: skip
        self.reload()
        self.model.module.eval()
        with self._adapters_off(disable_adapter):
            return self.model.score(batch, self.planners["infer"], pass_name(self.role, method, disable_adapter),
                                    temperature=temperature, with_entropy=with_entropy)  # fmt: skip

    def _adapters_off(self, disable: bool) -> Any:
        if not disable:
            return contextlib.nullcontext()
        if self.adapters is None:
            raise ValueError(
                f"{self.role}: disable_adapter asks for the base model, but {self.role} has no LoRA adapters."
            )
        return self.adapters.disabled()

    # ---- training ------------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch, objective: Objective) -> dict[str, float]:
        """One optimizer step per mini-batch of ``per_device_train_batch_size x gradient_accumulation_steps``
        samples of this data-parallel replica's pooled batch. Returns metrics summed over DP replicas."""
        check_objective(self.role, objective, self.value_head)
        pooled, _ = gather_batch(batch, self.model.mp_group)
        layout = self.model.layout
        _, minibatch = check_minibatch(
            self.role, len(pooled), self.config.training_args,
            per=f"per data-parallel replica (pooled over tensor_model_parallel_size={layout.tp} x "
            f"pipeline_model_parallel_size={layout.pp} ranks)",
            dp_note=" (world size / (tensor_model_parallel_size x pipeline_model_parallel_size))",
        )  # fmt: skip
        self.reload()
        self.model.module.train()
        metrics = run_minibatches(pooled, self.planners["train"].split, minibatch, self.scheduler,
                                  lambda micros, sums: self._optimizer_step(micros, objective, sums))  # fmt: skip
        name = pass_name(self.role, "train_step")
        return {**metrics, **self.planners["train"].dynamic_batching_metrics(name, counted=self.model.counted)}

    def _optimizer_step(self, micros: list[RolloutBatch], objective: Objective, metrics: MetricAccumulator) -> float:
        assert self.optimizer is not None
        info = minibatch_info(micros, self.dp_group)
        self.optimizer.zero_grad(set_to_none=True)
        found: list[dict[str, torch.Tensor]] = []
        weight = set_micro_weight(len(micros), self.dp_group) if self.aux_loss_coef else 0.0

        def loss_of(index: int, run: RolloutBatch, out: torch.Tensor) -> torch.Tensor:  # on the last stage
            outputs = self.model.head(run, out, temperature=objective.temperature,
                                      with_entropy=objective.needs_entropy)  # fmt: skip
            loss, values = objective(widen(outputs, response_length(micros[index])), micros[index], info)
            found.append({k: v.detach() for k, v in values.items()})
            return loss

        self.model.schedule(self.planners["train"].runs(micros), loss_of, train=True)
        if self.aux_loss_coef:
            self._add_router_metric(weight, metrics)
        self._add_metrics(micros, found, info, metrics)
        self._finalize_gradients()
        experts = [self.masters[name] for name in sorted(self.experts)]  # distinct on each expert-parallel rank
        norm = grad_norm(self._norm_owned(), self.model.mp_group, experts, self.ep_group)
        clip_gradients(self.masters.values(), norm, self.config.training_args.max_grad_norm)
        if math.isfinite(norm):  # else skip the update (as DeepSpeed does; the norm, hence the skip, is global)
            self.optimizer.step()  # partitioned: each DP rank updates the tensors it owns, then broadcasts them
            self.publish_masters()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        return norm

    def _add_metrics(self, micros: list[RolloutBatch], found: list[dict[str, torch.Tensor]], info: Any,
                     metrics: MetricAccumulator) -> None:  # fmt: skip
        """The last stage's per-micro-batch metrics, counted by one rank per replica (TP rank 0 of the last stage;
        the others add values that change nothing under the same names), so the world sum in MetricAccumulator is
        over DP replicas."""
        stage = self.model.stage
        if stage.size > 1:  # exact: float64 holds every float32 / float64 metric value
            floats = [{k: float(v) for k, v in values.items()} for values in found] if stage.last else None
            received = broadcast_object_from_last(stage, floats)
            found = [{k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()} for values in received]
        reports = self.model.layout.tp_rank == 0 and stage.last
        for micro, values in zip(micros, found, strict=True):
            metrics.add(MetricAccumulator.reported(values, reports), token_share(micro, info))
        metrics.end_minibatch()

    def _add_router_metric(self, weight: float, metrics: MetricAccumulator) -> None:
        """``load_balancing_loss``: this replica's share of the mean over layers and the micro-batches of every
        replica (``weight`` = 1 / their count; one rank per replica adds it, the others zero under the same name, as
        :meth:`_add_metrics`: every rank sums the same metric names)."""
        layout = self.model.layout
        stage = self.model.stage
        mean = tracked_layer_mean(layout.spec.num_layers, stage.group if stage.size > 1 else None)
        if mean is not None:
            reports = layout.tp_rank == 0 and stage.last
            metrics.add({"load_balancing_loss": mean * weight if reports else torch.zeros(())}, 1.0)

    def _norm_owned(self) -> list[torch.nn.Parameter]:
        """The masters whose gradients the global norm counts on this rank: TP shards, replicated tensors on TP rank
        0 only, and not the last stage's copy of tied embeddings (the first stage counts them); MoE experts are
        counted apart (over the expert-parallel ranks)."""
        layout = self.model.layout
        copy = "output_layer.weight" if layout.tied_copy and layout.last else None
        skip = {copy, *self.experts}
        return [master for name, master in self.masters.items()
                if (name in self.sharded or layout.tp_rank == 0) and name not in skip]  # fmt: skip

    def _finalize_gradients(self) -> None:
        """fp32 master gradients summed over DP ranks (and over TP ranks for the weights of ``_tp_partial``, and over
        the first and last stage for tied embeddings under PP)."""
        for param, master in self._pairs:
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None
        sum_gradients([m for name, m in self.masters.items() if name not in self.experts], self.dp_group)
        sum_gradients([m for name, m in self.masters.items() if name in self.experts], self.expert_dp_group)
        for name in sorted(self._tp_partial):  # each TP rank saw part of the sequence or heads; same order on all
            grad = self.masters[name].grad
            if grad is not None:
                dist.all_reduce(grad, group=self.model.tp_group)
        if self.embedding_group is not None:  # both copies get the same sum, so they stay identical
            master = self.masters[
                "embedding.word_embeddings.weight" if self.model.layout.first else "output_layer.weight"
            ]
            if master.grad is None:
                master.grad = torch.zeros_like(master)
            dist.all_reduce(master.grad, group=self.embedding_group)

    @torch.no_grad()
    def publish_masters(self) -> None:
        """Copy the fp32 masters into the bf16 / fp16 compute parameters (nothing to do in fp32)."""
        for param, master in self._pairs:
            param.copy_(master)

    # ---- weights -------------------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under HF names, gathered over the TP group and the pipeline stages (every rank must
        iterate)."""
        was_offloaded = self._offloaded
        self.reload()
        try:
            if self.adapters is None:  # frozen weights (freeze_module_prefix) have no master
                params: dict[str, torch.Tensor] = {**dict(self.model.module.named_parameters()), **self.masters}
            else:  # the frozen base with the adapters merged into each shard (what an engine without adapters loads)
                params = self.adapters.merged(dict(self.model.module.named_parameters()))
            yield from self.model.export(params, self.base_sharded, self.ep_group)
        finally:
            if was_offloaded:
                self.offload()

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the adapters alone under PEFT's file names, gathered over TP and the stages (a collective)."""
        lora.require_lora(self.config, self.role)
        assert self.adapters is not None
        was_offloaded = self._offloaded
        self.reload()
        try:
            yield from self.adapters.export(self.model.tp_group, self.model.stage)
        finally:
            if was_offloaded:
                self.offload()

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Not supported: a train strategy's weights change only through training or load_checkpoint."""
        raise NotImplementedError(f"{self.role}: load weights through load_checkpoint")

    def save_checkpoint(self, path: str) -> None:
        """Atomically save each TP rank's shards of each stage, the AdamW state (one partition per DP rank when it is
        partitioned), schedule, step and RNG."""
        megatron_checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` (same tensor_model_parallel_size and
        pipeline_model_parallel_size; any DP size, with or without use_distributed_optimizer)."""
        megatron_checkpoint.load(self, path)

    def save_hf(self, path: str) -> None:
        """A HuggingFace folder of the current weights (rank 0 writes; every rank must call)."""
        megatron_checkpoint.save_hf(self, path)

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory (no-op on CPU devices)."""
        if self.device.type != "cpu" and not self._offloaded:
            self._offloaded = True
            self.model.module.to("cpu")
            _move(self._moved(), torch.device("cpu"))
            if self.optimizer is not None:
                self._offloaded_state = offload_optimizer_state(local_optimizer(self.optimizer))
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring offloaded state back to the device."""
        if self._offloaded:
            self._offloaded = False
            self.model.module.to(self.device)
            _move(self._moved(), self.device)
            if self.optimizer is not None:
                reload_optimizer_state(local_optimizer(self.optimizer), self._offloaded_state)
                self._offloaded_state = []

    def _moved(self) -> list[tuple[Any, Any]]:
        """(parameter, master) pairs whose masters live outside the module: the fp32 masters, or the adapters."""
        return self._pairs if self.adapters is None else [(None, p) for p in self.masters.values()]


def check_megatron_lora(config: WorkerConfig, role: str, value_head: bool, options: Any) -> None:
    """Refuse, naming the key, what megatron_train's LoRA does not build: a value-head role, adapter dropout, and
    sequence parallelism over more than one TP rank (its sequence-split activations)."""
    args = config.model_args
    if not args.lora:
        return
    lora.check_lora_role(config, role, value_head)
    if args.lora_dropout:
        raise ValueError(
            f"{role}.model_args.lora_dropout={args.lora_dropout}: megatron_train's LoRA has no adapter dropout "
            "(fsdp2_train and deepspeed_train have it through peft); set it to 0 or use one of those."
        )
    if options.sequence_parallel and options.tensor_model_parallel_size > 1:
        raise ValueError(
            f"{role}.strategy_args.strategy_config.sequence_parallel=true with tensor_model_parallel_size="
            f"{options.tensor_model_parallel_size} and {role}.model_args.lora_target set: megatron_train's LoRA "
            "adapters take whole sequences; set sequence_parallel: false for a LoRA run."
        )


def tp_partial_names(module: torch.nn.Module, masters: dict[str, Any], tp: int) -> set[str]:
    """The trained replicated weights whose gradient each TP rank computes from its part only (see
    ``MegatronTrainStrategy._tp_partial``)."""
    heads = (".q_layernorm.", ".k_layernorm.")
    return {name for name, param in module.named_parameters() if name in masters and (
        getattr(param, "sequence_parallel", False) or (tp > 1 and any(norm in name for norm in heads)))}  # fmt: skip


def fp32_masters(module: torch.nn.Module) -> tuple[dict[str, torch.nn.Parameter], list[tuple[Any, Any]]]:
    """Master weights by name and the (compute parameter, master) pairs that differ.

    Megatron's mixed precision: forward and backward run in the parameters' dtype (bf16 / fp16); gradients are
    copied into fp32 masters, which AdamW updates and which are copied back. In fp32 the masters are the parameters.
    """
    masters: dict[str, torch.nn.Parameter] = {}
    pairs = []
    for name, param in module.named_parameters():
        if not param.requires_grad:  # frozen (model_args.freeze_module_prefix): no master, no optimizer state
            continue
        if param.dtype == torch.float32:
            masters[name] = param
        else:
            masters[name] = torch.nn.Parameter(param.detach().float().clone())
            pairs.append((param, masters[name]))
    return masters, pairs


def _move(pairs: list[tuple[Any, Any]], device: torch.device) -> None:
    for _, master in pairs:
        master.data = master.data.to(device, non_blocking=True)

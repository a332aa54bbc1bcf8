"""``fsdp2_train``: the torch-native train strategy (PyTorch FSDP2, ``fully_shard``), on CPU (gloo) and GPU (nccl).

Why FSDP2 rather than DDP: it is ROLL's own ``fsdp2_train`` (its strategy_config keys are accepted as they are),
parameters, gradients and optimizer state are sharded across data-parallel ranks (so the default strategy scales
past one device's memory), it runs on CPU over gloo in torch >= 2.6, and state dicts keep the HF parameter names
(no ``module.`` prefix), so weight export and checkpoints need no renaming. One rank is a world of one.

Gradient semantics: each micro-batch loss is its share of the whole mini-batch loss (rl-core GlobalBatchInfo),
gradients are *summed* over ranks (FSDP's divide factor set to 1) and over accumulation steps, so the update
is identical for any split of a mini-batch into ranks x micro-batches.

Ulysses (``model_args.ulysses_size`` > 1, see :mod:`rl_engines.strategies.ulysses`): the ranks of a Ulysses group
pool their batches, every pass is packed and each rank runs its slice of the row; the data-parallel size is
ranks / ulysses_size, and mini-batches are formed from the pooled batch as from a data-parallel rank's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfig
from rl_engines.objectives import Objective
from rl_engines.strategies import checkpointing, lora, moe
from rl_engines.strategies import fsdp2_experts as ep
from rl_engines.strategies.base import STRATEGIES, ensure_process_group, worker_device
from rl_engines.strategies.fsdp2_wrap import WRAP_POLICY_KEYS, check_options, class_names, wrap_units
from rl_engines.strategies.micro_batches import MicroBatchPlanner, pass_name, planner
from rl_engines.strategies.model_io import (
    TORCH_DTYPES,
    attention_kernel,
    enable_activation_checkpointing,
    freeze_modules,
    is_varlen,
    load_model,
    load_tokenizer,
)
from rl_engines.strategies.tiled_mlp import TILED_MLP_KEYS, apply_tiled_mlp, check_tiled_mlp
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
from rl_engines.strategies.ulysses import (
    ATTENTION,
    UlyssesGroups,
    check_ulysses,
    model_heads,
    new_groups,
    register_attention,
    ulysses_outputs,
)

# strategy_config key -> accepted types (ROLL's fsdp2_train keys)
FSDP2_KEYS: dict[str, tuple[type, ...]] = {
    "fsdp_size": (int,),
    "param_dtype": (str,),
    "reduce_dtype": (str,),
    "reshard_after_forward": (bool,),
    "offload_policy": (bool,),
    "wrap_policy": (dict,),
    "use_batched_model_update": (bool,),
    **ep.EP_KEYS,
    **TILED_MLP_KEYS,
    "apply_expert_patch": (bool,),
}
HERE_ONLY_NOTES = {
    "offload_policy": "FSDP2's CPUOffloadPolicy keeps parameters, gradients and optimizer state in host memory "
    "between uses; on a CPU device they are in host memory already, so nothing changes",
    "use_batched_model_update": "ROLL gathers several weights per all-gather when syncing into actor_infer; here "
    "each weight is gathered on its own (the same weights arrive, in the same buckets)",
    "apply_expert_patch": "ROLL's per-expert module patch, which ROLL itself turns off with transformers >= 5.2 (its "
    "experts are fused tensors, nothing to patch); so does this build",
}
"""Accepted ROLL options that change no result here, with what they do and what happens here instead."""
logger = logging.getLogger(__name__)
DTYPE_ALIASES = {**TORCH_DTYPES, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@STRATEGIES.register("fsdp2_train")
class Fsdp2TrainStrategy(TrainScoring):
    """Train one role's model with FSDP2 over all ranks of the worker's process group."""

    kind = "train"
    lora: str | None = "adapters"
    """LoRA (``model_args.lora_target``): trains peft adapters (see :mod:`rl_engines.strategies.lora`)."""
    router_loss = True
    """Mixture-of-experts models: adds the router load-balancing loss (see :mod:`rl_engines.strategies.moe`)."""
    phases: tuple[str, ...] = ("train", "infer")
    """The micro-batch plans this strategy runs (training passes, log-prob / value passes)."""

    def __init__(self, config: WorkerConfig, role: str) -> None:
        self.config = config
        self.role = role
        self.options = dict(config.strategy_args.strategy_config)
        prefix = f"{role}.strategy_args.strategy_config"
        check_options(self.options, FSDP2_KEYS, prefix)
        check_options(self.options.get("wrap_policy") or {}, WRAP_POLICY_KEYS, f"{prefix}.wrap_policy")
        check_tiled_mlp(self.options, prefix)
        if isinstance(config.device_mapping, list) and config.device_mapping:  # checked before any worker starts
            world = max(len(config.device_mapping) // config.num_gpus_per_worker, 1)
            self._fsdp_size(world)
            ep.check_expert_options(self.options, world, prefix)
        self._check_expert_parallel(config, prefix)
        self.planners = {phase: planner(config, role, phase) for phase in self.phases}
        self.value_head = role == "critic" or config.model_args.model_type in ("critic", "trl")
        self.ulysses: UlyssesGroups | None = None
        self.ulysses_kernel = "sdpa"
        if config.model_args.ulysses_size > 1 and config.device_mapping:
            check_ulysses(config.model_args.ulysses_size, len(config.device_mapping), *model_heads(config),
                          f"{role}.model_args")  # fmt: skip
        lora.check_lora_role(config, role, self.value_head)
        self.device = torch.device("cpu")
        self.global_step = 0
        self.model: Any = None
        self.router: moe.RouterLoss | None = None
        self.frozen: set[str] = set()
        """Names of the weights ``model_args.freeze_module_prefix`` froze (weight syncs send them once)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.tokenizer: Any = None
        self._offloaded_state: list[tuple[int, str, torch.device]] = []
        self._offloaded = False
        self.expert_mesh: ep.ExpertMesh | None = None
        """Expert parallelism (``ep_size`` > 1): this rank's place on the expert mesh (:mod:`.fsdp2_experts`)."""
        self.expert_names: set[str] = set()
        """Names of the expert parameters split over the ``ep`` ranks."""

    def _check_expert_parallel(self, config: WorkerConfig, prefix: str) -> None:
        """Expert parallelism with what it is built for: no LoRA."""
        if int(self.options.get("ep_size") or 1) == 1:
            return
        if config.model_args.lora:
            raise ValueError(f"{prefix}.ep_size with {self.role}.model_args.lora_target: LoRA with expert "
                             "parallelism is not built; train the adapters without ep_size.")  # fmt: skip

    # ---- setup ---------------------------------------------------------------------------------------------
    def notes(self) -> list[str]:
        """One line per accepted option that changes nothing here (logged at start-up)."""
        prefix = f"{self.role}.strategy_args.strategy_config"
        active = [key for key in HERE_ONLY_NOTES if self.options.get(key)]
        if self.options.get("offload_policy") and torch.cuda.is_available():
            active.remove("offload_policy")  # on CUDA it offloads
        notes = [f"{prefix}.{key}: true - {HERE_ONLY_NOTES[key]}." for key in active]
        experts = class_names((self.options.get("wrap_policy") or {}).get("moe_experts"))
        if self.options.get("moe_use_grouped_mm"):
            notes.append(f"{prefix}.moe_use_grouped_mm: true - {ep.GROUPED_MM_NOTE}.")
        if experts and int(self.options.get("ep_size") or 1) > 1:
            notes.append(f"{prefix}.wrap_policy.moe_experts: {experts} - with ep_size the stacked experts of every MoE "
                         "layer are sharded as units of their own over the expert mesh (efsdp_size), the rest of "
                         "the layer with it.")  # fmt: skip
        elif experts:
            notes.append(f"{prefix}.wrap_policy.moe_experts: {experts} - ROLL shards these expert modules as units of "
                         "their own only with apply_expert_patch or ep_size > 1 (neither is set), so they are sharded "
                         "with their layer, as in ROLL.")  # fmt: skip
        return notes

    def initialize(self) -> None:
        """Load fp32 master weights, shard them, and build AdamW and the LR schedule."""
        ensure_process_group()
        for note in self.notes():
            logger.warning(note)
        self.device = worker_device()
        args = self.config.model_args
        torch.manual_seed(self.config.training_args.seed)
        model = load_model(args, self.role, dtype=torch.float32, value_head=self.value_head)
        self.frozen = freeze_modules(model, args, self.role)
        if args.lora:  # adapters in fp32 (the only trained and optimized weights), the frozen base in compute dtype
            model = lora.apply_lora(model, args, self.role, TORCH_DTYPES[args.dtype], self.config.training_args.seed)
        self.router = moe.router_loss(model, self.config, self.role)
        apply_tiled_mlp(model, self.options)
        self._split_experts(model)
        self._setup_ulysses(model)
        if not args.disable_gradient_checkpointing:
            enable_activation_checkpointing(model)
        self.model = self._shard(model.to(self.device))
        # expert parallelism: dense and expert weights live on two meshes, which foreach kernels cannot mix
        foreach = False if self.expert_mesh is not None else None
        self.optimizer = build_optimizer(self.model.parameters(), self.config.training_args, foreach)
        self.scheduler = build_scheduler(self.optimizer, self.config.training_args, self.role)
        self.tokenizer = load_tokenizer(str(args.model_name_or_path))

    def _split_experts(self, model: Any) -> None:
        """With ``ep_size`` > 1: keep this rank's experts, route tokens over the ``ep`` group (fsdp2_experts)."""
        size = int(self.options.get("ep_size") or 1)
        if size == 1:
            return
        prefix = f"{self.role}.strategy_args.strategy_config"
        efsdp = ep.check_expert_options(self.options, dist.get_world_size(), prefix)[1]
        self.expert_mesh = ep.expert_mesh(size, efsdp, self.device.type)
        ep.split_experts(model, self.expert_mesh, prefix)
        self.expert_names = ep.expert_param_names(model)

    def _setup_ulysses(self, model: Any) -> None:
        """With ``ulysses_size`` > 1: check it against the world and the heads, build the groups, and give the
        model the ``ulysses`` attention around the kernel ``model_args`` asks for (flash on GPU, else sdpa)."""
        size = self.config.model_args.ulysses_size
        if size == 1:
            return
        config = model.config
        check_ulysses(size, dist.get_world_size(), config.num_attention_heads,
                      getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                      f"{self.role}.model_args")  # fmt: skip
        wanted = attention_kernel(self.config.model_args, self.role)
        self.ulysses_kernel = wanted if wanted and is_varlen(wanted) else "sdpa"
        register_attention()
        model.set_attn_implementation(ATTENTION)
        self.ulysses = new_groups(size)

    def _dtype_option(self, key: str, default: torch.dtype) -> torch.dtype:
        value = self.options.get(key)
        if value is None:
            return default
        if value not in DTYPE_ALIASES:
            raise ValueError(
                f"{self.role}.strategy_args.strategy_config.{key}={value!r}; use one of {sorted(DTYPE_ALIASES)}."
            )
        return DTYPE_ALIASES[value]

    def _shard(self, model: torch.nn.Module) -> Any:
        compute = TORCH_DTYPES[self.config.model_args.dtype]
        policy = MixedPrecisionPolicy(
            param_dtype=self._dtype_option("param_dtype", compute),
            reduce_dtype=self._dtype_option("reduce_dtype", torch.float32),
        )
        kwargs: dict[str, Any] = {
            "mp_policy": policy,
            "reshard_after_forward": bool(self.options.get("reshard_after_forward", True)),
            "mesh": self._device_mesh(),
        }
        if self.options.get("offload_policy") and self.device.type == "cuda":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        if self.expert_mesh is not None:  # first: their layers' units then leave them to the expert mesh
            for _, experts in ep.expert_modules(model):
                fully_shard(experts, **{**kwargs, "mesh": self.expert_mesh.shard_mesh})
        for module in self._wrap_targets(model):
            fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # sum over ranks (losses are already global shares); plain SUM, which gloo supports too
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def _device_mesh(self) -> Any:
        """1-D mesh over all ranks, or 2-D (replicate x shard, i.e. HSDP) when fsdp_size < world size."""
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        size = self._fsdp_size(world)
        if size == world:
            return init_device_mesh(self.device.type, (world,))
        return init_device_mesh(self.device.type, (world // size, size), mesh_dim_names=("replicate", "shard"))

    def _fsdp_size(self, world: int) -> int:
        """Ranks one model copy is sharded over (``fsdp_size``; unset or -1: all); must divide the world size."""
        size = self.options.get("fsdp_size") or world
        if size == -1:
            return world
        if size < 1 or world % size:
            raise ValueError(
                f"{self.role}.strategy_args.strategy_config.fsdp_size={size} must divide the role's world size "
                f"{world} (len({self.role}.device_mapping)); use -1 to shard over all ranks."
            )
        return int(size)

    def _wrap_targets(self, model: Any) -> list[Any]:
        """See :func:`rl_engines.strategies.fsdp2_wrap.wrap_units`."""
        return wrap_units(model, self.options.get("wrap_policy") or {}, f"{self.role}.strategy_args.strategy_config")

    # ---- forward -------------------------------------------------------------------------------------------
    def _outputs(
        self, batch: RolloutBatch, planner: MicroBatchPlanner, *, temperature: float, with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        if self.ulysses is not None:
            return ulysses_outputs(self.model, batch, self.device, self.ulysses, kernel=self.ulysses_kernel,
                                   value_head=self.value_head, temperature=temperature,
                                   with_entropy=with_entropy)  # fmt: skip
        return planner.forward(self.model, batch, self.device, value_head=self.value_head, temperature=temperature,
                               with_entropy=with_entropy)  # fmt: skip

    def _pooled(self, batch: RolloutBatch) -> tuple[RolloutBatch, slice]:
        """The Ulysses group's batches together, and this rank's rows in them (the batch itself without Ulysses)."""
        return gather_batch(batch, self.ulysses.group if self.ulysses is not None else None)

    @property
    def _counted(self) -> bool:
        """This rank's samples are its own: the first rank of a Ulysses group (its ranks pool their samples)."""
        return self.ulysses is None or self.ulysses.rank == 0

    @torch.no_grad()
    def _infer(self, batch: RolloutBatch, method: str, *, disable_adapter: bool = False, **kwargs: Any) -> RolloutBatch:
        self.reload()  # a colocated role may have offloaded us; computing needs the weights on the device
        self.model.eval()
        pooled, own = self._pooled(batch)
        plan = self.planners["infer"]
        with lora.adapters_off(self.model, self.role, disable_adapter):
            out = plan.map(pooled, lambda micro: self._outputs(micro, plan, **kwargs))
        metrics = plan.dynamic_batching_metrics(pass_name(self.role, method, disable_adapter), counted=self._counted)
        return RolloutBatch({key: value[own] for key, value in out.batch.items()},
                            meta_info={**batch.meta_info, "metrics": metrics})  # fmt: skip

    # ---- training ------------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch, objective: Objective) -> dict[str, float]:
        """One optimizer step per mini-batch of ``per_device_train_batch_size x gradient_accumulation_steps``.

        ``batch`` is this rank's shard; every rank must hold the same number of samples. Returns metrics
        summed over ranks: loss values equal the full mini-batch loss, plus ``grad_norm`` and ``lr``.
        """
        check_objective(self.role, objective, self.value_head)
        pooled, _ = self._pooled(batch)
        size = self.config.model_args.ulysses_size
        _, minibatch = check_minibatch(
            self.role, len(pooled), self.config.training_args,
            per="per rank" if size == 1 else f"per Ulysses group (pooled over ulysses_size={size} ranks)",
            dp_note="" if size == 1 else " (world size / ulysses_size)",
        )  # fmt: skip
        self.reload()
        self.model.train()
        metrics = run_minibatches(pooled, self.planners["train"].split, minibatch, self.scheduler,
                                  lambda micros, sums: self._optimizer_step(micros, objective, sums))  # fmt: skip
        name = pass_name(self.role, "train_step")
        return {**metrics, **self.planners["train"].dynamic_batching_metrics(name, counted=self._counted)}

    def _optimizer_step(self, micros: list[RolloutBatch], objective: Objective, metrics: MetricAccumulator) -> float:
        assert self.optimizer is not None
        # under Ulysses the ranks of a group hold the same samples: count them, and their metrics, once
        info = minibatch_info(micros, self.ulysses.data_group if self.ulysses is not None else None)
        self.optimizer.zero_grad(set_to_none=True)
        # router loss: a Ulysses group's ranks each add their slice's share, so its micro-batches count once
        weight = moe.micro_weight(self.router, len(micros), self.ulysses.data_group if self.ulysses else None)
        for index, micro in enumerate(micros):
            self.model.set_requires_gradient_sync(index == len(micros) - 1)  # reduce-scatter once per step
            with moe.recording(self.router):
                outputs = self._outputs(micro, self.planners["train"], temperature=objective.temperature,
                                        with_entropy=objective.needs_entropy)  # fmt: skip
            loss, values = objective(outputs, micro, info)
            values = MetricAccumulator.reported(values, self._counted)
            loss = moe.with_router_loss(self.router, loss, weight, values)
            loss.backward()  # type: ignore[no-untyped-call]
            metrics.add(values, token_share(micro, info))
        metrics.end_minibatch()
        norm_value = self._clip_gradients(self.config.training_args.max_grad_norm)
        if math.isfinite(norm_value):
            self.optimizer.step()  # a non-finite norm skips the update (as DeepSpeed does) and is reported
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        return norm_value

    def _clip_gradients(self, max_norm: float | None) -> float:
        """The global gradient norm, and the gradients clipped to ``max_norm`` (None / 0: not clipped)."""
        if self.expert_mesh is None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm else math.inf)
            return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        replicas = dist.get_world_size() // self._fsdp_size(dist.get_world_size())
        norm_value = ep.grad_norm(self.model, self.expert_names, replicas, self.expert_mesh)
        ep.clip_gradients(self.model, norm_value, max_norm)
        return norm_value

    # ---- weights -------------------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in HF names, one tensor at a time (each an all-gather: every rank must iterate); with LoRA
        the base model's weights with the adapters merged in (what an engine without adapters loads).

        An offloaded model is brought back for the iteration (nccl gathers device tensors) and offloaded again.
        """
        weights = self._full_weights()
        yield from (
            lora.merged_weights(weights, self.config.model_args.lora_scale) if self.config.model_args.lora else weights
        )

    def transformers_model(self) -> Any:
        """The transformers model trained (inside peft's wrapper with LoRA): its weight conversions name synced
        weights as a model folder does (:func:`rl_engines.strategies.model_io.in_checkpoint_names`)."""
        return self.model

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the adapters alone under PEFT's file names (``...q_proj.lora_A.weight``); a collective as above."""
        lora.require_lora(self.config, self.role)
        return lora.adapter_weights(self._full_weights())

    def _full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        was_offloaded = self._offloaded
        self.reload()
        try:
            yield from self._iter_full_weights()
        finally:
            if was_offloaded:
                self.offload()

    def _iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        tied: dict[int, list[str]] = {}
        state = self.model.state_dict(keep_vars=True)
        for name, value in state.items():
            tied.setdefault(id(value), []).append(name)  # tied weights share one DTensor: gather it once
        for names in tied.values():
            value = state[names[0]]
            full = _unsharded(value).detach()
            if names[0] in self.expert_names and self.expert_mesh is not None:
                full = ep.gather_experts(full, self.expert_mesh)
            for name in names:
                yield name, full

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Not supported: a train strategy's weights change only through training or load_checkpoint."""
        raise NotImplementedError(f"{self.role}: load weights through load_checkpoint")

    def save_checkpoint(self, path: str) -> None:
        """Atomically save model + optimizer (sharded, torch.distributed.checkpoint), schedule, step and RNG."""
        checkpointing.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` (any world size for model / optimizer)."""
        checkpointing.load(self, path)

    def save_hf(self, path: str) -> None:
        """A HuggingFace folder of the current weights (rank 0 writes; every rank must call)."""
        checkpointing.save_hf(self, path)

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory (no-op on CPU devices)."""
        if self.device.type != "cpu" and not self._offloaded:
            self._offloaded = True
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()  # drop all-gathered parameters a forward left behind (the root keeps them)
            self.model.to("cpu")  # FSDP2 moves its sharded parameters with Module.to (same Parameter objects)
            if self.optimizer is not None:
                self._offloaded_state = offload_optimizer_state(self.optimizer)
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring offloaded state back to the device."""
        if self._offloaded:
            self._offloaded = False
            self.model.to(self.device)
            if self.optimizer is not None:
                reload_optimizer_state(self.optimizer, self._offloaded_state)
                self._offloaded_state = []


def _unsharded(value: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly) sharded parameter; a world of one needs no all-gather (and no copy)."""
    if not isinstance(value, DTensor):
        return value
    if value.device_mesh.size() == 1:
        return value.to_local()
    return value.full_tensor()

"""``deepspeed_train``: ROLL's DeepSpeed train strategy (ZeRO stages 0-3, CPU offload), on CPU (gloo) and GPU.

The same TrainStrategy surface as ``fsdp2_train`` and the same numbers: AdamW and the LR schedule come from
``training_args`` (built by train_utils, so both strategies step identically), gradients are clipped with
``max_grad_norm`` and the norm is reported before clipping, a non-finite norm skips the update, and the schedule
advances on every step (the reported ``lr`` is the one applied). ``strategy_config`` is described in
:mod:`rl_engines.strategies.deepspeed_config`.

Gradient semantics: each micro-batch loss is its share of the whole mini-batch loss (rl-core GlobalBatchInfo), so
gradients must be *summed* over DP ranks and accumulation steps. DeepSpeed averages over DP ranks (it multiplies
the reduced gradient by ``1 / dp_world_size`` whatever ``gradient_predivide_factor`` says) and divides by
``gradient_accumulation_steps`` inside ``backward``; the strategy calls ``backward(loss * dp_world_size,
scale_wrt_gas=False)``, which undoes both: exact when the world size is a power of two, otherwise within two
float roundings (~1e-7 relative; DeepSpeed multiplies by a rounded ``1 / dp_world_size``). The strategy marks
the accumulation boundary itself, so one ``engine.step()`` ends each mini-batch.

DeepSpeed is imported only inside methods; this module imports (and registers) without it installed.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfig
from rl_engines.objectives import Objective
from rl_engines.strategies import deepspeed_state, lora, moe
from rl_engines.strategies.base import STRATEGIES, ensure_process_group, require_engine_package, worker_device
from rl_engines.strategies.deepspeed_config import ZERO_STAGE_KEY, finalize_deepspeed_config, resolve_strategy_config
from rl_engines.strategies.deepspeed_offload import OffloadRecord, offload_engine, reload_engine
from rl_engines.strategies.micro_batches import MicroBatchPlanner, pass_name, planner, require_no_ulysses
from rl_engines.strategies.model_io import (
    TORCH_DTYPES,
    enable_activation_checkpointing,
    freeze_modules,
    load_model,
    load_tokenizer,
)
from rl_engines.strategies.train_utils import (
    MetricAccumulator,
    TrainScoring,
    build_optimizer,
    build_scheduler,
    check_minibatch,
    check_objective,
    minibatch_info,
    run_minibatches,
    token_share,
)


def import_deepspeed() -> Any:
    """Import DeepSpeed for a worker: the CPU accelerator when there is no GPU, and, on CPU, torch.distributed
    (gloo) for its collectives instead of its shared-memory all-reduce op (a ~40 s JIT build per process)."""
    require_engine_package("deepspeed", "deepspeed_train", "deepspeed")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    return deepspeed


@STRATEGIES.register("deepspeed_train")
class DeepSpeedTrainStrategy(TrainScoring):
    """Train one role's model with a DeepSpeed engine over all ranks of the worker's process group."""

    kind = "train"
    lora: str | None = "adapters"
    """LoRA (``model_args.lora_target``): trains peft adapters (see :mod:`rl_engines.strategies.lora`)."""
    router_loss = True
    """Mixture-of-experts models: adds the router load-balancing loss (see :mod:`rl_engines.strategies.moe`)."""

    def __init__(self, config: WorkerConfig, role: str) -> None:
        self.config = config
        self.role = role
        self.prefix = f"{role}.strategy_args.strategy_config"
        self.ds_config = resolve_strategy_config(dict(config.strategy_args.strategy_config), self.prefix)
        self.zero_stage = int(self.ds_config[ZERO_STAGE_KEY]["stage"])
        if self.zero_stage == 0 and config.model_args.dtype != "fp32":
            raise ValueError(
                f"{self.prefix} selects ZeRO stage 0, which trains in fp32 only, but {role}.model_args.dtype="
                f"{config.model_args.dtype!r}. Use ZeRO stage >= 1 for bf16 / fp16 (its optimizer keeps fp32 master "
                "weights, as fsdp2_train does; ROLL's deepspeed_train requires stage >= 1) or model_args.dtype: fp32."
            )
        require_no_ulysses(config, role, "deepspeed_train")
        self.planners = {phase: planner(config, role, phase) for phase in ("train", "infer")}
        self.value_head = role == "critic" or config.model_args.model_type in ("critic", "trl")
        lora.check_lora_role(config, role, self.value_head)
        self.device = torch.device("cpu")
        self.global_step = 0
        self.engine: Any = None
        self.router: moe.RouterLoss | None = None
        self.frozen: set[str] = set()
        """Names of the weights ``model_args.freeze_module_prefix`` froze (weight syncs send them once)."""
        self.scheduler: Any = None
        self.tokenizer: Any = None
        self._offloaded: OffloadRecord | None = None

    # ---- setup ---------------------------------------------------------------------------------------------
    def initialize(self) -> None:
        """Load fp32 weights, build AdamW and the LR schedule, and hand them to ``deepspeed.initialize``."""
        ensure_process_group()
        os.environ.setdefault("LOCAL_RANK", "0")  # as WorkerGroup sets it: a worker sees only its own devices
        deepspeed = import_deepspeed()
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        self.device = worker_device()
        args = self.config.model_args
        torch.manual_seed(self.config.training_args.seed)
        model = load_model(args, self.role, dtype=torch.float32, value_head=self.value_head)
        self.frozen = freeze_modules(model, args, self.role)
        if args.lora:  # adapters (fp32 masters in the optimizer) train; DeepSpeed casts the module to dtype
            model = lora.apply_lora(model, args, self.role, TORCH_DTYPES[args.dtype], self.config.training_args.seed)
        self.router = moe.router_loss(model, self.config, self.role)
        if not args.disable_gradient_checkpointing:
            enable_activation_checkpointing(model)
        ds_config = self._engine_config()
        optimizer = build_optimizer(model.parameters(), self.config.training_args)
        self.scheduler = build_scheduler(optimizer, self.config.training_args, self.role)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )
        self.tokenizer = load_tokenizer(str(args.model_name_or_path))

    def _engine_config(self) -> dict[str, Any]:
        dtype = self.config.model_args.dtype
        config = finalize_deepspeed_config(
            self.ds_config, self.config.training_args, dtype=dtype, world_size=dist.get_world_size(),
            prefix=self.prefix, pin_memory=self.device.type == "cuda",
        )  # fmt: skip
        if dtype == "bf16":
            config["bf16"].setdefault("check_grad_overflow", True)  # a non-finite norm skips the step, as in fp32
        if self.zero_stage == 0:
            config["gradient_clipping"] = 0.0  # the strategy clips (DeepSpeed would, without reporting the norm)
        return config

    @property
    def fp32_masters(self) -> bool:
        """Whether the module runs in low precision and the optimizer keeps separate fp32 master weights."""
        return self.config.model_args.dtype != "fp32"

    # ---- forward -------------------------------------------------------------------------------------------
    def _outputs(
        self, batch: RolloutBatch, planner: MicroBatchPlanner, *, temperature: float, with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        return planner.forward(self.engine, batch, self.device, value_head=self.value_head, temperature=temperature,
                               with_entropy=with_entropy)  # fmt: skip

    @torch.no_grad()
    def _infer(self, batch: RolloutBatch, method: str, *, disable_adapter: bool = False, **kwargs: Any) -> RolloutBatch:
        self.reload()
        self.engine.eval()
        plan = self.planners["infer"]
        with lora.adapters_off(self.engine.module, self.role, disable_adapter):
            out = plan.map(batch, lambda micro: self._outputs(micro, plan, **kwargs))
        out.meta_info["metrics"] = plan.dynamic_batching_metrics(pass_name(self.role, method, disable_adapter))
        return out

    # ---- training ------------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch, objective: Objective) -> dict[str, float]:
        """One optimizer step per mini-batch of ``per_device_train_batch_size x gradient_accumulation_steps``.

        ``batch`` is this rank's shard; every rank must hold the same number of samples. Returns metrics summed
        over ranks (loss values equal the full mini-batch loss) plus ``grad_norm``, ``lr`` and ``skipped_steps``.
        """
        check_objective(self.role, objective, self.value_head)
        _, minibatch = check_minibatch(self.role, len(batch), self.config.training_args,
                                       dp_note=" (DeepSpeed's train_batch_size)")  # fmt: skip
        self.reload()
        self.engine.train()
        metrics = run_minibatches(batch, self.planners["train"].split, minibatch, self.scheduler,
                                  lambda micros, sums: self._optimizer_step(micros, objective, sums))  # fmt: skip
        return {**metrics, **self.planners["train"].dynamic_batching_metrics(pass_name(self.role, "train_step"))}

    def _optimizer_step(self, micros: list[RolloutBatch], objective: Objective, metrics: MetricAccumulator) -> float:
        info = minibatch_info(micros)
        rank_sum = float(dist.get_world_size())  # DeepSpeed averages over DP ranks; the losses want a sum
        weight = moe.micro_weight(self.router, len(micros))
        for index, micro in enumerate(micros):
            self.engine.set_gradient_accumulation_boundary(index == len(micros) - 1)
            with moe.recording(self.router):
                outputs = self._outputs(micro, self.planners["train"], temperature=objective.temperature,
                                        with_entropy=objective.needs_entropy)  # fmt: skip
            loss, values = objective(outputs, micro, info)
            loss = moe.with_router_loss(self.router, loss, weight, values)
            self.engine.backward(loss * rank_sum, scale_wrt_gas=False)
            metrics.add(values, token_share(micro, info))
        metrics.end_minibatch()
        norm = self._clipped_step()
        self.scheduler.step()
        self.global_step += 1
        return norm

    def _clipped_step(self) -> float:
        """``engine.step()`` unless the gradient norm (before clipping; returned) is not finite."""
        if self.zero_stage > 0:
            self.engine.step()  # ZeRO's optimizer clips, reports the norm and skips a non-finite step
            norm = self.engine.get_global_grad_norm()
            return math.nan if norm is None else float(norm)
        max_norm = self.config.training_args.max_grad_norm
        params = list(self.engine.module.parameters())
        norm_value = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else math.inf))
        if math.isfinite(norm_value):
            self.engine.step()
        else:
            self.engine.zero_grad()
        return norm_value

    # ---- weights -------------------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in HF names (fp32 masters when training in bf16 / fp16); every rank must iterate. With LoRA
        the base model's weights with the adapters merged in (what an engine without adapters loads)."""
        args = self.config.model_args
        weights = self.full_weights()
        yield from lora.merged_weights(weights, args.lora_scale) if args.lora else weights

    def transformers_model(self) -> Any:
        """The transformers model trained (inside peft's wrapper with LoRA): its weight conversions name synced
        weights as a model folder does (:func:`rl_engines.strategies.model_io.in_checkpoint_names`)."""
        return self.engine.module

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the adapters alone under PEFT's file names (``...q_proj.lora_A.weight``); a collective as above."""
        lora.require_lora(self.config, self.role)
        return lora.adapter_weights(self.full_weights())

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's own full weights (peft's names with LoRA); a collective."""
        was_offloaded = self._offloaded is not None
        self.reload()
        try:
            yield from deepspeed_state.iter_full_weights(self.engine.module, fp32_masters=self.fp32_masters)
        finally:
            if was_offloaded:
                self.offload()

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Not supported: a train strategy's weights change only through training or load_checkpoint."""
        raise NotImplementedError(f"{self.role}: load weights through load_checkpoint")

    def save_checkpoint(self, path: str) -> None:
        """Atomically save the DeepSpeed engine checkpoint, schedule, step and RNG (a collective)."""
        deepspeed_state.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` at the same world size and ZeRO stage."""
        deepspeed_state.load(self, path)

    def save_hf(self, path: str) -> None:
        """A HuggingFace folder of the current (fp32) weights; rank 0 writes, every rank must call."""
        deepspeed_state.save_hf(self, path)

    def offload(self) -> None:
        """Free the device for a colocated role (see :mod:`deepspeed_offload`).

        A no-op when the device is the CPU (nothing to free) and with ``offload_param`` (ZeRO-3 keeps parameters
        and optimizer state in host memory already).
        """
        if self.device.type == "cpu" or self._offloaded is not None or self._params_on_host():
            return
        self._offloaded = offload_engine(self.engine, self.zero_stage)
        torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring what :meth:`offload` moved back to the device."""
        if self._offloaded is not None:
            record, self._offloaded = self._offloaded, None
            reload_engine(self.engine, self.zero_stage, record, self.device)

    def _params_on_host(self) -> bool:
        section = self.ds_config[ZERO_STAGE_KEY].get("offload_param") or {}
        return section.get("device", "none") not in ("none", None)

"""Micro-batch planning, one home for every train and log-prob path: which samples go through the model together,
and in which layout.

Three plans (ROLL's keys, per worker):

- *fixed*: micro-batches of a fixed number of samples (``training_args.per_device_train_batch_size`` in training,
  ``infer_batch_size`` in log-prob / value passes), every one as wide as the batch.
- *token budget* (``use_dynamic_batching_in_train`` / ``_in_infer``): the samples are sorted by length (prompt and
  response) and grouped while ``samples x width`` stays within ``max_tokens_per_microbatch_in_*``, the width (the
  longest sample) rounded up to a multiple of ``sequence_length_round_in_*`` (ROLL's rule). Each micro-batch then
  runs a row per sample, its real tokens from column 0 and the padding after them (layout *aligned*, ROLL's
  right-padded layout; :func:`rl_engines.strategies.packing.pack` with ``per_sample``), so memory per micro-batch
  is bounded by the budget and short samples stop paying for the longest. A batch that cannot be laid out so (a
  vision-language batch, whose pictures' positions follow the padded rows; one with a sample without a prompt
  token) is planned by the width of a pass without its padding columns (layout *trimmed*: prompts stay left-padded
  and responses right-padded, so the longest prompt plus the longest response), and each micro-batch holding such
  a sample runs that way (the others, narrower, a row per sample).
- *load balance* (``use_sequence_packing`` with ``sequence_packing_args.algorithm: load_balance``): as many
  micro-batches as the tokens need (their sum, each length rounded up to 16 as ROLL does, over
  ``max_packed_sequence_length_*``, at least ``min_num_micro_batches_*``, at most one per sample, the largest count
  over the data-parallel ranks), the samples spread over them by work with Karmarkar-Karp
  (:func:`rl_engines.strategies.packing.balanced_partitions`), ordered light-heavy-light as ROLL does. With
  ``algorithm: none`` packing keeps the fixed plan. Dynamic batching, when also on, decides the plan (as in ROLL).

With a token budget the planner also counts what its passes cost (ROLL's ``dynamic_batching/<role>/<method>/*``
metrics, :meth:`MicroBatchPlanner.dynamic_batching_metrics`).

Four layouts a micro-batch runs in: *padded* (as the batch is), *aligned* or *trimmed* (dynamic batching, above)
and *packed* (``use_sequence_packing`` or ``use_remove_padding``: one row of real tokens, see
:mod:`rl_engines.strategies.packing`).

A training step keeps its mini-batches as they are (``per_device_train_batch_size x gradient_accumulation_steps``
samples per rank, one optimizer step each): only how a mini-batch is cut into forward/backward passes changes, and
the loss of each pass is its share of the mini-batch's loss (rl-core's ``GlobalBatchInfo``), so the update equals the
padded one up to fp32 summation order. Ranks of a data-parallel group must run the same number of passes (FSDP and
ZeRO gather parameters inside each), so the count is agreed over the group and a rank with fewer micro-batches splits
its largest ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rl_core.batch import RolloutBatch
from rl_core.seqlen_balance import workload
from rl_engines.config import WorkerConfig
from rl_engines.strategies.model_io import (
    forward_outputs,
    kept_columns,
    response_length,
    widen,
    without_padding_columns,
)
from rl_engines.strategies.packing import (
    PackedBatch,
    aligned_width,
    balanced_partitions,
    can_pack,
    pack,
    packed_outputs,
)
from rl_engines.strategies.train_utils import all_reduce_sum
from rl_engines.vision import is_visual, is_vl_model

logger = logging.getLogger(__name__)

Phase = str
"""``"train"`` (train_step's forward/backward passes) or ``"infer"`` (log-prob and value passes)."""


@dataclass(frozen=True)
class TokenBudget:
    """ROLL's dynamic batching of one phase: at most ``max_tokens`` (padded) tokens per micro-batch, lengths rounded
    up to a multiple of ``round_to``. ``key`` is the budget's config key, named by errors."""

    max_tokens: int
    round_to: int
    key: str

    def rounded(self, length: int) -> int:
        """``length`` rounded up to a multiple of ``round_to`` (at least ``round_to``)."""
        return max(-(-length // self.round_to), 1) * self.round_to


def token_budget(config: WorkerConfig, role: str, phase: Phase) -> TokenBudget | None:
    """The phase's budget when ``use_dynamic_batching_in_<phase>`` is on, else None (fixed micro-batches)."""
    if not getattr(config, f"use_dynamic_batching_in_{phase}"):
        return None
    max_tokens = getattr(config, f"max_tokens_per_microbatch_in_{phase}")
    return TokenBudget(int(max_tokens), int(getattr(config, f"sequence_length_round_in_{phase}")),
                       f"{role}.max_tokens_per_microbatch_in_{phase}")  # fmt: skip


@dataclass(frozen=True)
class LoadBalance:
    """ROLL's ``load_balance`` packing of one phase: micro-batch count from ``max_tokens`` (``key`` names it) and
    ``min_count`` (``min_key``)."""

    max_tokens: int
    min_count: int
    key: str
    min_key: str


PACKING_ROUND = 16
"""ROLL rounds each length up to a multiple of 16 when it counts a packed micro-batch's tokens and work."""


def load_balance(config: WorkerConfig, role: str, phase: Phase) -> LoadBalance | None:
    """The phase's load-balance plan when ``use_sequence_packing`` with ``algorithm: load_balance``, else None."""
    args = config.sequence_packing_args
    if not config.use_sequence_packing or args.algorithm != "load_balance":
        return None
    name = "train" if phase == "train" else "forward"
    key = f"{role}.sequence_packing_args.max_packed_sequence_length_{name}"
    max_tokens = getattr(args, f"max_packed_sequence_length_{name}")
    if max_tokens is None:
        raise ValueError(f"{key} is not set; sequence_packing_args.algorithm: load_balance needs it (the tokens of "
                         "one packed micro-batch, at least prompt_length + response_length).")  # fmt: skip
    min_key = f"{role}.sequence_packing_args.min_num_micro_batches_{name}"
    return LoadBalance(int(max_tokens), int(getattr(args, f"min_num_micro_batches_{name}")), key, min_key)


def plan_load_balance(
    lengths: Sequence[int], plan: LoadBalance, group: dist.ProcessGroup | None, *, agree: bool
) -> list[list[int]]:
    """Sample indices per micro-batch under ``plan`` (see the module docstring); raises naming ``plan.key`` when
    one sample is longer than ``max_tokens``."""
    rounded = [-(-length // PACKING_ROUND) * PACKING_ROUND for length in lengths]
    if max(lengths) > plan.max_tokens:
        raise ValueError(f"{plan.key}={plan.max_tokens} is shorter than a sample of {max(lengths)} tokens; raise it "
                         "to at least prompt_length + response_length.")  # fmt: skip
    if plan.min_count > len(lengths):
        raise ValueError(f"{plan.min_key}={plan.min_count} asks for more micro-batches than the {len(lengths)} "
                         f"samples a pass plan has here (a micro-batch holds at least one sample); lower it to at "
                         f"most {len(lengths)}.")  # fmt: skip
    count = max(min(max(1, -(-sum(rounded) // plan.max_tokens)), len(lengths)), plan.min_count)
    if agree:
        count = agreed_count(count, group)
    work = [workload(length) for length in rounded]
    parts = balanced_partitions(work, min(count, len(lengths)))
    parts.sort(key=lambda part: (sum(work[i] for i in part), part[0]), reverse=True)
    return parts[::2][::-1] + parts[1::2]  # light ones at both ends (pipeline bubbles), as ROLL orders them


def sequence_spans(batch: RolloutBatch) -> list[tuple[int, int]]:
    """``(prompt, response)`` columns each sample spans: from its first real prompt token to the prompt's end (left
    padding), and from the response's start to its last real token (right padding). A pass without padding columns
    is as wide as its samples' longest prompt plus their longest response."""
    mask = batch.batch["attention_mask"].to(torch.bool)
    prompts = mask.shape[1] - response_length(batch)
    columns = torch.arange(mask.shape[1])
    first = torch.where(mask, columns, mask.shape[1]).min(dim=1).values
    last = torch.where(mask, columns, -1).max(dim=1).values
    prompt = (prompts - first).clamp(min=0, max=prompts)
    response = (last + 1 - prompts).clamp(min=0)
    return list(zip(prompt.tolist(), response.tolist(), strict=True))


def plan_token_budget(
    spans: Sequence[tuple[int, int]], budget: TokenBudget, *, aligned: bool = True
) -> list[list[int]]:
    """Sample indices per micro-batch: ascending length, a new micro-batch whenever one more sample would make
    ``samples x width`` exceed the budget, the width being the longest sample (``aligned``, ROLL's rule) or the
    longest prompt plus the longest response (the trimmed layout), rounded. Raises naming ``budget.key`` when one
    sample alone does."""
    groups: list[list[int]] = []
    prompt = response = 0  # the current micro-batch's longest prompt and response (aligned: longest sample)
    for index in sorted(range(len(spans)), key=lambda i: sum(spans[i])):
        p, r = (0, sum(spans[index])) if aligned else spans[index]
        need = budget.rounded(p + r)
        if need > budget.max_tokens:
            raise ValueError(
                f"{budget.key}={budget.max_tokens} is smaller than one sample: {p + r} tokens, "
                f"{need} rounded to the sequence_length_round ({budget.round_to}). Raise it to at least "
                f"prompt_length + response_length rounded up (ROLL recommends sequence_length x 2 x micro_batch_size)."
            )
        width = budget.rounded(max(prompt, p) + max(response, r))
        if groups and (len(groups[-1]) + 1) * width <= budget.max_tokens:
            groups[-1].append(index)
            prompt, response = max(prompt, p), max(response, r)
        else:
            groups.append([index])
            prompt, response = p, r
    return groups


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest groups in two until there are ``count``; each part keeps its samples' order."""
    groups = [list(group) for group in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        group = groups[largest]
        if len(group) < 2:
            raise ValueError(f"cannot cut {sum(map(len, groups))} samples into {count} micro-batches")
        half = len(group) // 2
        groups[largest : largest + 1] = [group[:half], group[half:]]
    return groups


def agreed_count(count: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest ``count`` over the ranks of ``group`` (the data-parallel group; identity for one rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return count
    value = torch.tensor([count], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


@dataclass
class TokenCounts:
    """What the passes a planner laid out cost, in tokens (ROLL's dynamic-batching counts): ``valid`` real tokens,
    ``origin`` as the batches came (samples x batch width), ``actual`` as they ran (samples x width of each aligned
    or trimmed micro-batch; a packed one runs its real tokens)."""

    valid: int = 0
    origin: int = 0
    actual: int = 0


@dataclass
class MicroBatchPlanner:
    """Cuts a rank's batch into micro-batches for one phase (fixed ``size`` samples, by ``budget``, or by
    ``balance``) and runs them in their layout (``packed``; aligned or trimmed with a budget; else padded).

    ``group`` is the data-parallel process group whose ranks must agree on the number of micro-batches (only with
    a budget or a balance, and only when ``agree`` is set: a train step's passes run collectives, an inference pass
    of an unsharded model does not).
    """

    size: int
    budget: TokenBudget | None = None
    balance: LoadBalance | None = None
    packed: bool = False
    group: dist.ProcessGroup | None = None
    agree: bool = True
    counts: TokenCounts = field(default_factory=TokenCounts)

    def layout(self, batch: RolloutBatch) -> str:
        """How ``batch``'s micro-batches run: ``packed``, ``aligned`` (a row per sample, padding after its tokens:
        dynamic batching), ``trimmed`` (padding columns removed: dynamic batching of a batch that cannot be
        aligned, see the module docstring) or ``padded``."""
        if self.packed:
            return "packed"
        if self.budget is None:
            return "padded"
        return "aligned" if not is_visual(batch) and can_pack(batch) else "trimmed"

    @property
    def round_to(self) -> int:
        """The width multiple of an aligned or trimmed micro-batch (``sequence_length_round_in_<phase>``)."""
        return self.budget.round_to if self.budget is not None else 1

    def plan(self, batch: RolloutBatch) -> list[list[int]]:
        """Sample indices of each micro-batch (with a token budget, their tokens counted in ``counts``)."""
        if self.budget is not None:
            groups = plan_token_budget(sequence_spans(batch), self.budget, aligned=self.layout(batch) != "trimmed")
            groups = split_to_count(groups, agreed_count(len(groups), self.group)) if self.agree else groups
            self._count(batch, groups)
            return groups
        if self.balance is not None:
            lengths = batch.batch["attention_mask"].sum(dim=1).tolist()
            return plan_load_balance(lengths, self.balance, self.group, agree=self.agree)
        return [list(range(start, min(start + self.size, len(batch)))) for start in range(0, len(batch), self.size)]

    def _count(self, batch: RolloutBatch, groups: list[list[int]]) -> None:
        mask = batch.batch["attention_mask"]
        self.counts.valid += int(mask.sum())
        self.counts.origin += mask.numel()
        for group in groups:
            layout = self.layout(batch.index(group))  # as forward / runs decide it for the micro-batch
            if layout == "packed":
                self.counts.actual += int(mask[group].sum())
            elif layout == "aligned":
                width = aligned_width(int(mask[group].sum(dim=1).max()), self.round_to, mask.shape[1])
                self.counts.actual += len(group) * width
            else:
                start, end = kept_columns(mask[group], response_length(batch), self.round_to)
                self.counts.actual += len(group) * (end - start)

    def dynamic_batching_metrics(self, name: str, *, counted: bool = True) -> dict[str, float]:
        """ROLL's ``dynamic_batching/<name>/*`` (``valid_tokens``, ``actual_tokens_origin``, ``actual_tokens``,
        ``removed_padding_tokens``, ``removed_padding_ratio``) of the passes planned since the last call, summed over
        the ranks of the role; {} without a token budget. ``counted``: this rank's samples are its own, not a copy
        that a model-parallel or Ulysses peer counts. Every rank of the role calls it together (an all-reduce)."""
        if self.budget is None:
            return {}
        counts, self.counts = self.counts, TokenCounts()
        local = torch.tensor([counts.valid, counts.origin, counts.actual], dtype=torch.float64) * float(counted)
        valid, origin, actual = all_reduce_sum(local).tolist()
        prefix = f"dynamic_batching/{name}"
        return {f"{prefix}/valid_tokens": valid, f"{prefix}/actual_tokens_origin": origin,
                f"{prefix}/actual_tokens": actual, f"{prefix}/removed_padding_tokens": origin - actual,
                f"{prefix}/removed_padding_ratio": (origin - actual) / origin if origin else 0.0}  # fmt: skip

    def split(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """The micro-batches themselves (every column kept; :meth:`forward` / :meth:`runs` lay them out)."""
        return [batch.index(indices) for indices in self.plan(batch)]

    def forward(self, model: nn.Module, micro: RolloutBatch, device: torch.device, *, value_head: bool,
                temperature: float, with_entropy: bool) -> dict[str, torch.Tensor]:  # fmt: skip
        """The model's outputs on ``micro`` in this planner's layout, ``[B, R]`` each (see model_io)."""
        layout = self.layout(micro)
        if layout in ("packed", "aligned"):
            return packed_outputs(model, micro, device, value_head=value_head, temperature=temperature,
                                  with_entropy=with_entropy, round_to=self.round_to if layout == "aligned" else 1,
                                  per_sample=layout == "aligned")  # fmt: skip
        run = without_padding_columns(micro, self.round_to) if layout == "trimmed" else micro
        outputs = forward_outputs(model, run, device, value_head=value_head, temperature=temperature,
                                  with_entropy=with_entropy)  # fmt: skip
        return widen(outputs, response_length(micro))

    def runs(self, micros: list[RolloutBatch]) -> list[RolloutBatch | PackedBatch]:
        """What the model runs for each micro-batch, for strategies that drive the forward themselves (Megatron's
        pipeline schedule): packed (one row, or a row per sample: aligned), trimmed or as it is."""
        if self.packed:
            for micro in micros:
                _refuse_visual(micro)
            return [pack(m) for m in micros]
        layouts = [self.layout(m) for m in micros]
        return [pack(m, self.round_to, per_sample=True) if layout == "aligned"
                else without_padding_columns(m, self.round_to) if layout == "trimmed" else m
                for m, layout in zip(micros, layouts, strict=True)]  # fmt: skip

    def map(self, batch: RolloutBatch, forward: Callable[[RolloutBatch], dict[str, torch.Tensor]]) -> RolloutBatch:
        """``forward`` on each micro-batch; outputs concatenated on the CPU in the batch's own sample order."""
        plan = self.plan(batch)
        parts = [forward(batch.index(indices)) for indices in plan]
        return RolloutBatch(in_batch_order(parts, plan), meta_info=dict(batch.meta_info))


def _refuse_visual(batch: RolloutBatch) -> None:
    if is_visual(batch):
        raise ValueError(
            "use_sequence_packing: a vision-language batch reached a strategy that drives its own packed forward "
            "(Megatron), which does not take pictures; use fsdp2_train or deepspeed_train for this role."
        )


def pass_name(role: str, method: str, disable_adapter: bool = False) -> str:
    """A pass's name in ROLL's ``dynamic_batching/<name>/*`` metrics: ``<role>/<method>``; a LoRA actor's pass with
    its adapters off is the reference's (``reference/compute_log_probs``)."""
    return f"{'reference' if disable_adapter else role}/{method}"


def in_batch_order(parts: list[dict[str, torch.Tensor]], plan: list[list[int]]) -> dict[str, torch.Tensor]:
    """The micro-batches' outputs (``parts``, in ``plan`` order) concatenated on the CPU in the batch's order."""
    order = torch.tensor([i for indices in plan for i in indices], dtype=torch.long)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return {key: torch.cat([part[key].cpu() for part in parts])[inverse] for key in parts[0]}


def planner(
    config: WorkerConfig, role: str, phase: Phase, group: dist.ProcessGroup | None = None, *, agree: bool = True
) -> MicroBatchPlanner:
    """The role's planner for ``phase``: fixed micro-batches of per_device_train_batch_size (train) or
    infer_batch_size (infer), the token budget of ``use_dynamic_batching_in_<phase>`` or the load balance of
    ``use_sequence_packing``; packed with ``use_sequence_packing`` / ``use_remove_padding`` / Ulysses. ``agree``: the
    strategy's passes run collectives (sharded parameters), so the ranks of ``group`` agree on their count."""
    size = config.training_args.per_device_train_batch_size if phase == "train" else config.infer_batch_size
    packed = config.use_sequence_packing or config.use_remove_padding or config.model_args.ulysses_size > 1
    return MicroBatchPlanner(size, token_budget(config, role, phase), load_balance(config, role, phase), packed,
                             group, agree=agree)  # fmt: skip


def require_fixed_micro_batches(config: WorkerConfig, role: str, strategy: str) -> None:
    """For a generation engine that batches by itself (vLLM, SGLang): refuse ``use_dynamic_batching_in_infer``,
    ``use_sequence_packing`` and ``use_remove_padding`` naming the key (``use_dynamic_batching_in_train``: see
    :func:`note_training_budget_unused`)."""
    require_no_ulysses(config, role, strategy)
    note_training_budget_unused(config, role, strategy)
    for key in ("use_dynamic_batching_in_infer", "use_sequence_packing", "use_remove_padding"):
        if getattr(config, key):
            raise ValueError(
                f"{role}.{key} is set, but {strategy} schedules its own batches; dynamic batching and packing apply "
                "to the log-prob and training passes of fsdp2_train, deepspeed_train, megatron_train, "
                "megatron_infer and hf_infer. Set it to false for this role."
            )


def require_no_ulysses(config: WorkerConfig, role: str, strategy: str) -> None:
    """Ulysses sequence parallelism is fsdp2's: refuse ``model_args.ulysses_size`` > 1 naming the key."""
    size = config.model_args.ulysses_size
    if size > 1:
        raise ValueError(
            f"{role}.model_args.ulysses_size={size}: {strategy} has no Ulysses sequence parallelism; it runs in "
            "fsdp2_train and fsdp2_infer (Megatron splits sequences with context_parallel_size). Set it to 1."
        )


def require_text_inference(config: WorkerConfig, role: str, strategy: str) -> None:
    """An engine that serves text models only (vLLM, SGLang here): refuse a vision-language model (its prompts'
    pictures would not reach the engine) and ``freeze_module_prefix`` (an inference role trains nothing), naming
    the key."""
    path = config.model_args.model_name_or_path
    if path is not None and is_vl_model(str(path)):
        raise ValueError(
            f"{role}.model_args.model_name_or_path={path!r} is a vision-language model; the {strategy} adapter does "
            f"not pass prompts' images to the engine yet. Use strategy_name: hf_infer for {role}."
        )
    if config.model_args.frozen_prefixes():
        raise ValueError(f"{role}.model_args.freeze_module_prefix is set, but {role} does not train ({strategy}); "
                         "set it on the training role (actor_train) only.")  # fmt: skip


def require_no_training(config: WorkerConfig, role: str, strategy: str) -> None:
    """An inference strategy has no training passes: refuse ``model_args.freeze_module_prefix`` naming the key
    (``use_dynamic_batching_in_train``: see :func:`note_training_budget_unused`)."""
    if config.model_args.frozen_prefixes():
        raise ValueError(f"{role}.model_args.freeze_module_prefix is set, but {role} does not train ({strategy}); "
                         "set it on the training role (actor_train) only.")  # fmt: skip
    note_training_budget_unused(config, role, strategy)


def note_training_budget_unused(config: WorkerConfig, role: str, strategy: str) -> None:
    """``use_dynamic_batching_in_train`` on a role that does not train: it cuts training passes, and this role has
    none, so it changes nothing; ROLL's inference workers ignore it too, and ROLL's own files set it on such roles
    (examples/agentic_deepeyes/deepeyes.yaml: the megatron_infer reference). Accepted, and logged."""
    if config.use_dynamic_batching_in_train:
        logger.warning(
            "[engines] %s.use_dynamic_batching_in_train has no effect: %s does not train (%s), so it has no "
            "training passes to cut (ROLL ignores it on an inference role too).", role, role, strategy,
        )  # fmt: skip

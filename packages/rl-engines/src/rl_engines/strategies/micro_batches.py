"""Micro-batch planning, one home for every train and log-prob path: which samples go through the model together.

Two plans (ROLL's keys, per worker):

- *fixed*: micro-batches of a fixed number of samples (``training_args.per_device_train_batch_size`` in training,
  ``infer_batch_size`` in log-prob / value passes), every one as wide as the batch.
- *token budget* (``use_dynamic_batching_in_train`` / ``_in_infer``): the samples are sorted by length (prompt and
  response) and grouped while ``samples x width`` stays within ``max_tokens_per_microbatch_in_*``, the width rounded
  up to a multiple of ``sequence_length_round_in_*`` (ROLL's rule). Each micro-batch then runs without its padding
  columns (:func:`rl_engines.strategies.model_io.forward_outputs` with ``remove_padding``), so memory per
  micro-batch is bounded by the budget and short responses stop paying for the longest. Prompts are left-padded
  and responses right-padded, so a pass is as wide as its longest prompt plus its longest response (ROLL's
  right-padded layout makes that its longest sample).

A training step keeps its mini-batches as they are (``per_device_train_batch_size x gradient_accumulation_steps``
samples per rank, one optimizer step each): only how a mini-batch is cut into forward/backward passes changes, and
the loss of each pass is its share of the mini-batch's loss (rl-core's ``GlobalBatchInfo``), so the update equals the
padded one up to fp32 summation order. Ranks of a data-parallel group must run the same number of passes (FSDP and
ZeRO gather parameters inside each), so the count is agreed over the group and a rank with fewer micro-batches splits
its largest ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfig
from rl_engines.strategies.model_io import response_length, without_padding_columns

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


def plan_token_budget(spans: Sequence[tuple[int, int]], budget: TokenBudget) -> list[list[int]]:
    """Sample indices per micro-batch: ascending length, a new micro-batch whenever one more sample would make
    ``samples x width`` exceed the budget, the width being the longest prompt plus the longest response, rounded.
    Raises naming ``budget.key`` when one sample alone does."""
    groups: list[list[int]] = []
    prompt = response = 0
    for index in sorted(range(len(spans)), key=lambda i: sum(spans[i])):
        p, r = spans[index]
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
class MicroBatchPlanner:
    """Cuts a rank's batch into micro-batches for one phase: fixed ``size`` samples, or by ``budget``.

    ``group`` is the data-parallel process group whose ranks must agree on the number of micro-batches (only with
    a budget, and only when ``agree`` is set: a train step's passes run collectives, an inference pass of an
    unsharded model does not).
    """

    size: int
    budget: TokenBudget | None = None
    group: dist.ProcessGroup | None = None
    agree: bool = True

    @property
    def remove_padding(self) -> bool:
        """Whether the micro-batches run without their padding columns (every plan but the fixed one)."""
        return self.budget is not None

    @property
    def round_to(self) -> int:
        """The width multiple of a padding-free micro-batch (``sequence_length_round_in_<phase>``)."""
        return self.budget.round_to if self.budget is not None else 1

    def plan(self, batch: RolloutBatch) -> list[list[int]]:
        """Sample indices of each micro-batch."""
        if self.budget is None:
            return [list(range(start, min(start + self.size, len(batch)))) for start in range(0, len(batch), self.size)]
        groups = plan_token_budget(sequence_spans(batch), self.budget)
        if self.agree:
            groups = split_to_count(groups, agreed_count(len(groups), self.group))
        return groups

    def split(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """The micro-batches themselves (every column kept; ``remove_padding`` says how to run them)."""
        return [batch.index(indices) for indices in self.plan(batch)]

    def runs(self, micros: list[RolloutBatch]) -> list[RolloutBatch]:
        """What the model runs for each micro-batch: its padding-free columns
        (:func:`~rl_engines.strategies.model_io.without_padding_columns`) when :attr:`remove_padding`, else itself
        (for strategies that drive the forward themselves, e.g. Megatron's pipeline schedule)."""
        return [without_padding_columns(m, self.round_to) for m in micros] if self.remove_padding else micros

    def map(self, batch: RolloutBatch, forward: Callable[[RolloutBatch], dict[str, torch.Tensor]]) -> RolloutBatch:
        """``forward`` on each micro-batch; outputs concatenated on the CPU in the batch's own sample order."""
        plan = self.plan(batch)
        parts = [forward(batch.index(indices)) for indices in plan]
        return RolloutBatch(in_batch_order(parts, plan), meta_info=dict(batch.meta_info))


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
    infer_batch_size (infer), or the token budget of ``use_dynamic_batching_in_<phase>``. ``agree``: the
    strategy's passes run collectives (sharded parameters), so the ranks of ``group`` agree on their count."""
    size = config.training_args.per_device_train_batch_size if phase == "train" else config.infer_batch_size
    return MicroBatchPlanner(size, token_budget(config, role, phase), group, agree=agree)


def require_fixed_micro_batches(config: WorkerConfig, role: str, strategy: str) -> None:
    """For a generation engine that batches by itself (vLLM, SGLang): refuse ``use_dynamic_batching_in_*``."""
    for phase in ("train", "infer"):
        if getattr(config, f"use_dynamic_batching_in_{phase}"):
            raise ValueError(
                f"{role}.use_dynamic_batching_in_{phase} is set, but {strategy} schedules its own batches; dynamic "
                "batching applies to the log-prob and training passes of fsdp2_train, deepspeed_train, "
                "megatron_train, megatron_infer and hf_infer. Set it to false for this role."
            )


def require_no_training(config: WorkerConfig, role: str, strategy: str) -> None:
    """An inference strategy has no training passes: refuse ``use_dynamic_batching_in_train`` naming the key."""
    if config.use_dynamic_batching_in_train:
        raise ValueError(f"{role}.use_dynamic_batching_in_train is set, but {role} does not train ({strategy}); "
                         "use use_dynamic_batching_in_infer for its log-prob passes.")  # fmt: skip

"""The actor objective hands the policy loss what the batch carries for it."""

from __future__ import annotations

import torch

from rl_core.batch import RolloutBatch
from rl_core.losses.aggregation import GlobalBatchInfo
from rl_engines.objectives import ActorObjective


def test_topr_splits_positive_and_negative_samples_by_their_scores_as_roll():
    """ROLL's ActorPGWorker splits TOPR's samples by ``scores > 0``; a sample scored 0.2 whose group-normalised
    advantage is negative is a positive one there. Without ``sample_scores`` the sign of the mean advantage
    decided, which made it negative."""
    mask = torch.ones(2, 3)
    columns = {"response_mask": mask, "old_log_probs": torch.full((2, 3), -1.0),
               "advantages": torch.tensor([[0.5] * 3, [-0.5] * 3])}  # fmt: skip
    outputs = {"log_probs": torch.full((2, 3), -0.9, requires_grad=True)}
    objective = ActorObjective(policy_loss="topr")
    info = GlobalBatchInfo.from_mask(mask)
    with_scores = RolloutBatch.from_dict({**columns, "sample_scores": torch.tensor([1.0, 0.2])}, {})
    _, metrics = objective(outputs, with_scores, info)
    assert float(metrics["topr_positive_fraction"]) == 1.0
    _, metrics = objective(outputs, RolloutBatch.from_dict(columns, {}), info)
    assert float(metrics["topr_positive_fraction"]) == 0.5

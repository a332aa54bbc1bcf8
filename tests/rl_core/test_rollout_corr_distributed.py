"""IS batch normalisation over data-parallel ranks (verl's distributed_masked_mean): two gloo processes, each with its
own micro-batch, divide by the mean over both; the bypass-mode loss does it by itself inside torch.distributed, and a
rank whose micro-batch has no token still joins the sum (no hang)."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from rl_core.losses.config import PolicyLossConfig
from rl_core.losses.policy_bypass import compute_policy_loss_bypass_mode
from rl_core.rollout_corr import rollout_correction
from rl_core.rollout_corr_config import RolloutCorrectionConfig

FACTOR = "rollout_corr/rollout_is_batch_norm_factor"


def batch(rank: int, empty: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    old = torch.randn(3, 5, generator=g) * 0.3 - 2.0
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([[5], [2], [4]]) - rank  # ranks differ in token counts
    return {"old": old, "rollout": old + 0.4 * torch.randn(3, 5, generator=g) + 0.2 * rank,
            "adv": torch.randn(3, 5, generator=g), "mask": mask & (not empty)}  # fmt: skip


def options(level: str) -> dict:
    return {"rollout_is": level, "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True}


def _on_rank(rank: int, port: int, folder: str, empty_rank: int | None) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        x = batch(rank, empty=rank == empty_rank)
        out: dict = {}
        if empty_rank is None:  # every rank makes the same collective calls, in the same order
            for level in ("token", "sequence"):
                weights, _, metrics = rollout_correction(
                    x["old"], x["rollout"], x["mask"], **options(level), all_reduce=_sum
                )
                out[level] = {"weights": weights.tolist(), "factor": metrics[FACTOR]}
        config = PolicyLossConfig(
            rollout_correction=RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", **options("token"))
        )
        _, metrics = compute_policy_loss_bypass_mode(x["rollout"], x["old"], x["adv"], x["mask"], config=config)
        out["bypass_factor"] = float(metrics[FACTOR]) if FACTOR in metrics else None
        with open(os.path.join(folder, f"{rank}.json"), "w") as file:
            json.dump(out, file)
    finally:
        dist.destroy_process_group()


def _sum(values: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(values)
    return values


def _spawn(tmp_path, empty_rank: int | None) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_on_rank, args=(port, str(tmp_path), empty_rank), nprocs=2)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]


def test_two_ranks_normalise_by_the_mean_of_both_batches(tmp_path):
    results = _spawn(tmp_path, empty_rank=None)
    both = [batch(0), batch(1)]
    joined = {key: torch.cat([b[key] for b in both]) for key in both[0]}
    factors = {}
    for level in ("token", "sequence"):
        # one process holding both micro-batches: the mean over both is the normalisation each rank applied
        weights, _, metrics = rollout_correction(joined["old"], joined["rollout"], joined["mask"], **options(level))
        got = torch.tensor(results[0][level]["weights"] + results[1][level]["weights"])
        torch.testing.assert_close(got, weights, rtol=1e-6, atol=1e-7)
        assert results[0][level]["factor"] == results[1][level]["factor"] == pytest.approx(metrics[FACTOR], rel=1e-6)
        *_, own = rollout_correction(both[0]["old"], both[0]["rollout"], both[0]["mask"], **options(level))
        assert abs(own[FACTOR] - metrics[FACTOR]) > 1e-3  # a rank's own mean differs: the test can tell them apart
        factors[level] = metrics[FACTOR]
    # the bypass loss corrects the same two policies (current = "old", rollout) and joined the same sum by itself
    for rank in (0, 1):
        assert results[rank]["bypass_factor"] == pytest.approx(factors["token"], rel=1e-6)


def test_a_rank_without_tokens_joins_the_sum_and_adds_nothing(tmp_path):
    results = _spawn(tmp_path, empty_rank=1)
    x = batch(0)
    config = PolicyLossConfig(
        rollout_correction=RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", **options("token"))
    )
    _, alone = compute_policy_loss_bypass_mode(x["rollout"], x["old"], x["adv"], x["mask"], config=config)
    assert results[0]["bypass_factor"] == pytest.approx(float(alone[FACTOR]), rel=1e-6)  # rank 0's own mean
    assert results[1]["bypass_factor"] is None  # nothing corrected, no metric

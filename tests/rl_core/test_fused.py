"""The fused fast path (rl_core.fused: one compiled graph) against the eager path on random and adversarial inputs:
the rollout correction (weights, rejection mask, every rollout_corr/ metric) and the vanilla PPO loss (loss, metrics,
gradient). Also which path the automatic choice takes, and what happens when the compiler fails.

Each compiled graph costs seconds to build on a 2-core machine, so the cases share a few option sets whose graphs
cover every branch: token and sequence IS, TIS and IcePop bounds, batch normalisation, all four rejection statistics
(token, seq_sum, seq_mean, seq_max) and both bound kinds (k1 band, k2 / k3 upper bound)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import rl_core.fused as fused_module
from rl_core.fused import FUSED_MIN_TOKENS, call, wants_fused
from rl_core.losses import get_policy_loss
from rl_core.losses.aggregation import GlobalBatchInfo
from rl_core.losses.config import PolicyLossConfig
from rl_core.masked import is_set, mask_as
from rl_core.rollout_corr import rollout_correction

CORRECTIONS = {
    "token_tis_with_token_and_seq_mean_rs": dict(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3",
        rollout_rs_threshold="0.5_2.0,0.01",
    ),
    "sequence_icepop_normalized_with_seq_sum_and_max_rs": dict(
        rollout_is="sequence", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True,
        rollout_rs="seq_sum_k1,seq_max_k2", rollout_rs_threshold="0.2_3.0,0.5",
    ),
}  # fmt: skip


def random_batch(b: int = 6, t: int = 40, gap: float = 0.3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, generator=g) * 0.5 - 2.0
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    return {
        "old": old,
        "rollout": old + gap * torch.randn(b, t, generator=g),
        "current": old + gap * torch.randn(b, t, generator=g),
        "advantages": torch.randn(b, t, generator=g),
        "mask": torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1),
    }


def adversarial_batches() -> dict[str, dict[str, torch.Tensor]]:
    """NaN / Inf in padding and at real tokens, log-ratios of +-1e4, rows without a token, a row of one token."""
    out = {}
    x = random_batch(seed=1)
    x["mask"][1] = False  # a row without a real token
    x["mask"][2] = False
    x["mask"][2, 0] = True  # a row of one token
    for name in ("old", "rollout", "current", "advantages"):
        x[name] = x[name].masked_fill(~x["mask"], math.nan)  # padding may hold anything
    x["rollout"][3, 0] = -1e4  # extreme log ratios at real tokens
    x["old"][4, 0] = -1e4
    out["padding_nan_extreme_ratios"] = x
    y = random_batch(seed=2)
    y["old"][0, 0] = math.nan  # a NaN at a real token propagates as in eager
    y["rollout"][5, 0] = math.inf
    y["mask"][:, 0] = True
    out["nan_and_inf_at_real_tokens"] = y
    z = random_batch(seed=3, gap=8.0)  # every IS weight truncated / outside the band, most rows rejected
    out["huge_mismatch"] = z
    return out


def close_metrics(eager: dict[str, float], fused: dict[str, float]) -> None:
    assert eager.keys() == fused.keys()
    for name, value in eager.items():
        got = fused[name]
        if math.isnan(value) or math.isinf(value):
            assert got == value or (math.isnan(got) and math.isnan(value)), name
        else:
            assert abs(got - value) <= 1e-6 * max(1.0, abs(value)), (name, value, got)


def close(eager: torch.Tensor | None, fused: torch.Tensor | None) -> None:
    assert (eager is None) == (fused is None)
    if eager is not None and fused is not None:
        torch.testing.assert_close(fused, eager, rtol=1e-6, atol=1e-6, equal_nan=True)


def compiled_graphs() -> int:
    """How many graphs Dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def record_compiled(monkeypatch, tensors: list[torch.Tensor] | None = None) -> list[str]:
    """The names of the functions that take the compiled path from now on (the real compile still runs); with
    ``tensors``, the tensor arguments each compiled call gets are appended to it."""
    used: list[str] = []
    real = fused_module.compiled

    def recording(fn, *options):
        used.append(fn.__name__)
        compiled = real(fn, *options)

        def run(*args):
            if tensors is not None:
                tensors.extend(a for a in args if isinstance(a, torch.Tensor))
            return compiled(*args)

        return run

    monkeypatch.setattr(fused_module, "compiled", recording)
    return used


@pytest.mark.parametrize("options", CORRECTIONS.values(), ids=CORRECTIONS.keys())
def test_fused_correction_equals_eager_on_random_and_adversarial_inputs(options, monkeypatch):
    used = record_compiled(monkeypatch)
    batches = {"random": random_batch(), "long": random_batch(4, 300, seed=7), **adversarial_batches()}
    graphs = compiled_graphs()
    for name, x in batches.items():
        eager = rollout_correction(x["old"], x["rollout"], x["mask"], **options, fused=False)
        fused = rollout_correction(x["old"], x["rollout"], x["mask"], **options, fused=True)
        close(eager[0], fused[0])
        assert torch.equal(eager[1], fused[1]), name  # the same tokens rejected
        close_metrics(eager[2], fused[2])
    assert len(eager[2]) > 40  # IS, per-option and overall rejection, off-policy metrics
    assert set(used) == {"correction_stacked"}  # the fused calls did run compiled
    assert compiled_graphs() - graphs <= 1  # one graph for both shapes (none when an earlier test compiled it)


def loss_and_grad(x: dict[str, torch.Tensor], weights: torch.Tensor | None, **kwargs) -> tuple:
    current = x["current"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss("vanilla")(
        x["old"], current, x["advantages"], x["mask"], rollout_is_weights=weights, **kwargs
    )
    loss.backward()
    return loss.detach(), {k: float(v) for k, v in metrics.items()}, current.grad


LOSS_CASES = {
    "token_mean_global_batch_weighted": dict(weighted=True, loss_agg_mode="token-mean", global_batch=True),
    "seq_mean_token_mean_local": dict(weighted=False, loss_agg_mode="seq-mean-token-mean", global_batch=False),
}


@pytest.mark.parametrize("case", LOSS_CASES.values(), ids=LOSS_CASES.keys())
def test_fused_vanilla_loss_equals_eager_forward_and_backward(case, monkeypatch):
    used = record_compiled(monkeypatch)
    config = PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    batches = {"random": random_batch(), "clipped": random_batch(gap=1.0, seed=4), "long": random_batch(4, 300, seed=7),
               **adversarial_batches()}  # fmt: skip
    graphs = compiled_graphs()
    for count, (name, x) in enumerate(batches.items()):
        weights = torch.rand(x["old"].shape, generator=torch.Generator().manual_seed(count)) * 2
        kwargs = dict(loss_agg_mode=case["loss_agg_mode"], config=config)
        if case["global_batch"]:  # a new mini-batch's counts are inputs of the graph: no recompile
            kwargs["global_batch"] = GlobalBatchInfo(float(x["mask"].sum()) + count, 7.0 + count)
        results = []
        for choice in ("0", "1"):
            monkeypatch.setenv("RL_CORE_FUSED", choice)
            results.append(loss_and_grad(x, weights if case["weighted"] else None, **kwargs))
        (loss, metrics, grad), (fused_loss, fused_metrics, fused_grad) = results
        close(loss, fused_loss)
        close_metrics(metrics, fused_metrics)
        close(grad, fused_grad)
        assert torch.isfinite(fused_grad).all(), name  # padding (NaN here) never reaches the gradient
    assert metrics["pg_clipfrac"] > 0  # the clipped branch was exercised
    assert used.count("_vanilla") == len(batches)  # each RL_CORE_FUSED=1 call ran compiled, no RL_CORE_FUSED=0 one
    assert compiled_graphs() - graphs <= 1  # a new batch or response length reuses the graph


def test_the_automatic_choice_fuses_large_inputs_only(monkeypatch):
    monkeypatch.delenv("RL_CORE_FUSED", raising=False)
    assert wants_fused(len, FUSED_MIN_TOKENS, None) and not wants_fused(len, FUSED_MIN_TOKENS - 1, None)
    assert wants_fused(len, 4, True) and not wants_fused(len, 10**9, False)
    monkeypatch.setenv("RL_CORE_FUSED", "1")
    assert wants_fused(len, 4, None)
    monkeypatch.setenv("RL_CORE_FUSED", "0")
    assert not wants_fused(len, 10**9, None)
    monkeypatch.setenv("RL_CORE_FUSED", "sometimes")
    with pytest.raises(ValueError, match="RL_CORE_FUSED='sometimes'"):
        wants_fused(len, 4, None)


def test_a_training_size_batch_takes_the_fused_path_by_itself(monkeypatch):
    monkeypatch.delenv("RL_CORE_FUSED", raising=False)
    used = record_compiled(monkeypatch)
    options = CORRECTIONS["token_tis_with_token_and_seq_mean_rs"]
    small, large = random_batch(4, 64), random_batch(16, FUSED_MIN_TOKENS // 16, seed=5)
    rollout_correction(small["old"], small["rollout"], small["mask"], **options)
    assert used == []
    auto = rollout_correction(large["old"], large["rollout"], large["mask"], **options)
    assert used == ["correction_stacked"]
    eager = rollout_correction(large["old"], large["rollout"], large["mask"], **options, fused=False)
    close(eager[0], auto[0])
    close_metrics(eager[2], auto[2])


def test_a_compiler_failure_falls_back_to_eager_in_auto_mode_and_raises_when_asked_for(monkeypatch, caplog):
    def broken_compile(fn, *options):
        def run(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(fn, RuntimeError("no C++ compiler"), None)

        return run

    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    monkeypatch.setattr(fused_module, "compiled", broken_compile)
    monkeypatch.setattr(fused_module, "_broken", set())
    monkeypatch.delenv("RL_CORE_FUSED", raising=False)
    x = torch.ones(3)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        call(double, FUSED_MIN_TOKENS, True, x)
    with caplog.at_level(logging.WARNING, logger="rl_core.fused"):
        assert call(double, FUSED_MIN_TOKENS, None, x).tolist() == [2.0] * 3
    assert "running it eagerly" in caplog.text
    assert not wants_fused(double, FUSED_MIN_TOKENS, None)  # remembered: no second attempt


def test_past_the_recompile_limit_auto_mode_runs_eagerly_and_a_forced_call_raises(monkeypatch, caplog):
    """Each new option value compiles one more graph; past RECOMPILE_LIMIT graphs for one function Dynamo refuses
    (fullgraph=True), and the automatic choice then runs the function eagerly, with the right result, instead of
    failing the caller (measured: Dynamo's default limit of 8 failed the vanilla loss's tests run all fused)."""

    def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
        return t * factor

    # rl-core raises Dynamo's limit to RECOMPILE_LIMIT around its calls (never lowers it): here, to 1
    monkeypatch.setattr(fused_module, "_recompile_limit", lambda: torch._dynamo.config.patch(recompile_limit=1))
    monkeypatch.setattr(fused_module, "_broken", set())
    monkeypatch.delenv("RL_CORE_FUSED", raising=False)
    x = torch.ones(3)
    assert call(scaled, FUSED_MIN_TOKENS, None, x, 2.0).tolist() == [2.0] * 3  # the one graph allowed
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        call(scaled, FUSED_MIN_TOKENS, True, x, 3.0)
    with caplog.at_level(logging.WARNING, logger="rl_core.fused"):
        assert call(scaled, FUSED_MIN_TOKENS, None, x, 4.0).tolist() == [4.0] * 3
    assert "running it eagerly" in caplog.text
    assert not wants_fused(scaled, FUSED_MIN_TOKENS, None)


def test_around_its_calls_rl_core_raises_dynamos_recompile_limit_and_restores_it():
    config = torch._dynamo.config
    before = config.recompile_limit
    with fused_module._recompile_limit():
        assert config.recompile_limit == max(before, fused_module.RECOMPILE_LIMIT) >= 32
    assert config.recompile_limit == before
    with config.patch(recompile_limit=100), fused_module._recompile_limit():
        assert config.recompile_limit == 100  # a higher limit of the user's stays


def test_on_cpu_the_fused_loss_keeps_only_its_inputs_for_the_backward():
    """Inductor's CPU loops write bool tensors slowly, and the compiled forward saved one (the dual-clip branch) for
    the backward; on CPU it saves nothing of the batch's size but its inputs (the bool mask as the byte view the
    fused path reads: the caller's memory, no copy), and the backward recomputes the rest."""
    x = random_batch(b=16, t=FUSED_MIN_TOKENS // 16, seed=5)
    current = x["current"].clone().requires_grad_(True)
    inputs = {t.data_ptr() for t in (x["old"], current, x["advantages"], x["mask"])}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = get_policy_loss("vanilla")(x["old"], current, x["advantages"], x["mask"])
    loss.backward()
    batch_sized = [t for t in saved if t.numel() == x["mask"].numel()]
    assert batch_sized and all(t.data_ptr() in inputs for t in batch_sized), [t.dtype for t in batch_sized]
    assert torch.uint8 in {t.dtype for t in batch_sized}  # the mask, as bytes
    assert current.grad is not None and torch.isfinite(current.grad).all()


def test_on_cpu_a_fused_function_gets_bool_masks_as_bytes_and_the_caller_gets_bool_back(monkeypatch):
    """The masks cross into the compiled graph as byte views of the caller's memory (no float copy in, none out),
    and the correction's rejection mask comes back as bool holding exactly the eager path's tokens."""
    seen: list[torch.Tensor] = []
    record_compiled(monkeypatch, seen)
    x = random_batch(8, 64, seed=11)
    options = CORRECTIONS["token_tis_with_token_and_seq_mean_rs"]
    eager = rollout_correction(x["old"], x["rollout"], x["mask"], **options, fused=False)
    fused = rollout_correction(x["old"], x["rollout"], x["mask"], **options, fused=True)
    masks = [t for t in seen if t.data_ptr() == x["mask"].data_ptr()]
    assert [t.dtype for t in masks] == [torch.uint8]
    assert fused[1].dtype == torch.bool and torch.equal(fused[1], eager[1])
    assert not torch.equal(fused[1], x["mask"])  # some tokens were rejected: the mask was written, not passed on


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.float32])
def test_masks_read_and_written_in_a_compiled_graph_equal_eager(dtype):
    """is_set / mask_as compiled (bytes through float32 on CPU) give the eager values for every mask dtype."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(5, 37, generator=g)
    mask = (torch.rand(5, 37, generator=g) > 0.4).to(dtype)

    def kept(v: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        picked = is_set(m)
        return mask_as(picked & (v < 0.5), m.dtype), torch.where(picked, v, 0.0).sum(-1)

    (got_mask, got_sums), (want_mask, want_sums) = torch.compile(kept, fullgraph=True)(values, mask), kept(values, mask)
    assert got_mask.dtype == dtype and torch.equal(got_mask, want_mask)
    torch.testing.assert_close(got_sums, want_sums)  # float32 sums in another order: equal to rounding

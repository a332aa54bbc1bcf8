"""Mixture-of-experts HF models (Qwen3-MoE, Qwen2-MoE) on the torch-native strategies: the router load-balancing loss
is what the formula says over the real tokens, it alone balances the router, fsdp2_train and deepspeed_train train a
MoE model alike, synced weights score alike in hf_infer, exports keep HF's per-expert layout, and the keys are
refused where they would do nothing. In-process, a world of one (as the train contract suite); Ulysses with a MoE
model: test_engines_ulysses.py."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import CORPUS, require_engine, rollout_batch, tiny_model_dir, tiny_untied_model_dir, worker_config

from rl_engines.config import WorkerConfigError
from rl_engines.objectives import ActorObjective
from rl_engines.roles import check_strategy, sync_names
from rl_engines.strategies import create_strategy
from rl_engines.strategies.moe import load_balancing_loss
from rl_engines.tiny_model import build_tiny_moe_lm, build_tiny_tokenizer

__all__ = ["tiny_model_dir", "tiny_untied_model_dir"]


@pytest.fixture(scope="session", params=["qwen3_moe", "qwen2_moe"])
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    from transformers import AutoTokenizer

    build_tiny_moe_lm(path, model_type=request.param, vocab_size=len(AutoTokenizer.from_pretrained(str(path))))
    return path


def make(model_dir, strategy_name="fsdp2_train", role="actor_train", model_args=None, options=None, **training_args):
    args = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
            **training_args}  # fmt: skip
    config = worker_config(model_dir, role, training_args=args, model_args=model_args or {},
                           strategy_args={"strategy_name": require_engine(strategy_name),
                                          "strategy_config": options or {}})  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


def step(strategy, batch):
    batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
    return strategy.train_step(batch, ActorObjective())


def test_the_load_balancing_loss_by_hand():
    # three tokens, two experts, top-1: tokens go to experts 0, 1, 0 -> f = (2/3, 1/3); P = (1.6/3, 1.4/3)
    logits = torch.tensor([[0.75, 0.25], [0.25, 0.75], [0.6, 0.4]]).log()
    assert float(load_balancing_loss(logits, top_k=1)) == pytest.approx(2 * (2 / 3 * 1.6 / 3 + 1 / 3 * 1.4 / 3))
    # the third token is padding: one token each way, P = (0.5, 0.5) -> 2 * (0.25 + 0.25)
    keep = torch.tensor([True, True, False])
    assert float(load_balancing_loss(logits, top_k=1, keep=keep)) == pytest.approx(1.0)
    assert float(load_balancing_loss(torch.zeros(8, 4), top_k=2)) == pytest.approx(1.0)  # an even router


def test_one_layer_equals_transformers_loss_divided_by_top_k():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    ours = load_balancing_loss(logits, top_k=2)
    assert float(ours) == pytest.approx(float(load_balancing_loss_func((logits,), 4, 2)) / 2, rel=1e-6)


def test_the_metric_is_the_routers_loss_over_the_real_tokens(moe_dir):
    """Two micro-batches of a left / right padded batch: the reported load_balancing_loss is the mean over
    micro-batches and layers of the loss computed from transformers' own router logits, padding excluded."""
    from transformers import AutoModelForCausalLM

    batch = rollout_batch(4)
    metrics = step(make(moe_dir, model_args={"moe_aux_loss_coef": 0.5}), batch)
    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    expected = []
    for rows in (slice(0, 2), slice(2, 4)):
        mask = batch.batch["attention_mask"][rows]
        with torch.no_grad():
            out = model(input_ids=batch.batch["input_ids"][rows], attention_mask=mask,
                        position_ids=(mask.cumsum(-1) - 1).clamp(min=0), output_router_logits=True)  # fmt: skip
        keep = mask.reshape(-1).bool()
        expected.append(torch.stack([load_balancing_loss(lg, 2, keep) for lg in out.router_logits]).mean())
    assert mask.sum() < mask.numel()  # padding was there to exclude
    assert metrics["load_balancing_loss"] == pytest.approx(float(torch.stack(expected).mean()), abs=1e-6)


def test_a_row_per_sample_pass_leaves_its_padding_out_of_the_router_loss(moe_dir):
    """Dynamic batching runs a row per sample, the padding after each sample's tokens: the router's balancing loss
    over those rows equals the one over the same samples packed into one row of real tokens (no padding at all)."""
    from transformers import AutoModelForCausalLM

    from rl_engines.strategies.moe import RouterLoss, router_recorder
    from rl_engines.strategies.packing import needs_padding_mask, pack, packed_outputs

    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    assert needs_padding_mask(model)
    router = RouterLoss(model, 2, 1.0, *router_recorder(model))
    batch = rollout_batch(4)
    assert not bool(pack(batch, round_to=8, per_sample=True).real.all())  # the rows carry padding
    losses = []
    for per_sample in (False, True):
        with torch.no_grad(), router.recording():
            packed_outputs(model, batch, torch.device("cpu"), value_head=False, temperature=1.0, with_entropy=False,
                           round_to=8 if per_sample else 1, per_sample=per_sample)  # fmt: skip
            losses.append(router.layer_losses())
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)


def skewed_copy(model_dir, path):
    """``model_dir`` with routers that favour experts 0 and 1 for every token (load_balancing_loss about 1.15)."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, path)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[:2] += 0.5 * layer.post_attention_layernorm.weight
    model.save_pretrained(str(path))
    return path


def test_the_router_loss_alone_balances_the_router(moe_dir, tmp_path):
    """Zero advantages leave the router loss as the only gradient: with a coefficient it takes a skewed router at
    least half way to 1.0 (even) within a step, and keeps it there; with 0 (the key's off switch) the router does not
    move."""
    skewed = skewed_copy(moe_dir, tmp_path / "skewed")
    losses, routers = {}, {}
    for coef in (1.0, 0.0):
        strategy = make(skewed, model_args={"moe_aux_loss_coef": coef}, learning_rate=3e-4)
        batch = rollout_batch(4)
        batch.batch["advantages"] = torch.zeros_like(batch.batch["advantages"])
        before = {name: weight.clone() for name, weight in strategy.named_weights()}
        losses[coef] = [step(strategy, batch)["load_balancing_loss"] for _ in range(4)]
        after = dict(strategy.named_weights())
        routers[coef] = [bool(torch.equal(before[n], after[n])) for n in before if n.endswith("mlp.gate.weight")]
    first, *later = losses[1.0]
    assert first > 1.1 and all(loss < 1.0 + (first - 1.0) / 2 for loss in later), losses  # half way to even at least
    assert losses[0.0] == [losses[1.0][0]] * 4  # measured, not applied
    assert routers[0.0] and all(routers[0.0]) and not any(routers[1.0])


@pytest.mark.parametrize(
    ("moe_dir", "zero_stage"), [("qwen3_moe", 1), ("qwen3_moe", 3), ("qwen2_moe", 1)], indirect=["moe_dir"]
)
def test_fsdp2_and_deepspeed_train_a_moe_model_alike(moe_dir, zero_stage):
    """Two steps (lr 1e-2) with the router loss on: the same router metrics and scores (1e-6) and weights within
    1e-4, 1 % of a step (Adam's m / (sqrt(v) + eps) of a near-zero gradient element turns the last bits of its
    reduction order, which ZeRO-3's flat partitions change, into visible differences); ZeRO-3 partitions the router
    and the fused experts too."""
    batch = rollout_batch(4)
    results = {}
    for name, options in (("fsdp2_train", {}), ("deepspeed_train", {"zero_stage": zero_stage})):
        strategy = make(moe_dir, name, model_args={"moe_aux_loss_coef": 0.5}, options=options)
        metrics = [step(strategy, batch)["load_balancing_loss"] for _ in range(2)]
        scores = strategy.compute_log_probs(batch).batch["log_probs"] * batch.batch["response_mask"]
        results[name] = metrics, scores, {name: weight.clone() for name, weight in strategy.named_weights()}
    (fsdp_metrics, fsdp_scores, fsdp), (ds_metrics, ds_scores, ds) = results["fsdp2_train"], results["deepspeed_train"]
    assert fsdp_metrics == pytest.approx(ds_metrics, abs=1e-6)
    assert float((fsdp_scores - ds_scores).abs().max()) < 1e-6
    assert fsdp.keys() == ds.keys()
    assert max(float((fsdp[n] - ds[n]).abs().max()) for n in fsdp) < 1e-4


def test_synced_weights_score_alike_in_hf_infer_and_exports_keep_the_per_expert_layout(moe_dir, tmp_path):
    """hf_infer takes transformers' own (fused) names; save_hf and a sync into an engine with its own loader
    (``sync_names``: checkpoint) carry the per-expert names of the model folder, with the same values."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rl_engines.strategies.model_io import in_checkpoint_names

    train = make(moe_dir)
    batch = rollout_batch(4)
    step(train, batch)
    infer = make(moe_dir, "hf_infer", role="actor_infer")
    assert infer.load_weights(train.named_weights()) > 0
    trained = train.compute_log_probs(batch).batch["log_probs"]
    mask = batch.batch["response_mask"]
    assert float(((infer.compute_log_probs(batch).batch["log_probs"] - trained) * mask).abs().max()) < 1e-6
    train.save_hf(str(tmp_path / "hf"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert all(torch.equal(exported.state_dict()[n], w) for n, w in train.named_weights())
    on_disk = load_file(str(tmp_path / "hf" / "model.safetensors"))
    synced = dict(in_checkpoint_names(train.transformers_model(), train.named_weights()))
    assert synced.keys() == on_disk.keys() and all(torch.equal(synced[n], on_disk[n]) for n in on_disk)
    names = {strategy: sync_names(worker_config(moe_dir, "actor_infer", strategy_args={"strategy_name": strategy}))
             for strategy in ("vllm", "sglang", "hf_infer")}  # fmt: skip
    assert names == {"vllm": "checkpoint", "sglang": "checkpoint", "hf_infer": "module"}


def test_moe_keys_are_refused_where_they_would_do_nothing(moe_dir, tiny_model_dir):
    with pytest.raises(WorkerConfigError, match=r"actor_train\.model_args\.moe_aux_loss_coef=0\.1 .* dense model"):
        make(tiny_model_dir, model_args={"moe_aux_loss_coef": 0.1})
    with pytest.raises(WorkerConfigError, match=r"moe_aux_loss_coef must be a finite number >= 0"):
        worker_config(moe_dir, model_args={"moe_aux_loss_coef": -1.0})
    infer = worker_config(moe_dir, "actor_infer", model_args={"moe_aux_loss_coef": 0.1},
                          strategy_args={"strategy_name": "hf_infer"})  # fmt: skip
    with pytest.raises(ValueError, match=r"actor_infer\.model_args\.moe_aux_loss_coef=0\.1 .* adds no router loss"):
        check_strategy("actor_infer", infer)


def test_a_family_with_another_router_is_refused_for_training(tmp_path, tiny_model_dir):
    """Only the tested softmax top-k routers (Qwen2/3-MoE) get the router loss; another family is refused by name,
    not trained with a loss built for a different router."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", vocab_size=259, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(WorkerConfigError, match=r"is a 'mixtral' mixture-of-experts model; the router loss here is"):
        make(tmp_path)


def test_wrap_policy_shards_embeddings_and_head_as_units_without_changing_a_step(tiny_model_dir, tiny_untied_model_dir):
    from torch.distributed.fsdp import FSDPModule

    for model_dir in (tiny_untied_model_dir, tiny_model_dir):
        weights = []
        for wrap in ({}, {"wrap_embeddings": True, "wrap_lm_output": True, "moe_experts": ["Qwen3MoeMLP"]}):
            config = worker_config(model_dir, training_args={"per_device_train_batch_size": 2},
                                   strategy_args={"strategy_name": "fsdp2_train",
                                                  "strategy_config": {"wrap_policy": wrap}})  # fmt: skip
            strategy = create_strategy(config, "actor_train")
            strategy.initialize()
            model = strategy.model
            units = [isinstance(m, FSDPModule) for m in (model.get_input_embeddings(), model.get_output_embeddings())]
            assert units == ([True, True] if wrap else [False, False])
            if wrap:
                assert any("moe_experts" in note for note in strategy.notes())
            step(strategy, rollout_batch(4))
            weights.append(dict(strategy.named_weights()))
        assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    bad = {"strategy_name": "fsdp2_train", "strategy_config": {"wrap_policy": {"wrap_embedding": True}}}
    with pytest.raises(ValueError, match=r"wrap_policy.*wrap_embedding"):
        create_strategy(worker_config(tiny_model_dir, strategy_args=bad), "actor_train")

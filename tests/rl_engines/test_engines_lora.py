"""LoRA on the train strategies that build it (``model_args.lora_*``): only the adapters train, the base stays the
reference policy, merged weights and exported folders score as the trained model, checkpoints hold adapters only and
resume bitwise, and bad keys are refused naming them. In-process, a world of one (as the train contract suite);
megatron_train's adapters at TP / PP 2 are in the alignment matrix (tests/apps/test_apps_alignment.py)."""

from __future__ import annotations

import json

import pytest
import torch
from engine_fixtures import reference_log_probs, require_engine, rollout_batch, tiny_model_dir, worker_config

from rl_core.losses import LossCoefficients
from rl_engines.config import WorkerConfig, WorkerConfigError
from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy
from rl_engines.strategies.model_io import forward_log_probs

__all__ = ["tiny_model_dir"]
pytest.importorskip("peft")
LORA = {"lora_target": "q_proj,v_proj,down_proj", "lora_rank": 4, "lora_alpha": 16}


@pytest.fixture(params=["fsdp2_train", "deepspeed_train", "megatron_train"])
def strategy_name(request: pytest.FixtureRequest) -> str:
    return require_engine(str(request.param))


def make(strategy_name, model_dir, role="actor_train", model_args=None, **training_args):
    args = {"learning_rate": 2e-2, "per_device_train_batch_size": 2, **training_args}
    config = worker_config(model_dir, role, training_args=args, infer_batch_size=3,
                           model_args={**LORA, **(model_args or {})},
                           strategy_args={"strategy_name": strategy_name})  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


def train(strategy, batch, steps=2):
    batch.batch["advantages"] = torch.ones_like(batch.batch["advantages"])
    for _ in range(steps):
        batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
        strategy.train_step(batch, ActorObjective())


class Parameters:
    """A strategy's parameters, adapters included: peft's model (fsdp2: ``model``; deepspeed: the engine's module),
    or Megatron's model and its adapters (which live outside it)."""

    def __init__(self, strategy):
        self.strategy = strategy

    def named_parameters(self):
        if getattr(self.strategy, "adapters", None) is not None:
            yield from self.strategy.model.module.named_parameters()
            yield from self.strategy.adapters.named_parameters()
        else:
            yield from (
                self.strategy.model if hasattr(self.strategy, "model") else self.strategy.engine.module
            ).named_parameters()

    def parameters(self):
        return (p for _, p in self.named_parameters())


def module(strategy):
    """The parameters a strategy holds (:class:`Parameters`)."""
    return Parameters(strategy)


def optimizer_state_numel(strategy):
    """Values of Adam's first moment the strategy's optimizer holds (ZeRO keeps flat fp32 partitions)."""
    optimizer = getattr(strategy, "optimizer", None) or strategy.engine.optimizer
    while not optimizer.state and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return sum(state["exp_avg"].numel() for state in optimizer.state.values())


def saved_weight_names(folder):
    """The model weights a checkpoint folder holds (fsdp2: torch.distributed.checkpoint; deepspeed: its module
    states file)."""
    if (folder / "dcp").exists():
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata
        return {key.removeprefix("model.") for key in saved if key.startswith("model.")}
    if (folder / "mp_rank_00.pt").exists():  # megatron_train
        return set(torch.load(folder / "mp_rank_00.pt", weights_only=True)["model"])
    states = torch.load(folder / "deepspeed" / "state" / "mp_rank_00_model_states.pt", weights_only=False)
    return set(states["module"])


def log_probs_of(model, batch):
    with torch.no_grad():
        return forward_log_probs(model.eval(), batch, torch.device("cpu"))[0]


def test_only_the_adapters_train_and_the_base_stays_the_reference(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, model_args={"dtype": "bf16"})
    model = module(strategy)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert targets == {"q_proj", "v_proj", "down_proj"}
    frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad and "norm" not in n}
    assert frozen == {torch.bfloat16}  # the frozen base (Megatron builds its norm weights in fp32)
    train(strategy, rollout_batch(batch_size=2, seed=1), steps=1)
    assert optimizer_state_numel(strategy) == sum(trainable.values())  # Adam holds the adapters' moments only


def test_a_fresh_adapter_changes_nothing_and_training_moves_only_the_adapted_policy(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir)
    batch = rollout_batch(batch_size=4, seed=2)
    mask = batch.batch["response_mask"]
    base = reference_log_probs(tiny_model_dir, batch)
    torch.testing.assert_close(
        strategy.compute_log_probs(batch).batch["log_probs"][mask].double(), base[mask], atol=2e-5, rtol=0
    )  # fmt: skip  (B = 0: the adapters add nothing yet)
    train(strategy, batch)
    adapted = strategy.compute_log_probs(batch).batch["log_probs"]
    assert adapted[mask].mean() > base[mask].mean() + 0.1
    reference = strategy.compute_log_probs(batch, disable_adapter=True).batch["log_probs"]
    torch.testing.assert_close(reference[mask].double(), base[mask], atol=2e-5, rtol=0)


def test_merged_weights_and_both_exports_score_as_the_trained_model(strategy_name, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    strategy = make(strategy_name, tiny_model_dir)
    batch = rollout_batch(batch_size=4, seed=3)
    train(strategy, batch)
    mask = batch.batch["response_mask"]
    expected = strategy.compute_log_probs(batch).batch["log_probs"]

    merged = dict(strategy.named_weights())
    fresh = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert set(merged) == set(fresh.state_dict())  # the base model's HF names, nothing of peft's
    fresh.load_state_dict(merged)
    torch.testing.assert_close(log_probs_of(fresh, batch)[mask], expected[mask], atol=1e-5, rtol=0)

    strategy.save_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    torch.testing.assert_close(log_probs_of(exported, batch)[mask], expected[mask], atol=1e-5, rtol=0)
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 16, ["down_proj", "q_proj",
                                                                                             "v_proj"])  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "hf" / "adapter"))
    torch.testing.assert_close(log_probs_of(with_adapter, batch)[mask], expected[mask], atol=1e-5, rtol=0)
    from rl_ckpt.lora_merge import merge_lora  # rl-ckpt merges the exported adapter into the base alike

    merge_lora(tiny_model_dir, tmp_path / "hf" / "adapter", tmp_path / "rl_ckpt_merged")
    by_rl_ckpt = AutoModelForCausalLM.from_pretrained(str(tmp_path / "rl_ckpt_merged"), dtype=torch.float32)
    torch.testing.assert_close(log_probs_of(by_rl_ckpt, batch)[mask], expected[mask], atol=1e-5, rtol=0)
    adapters = dict(strategy.adapter_weights())
    assert adapters and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in adapters)


def test_checkpoints_hold_the_adapters_only_and_resume_equals_uninterrupted(strategy_name, tiny_model_dir, tmp_path):
    from rl_core.losses import LossCoefficients

    batches = [rollout_batch(batch_size=4, seed=s) for s in (10, 11)]
    objective = ActorObjective(coefficients=LossCoefficients(entropy_loss_coef=0.01))
    schedule = {"lr_scheduler_type": "linear", "max_steps": 8, "warmup_steps": 1}
    first = make(strategy_name, tiny_model_dir, **schedule)
    batches[0].batch["old_log_probs"] = first.compute_log_probs(batches[0]).batch["log_probs"]
    first.train_step(batches[0], objective)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    at_save = dict(first.named_weights())  # the merged weights the checkpoint's adapters stand for
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["adapters_only"] is True
    trained = {n for n, p in module(first).named_parameters() if p.requires_grad}
    assert saved_weight_names(tmp_path / "ckpt") == trained  # no base weight
    batches[1].batch["old_log_probs"] = first.compute_log_probs(batches[1]).batch["log_probs"]
    expected = first.train_step(batches[1], objective)

    resumed = make(strategy_name, tiny_model_dir, **schedule)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.train_step(batches[1], objective) == expected
    for (name, a), (_, b) in zip(first.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name

    if strategy_name == "megatron_train":  # rl-ckpt merges the checkpoint's (TP-sharded) adapters into the base
        from rl_ckpt.hf_io import HFCheckpoint
        from rl_ckpt.lora_merge import merge_lora

        merge_lora(tiny_model_dir, tmp_path / "ckpt", tmp_path / "merged")
        merged = HFCheckpoint(tmp_path / "merged")
        assert set(merged.weight_map) | {"lm_head.weight"} == set(at_save)  # the tied head is not stored
        for name in merged.weight_map:
            torch.testing.assert_close(merged.get(name), at_save[name], atol=1e-6, rtol=0, msg=name)
    if strategy_name == "deepspeed_train":  # rl-ckpt's DeepSpeed -> HF conversion points at the exports instead
        from rl_ckpt.deepspeed_to_hf import convert_deepspeed_to_hf
        from rl_ckpt.errors import CheckpointError

        with pytest.raises(CheckpointError, match=r"holds LoRA adapters only .*rl-ckpt merge-lora"):
            convert_deepspeed_to_hf(tmp_path / "ckpt", tmp_path / "converted", hf_config_path=tiny_model_dir)
    for changed in ({"lora_target": "q_proj"}, {"lora_alpha": 64}):  # would drop adapters / rescale them silently
        other = make(strategy_name, tiny_model_dir, model_args=changed, **schedule)
        with pytest.raises(ValueError, match=r"holds adapters of .*actor_train\.model_args asks for"):
            other.load_checkpoint(str(tmp_path / "ckpt"))
    full = create_strategy(worker_config(tiny_model_dir, strategy_args={"strategy_name": strategy_name}),
                           "actor_train")  # fmt: skip
    full.initialize()
    with pytest.raises(ValueError, match=r"holds LoRA adapters only.*actor_train\.model_args\.lora_target=None"):
        full.load_checkpoint(str(tmp_path / "ckpt"))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("q_proj,qkv", r"actor_train\.model_args\.lora_target names \['qkv'\].*linear layers are \[.*'q_proj'"),
        (".*\\.attn\\..*", r"actor_train\.model_args\.lora_target='.*' matches no linear layer"),
        ("lm_head", r"names \['lm_head'\], which match no linear layer"),  # the output head is not adapted
        (".*(embed_tokens|q_proj)", r"also matches \['model\.embed_tokens'\], which are not linear layers"),
        (".*(lm_head|q_proj)", r"also matches \['lm_head'\]"),
    ],
)
def test_targets_that_match_no_linear_layer_are_named(strategy_name, tiny_model_dir, target, message):
    if strategy_name == "megatron_train" and "also matches" in message:
        pytest.skip("megatron_train matches a regular expression against Megatron's module paths (tested below)")
    with pytest.raises(ValueError, match=message):
        make(strategy_name, tiny_model_dir, model_args={"lora_target": target})


def test_all_linear_adapts_every_linear_layer_but_the_head(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, model_args={"lora_target": "all-linear"})
    adapted = {
        n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in module(strategy).named_parameters() if ".lora_A." in n
    }
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_a_value_head_role_with_lora_is_refused(strategy_name, tiny_model_dir):
    config = worker_config(tiny_model_dir, "critic", model_args=LORA, strategy_args={"strategy_name": strategy_name})
    with pytest.raises(ValueError, match=r"critic\.model_args\.lora_target is set on a value-head model"):
        create_strategy(config, "critic")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"lora_target": "q_proj", "lora_rank": 0}, r"actor_train\.model_args\.lora_rank must be >= 1"),
        ({"lora_target": "q_proj", "lora_alpha": -2}, r"actor_train\.model_args\.lora_alpha must be > 0"),
        ({"lora_target": "q_proj", "lora_dropout": 1.0}, r"actor_train\.model_args\.lora_dropout must be in"),
        ({"lora_target": " , "}, r"actor_train\.model_args\.lora_target=' , ' names no module"),
        ({"lora_target": "all-embedding"}, r"lora_target asks for \['all-embedding'\].*not built"),
        ({"lora_target": "q_(proj"}, r"lora_target='q_\(proj' is not a valid regular expression"),
    ],
)
def test_bad_lora_keys_are_refused_naming_the_key(values, message):
    with pytest.raises(WorkerConfigError, match=message):
        WorkerConfig.from_dict({"model_args": values}, "actor_train")


def test_lora_keys_read_as_roll_reads_them():
    def args(**values):
        return WorkerConfig.from_dict({"model_args": values}, "actor_train").model_args

    assert args(lora_target="o_proj, q_proj").lora_targets() == ["o_proj", "q_proj"]
    assert args(lora_target=".*proj$").lora_targets() == ".*proj$"  # a regular expression stays whole
    assert args(lora_target="q_proj", lora_rank=32).lora_scale == 2.0  # alpha defaults to 2 x rank
    assert args(lora_target="q_proj", lora_rank=32, lora_alpha=32).lora_scale == 1.0
    assert not args().lora


STEP_ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
             "adam_epsilon": 1e-3}  # fmt: skip


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_deepspeed_trains_the_same_adapters_as_fsdp2(tiny_model_dir, zero_stage):
    """The same adapter init (training_args.seed) and the same two optimizer steps give the same adapters on both
    engines (ZeRO-3 partitions the frozen base too). adam_epsilon 1e-3 keeps this a comparison of gradients (see
    test_engines_deepspeed.py)."""
    require_engine("deepspeed_train")
    batch = rollout_batch(batch_size=4, seed=4)
    results = []
    for name, options in (("fsdp2_train", {}), ("deepspeed_train", {"zero_stage": zero_stage})):
        strategy_args = {"strategy_name": name, "strategy_config": options}
        config = worker_config(tiny_model_dir, training_args=STEP_ARGS, model_args=LORA, strategy_args=strategy_args)
        strategy = create_strategy(config, "actor_train")
        strategy.initialize()
        batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
        metrics = strategy.train_step(batch, ActorObjective(coefficients=LossCoefficients(entropy_loss_coef=0.01)))
        results.append((metrics, dict(strategy.adapter_weights()), dict(strategy.named_weights())))
    (fsdp2_metrics, fsdp2_adapters, fsdp2_merged), (ds_metrics, ds_adapters, ds_merged) = results
    for key in ("pg_loss", "total_loss", "grad_norm"):
        assert ds_metrics[key] == pytest.approx(fsdp2_metrics[key], abs=1e-6), key
    assert ds_adapters.keys() == fsdp2_adapters.keys() and ds_merged.keys() == fsdp2_merged.keys()
    moved = max(float((fsdp2_adapters[n] - ds_adapters[n]).abs().max()) for n in fsdp2_adapters)
    assert moved <= 1e-6
    for name, value in fsdp2_merged.items():
        torch.testing.assert_close(ds_merged[name], value, atol=1e-6, rtol=0, msg=name)
    assert any(float(v.abs().max()) > 0 for n, v in fsdp2_adapters.items() if ".lora_B." in n)  # they trained


def adapted_modules(strategy):
    return {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in module(strategy).named_parameters() if ".lora_A." in n}


def test_a_regular_expression_target_adapts_the_modules_it_matches(strategy_name, tiny_model_dir):
    """peft matches it against HF module paths; megatron_train, as ROLL's mcore adapters, against Megatron's, where a
    matched fused linear (linear_qkv, linear_fc1) adapts every projection fused in it."""
    megatron = strategy_name == "megatron_train"
    target = r".*layers\.1\..*(linear_qkv|linear_fc1)" if megatron else r".*layers\.1\..*(q_proj|up_proj)"
    strategy = make(strategy_name, tiny_model_dir, model_args={"lora_target": target})
    names = [n for n, _ in module(strategy).named_parameters() if ".lora_A." in n]
    expected = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} if megatron else {"q_proj", "up_proj"}
    assert adapted_modules(strategy) == expected and all(".layers.1." in n for n in names)


@pytest.mark.parametrize(
    ("target", "adapted"),
    [
        (".*proj", {"self_attn.o_proj"}),  # peft: all seven projections; ROLL's Megatron paths: linear_proj alone
        (r"decoder\.layers\.1\.mlp\..*", {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}),
        ("linear_qkv", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}),  # a name, not an expression
    ],
)
def test_megatron_matches_a_regular_expression_against_megatron_module_paths_as_roll(target, adapted):
    from rl_engines.config import ModelArgs
    from rl_engines.strategies.megatron_lora import adapted_modules as megatron_adapted

    found = megatron_adapted(ModelArgs(lora_target=target, lora_rank=4), "actor_train", 2)
    assert {name.split(".", 3)[3] for name in found} == adapted
    assert "decoder" not in target or all(name.startswith("model.layers.1.") for name in found)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (r".*layers\.1\..*(q_proj|up_proj)", r"matches no linear layer .* It matches HF module paths .* write it for "
         r"those \(q_proj, k_proj and v_proj are one linear_qkv"),
        (".*(word_embeddings|linear_qkv)", r"also matches \['embedding\.word_embeddings'\], which are not linear"),
        (".*(output_layer|linear_fc2)", r"also matches \['output_layer'\]"),
        (r".*\.attn\..*", r"matches no linear layer of the Megatron model \(a regular expression is "
         r"matched against whole Megatron module paths, as in ROLL, such as 'decoder\.layers\.0\.self_attention\."
         r"linear_qkv'\); its linear layers are \[.*\]\.$"),
    ],
)  # fmt: skip
def test_megatron_names_a_regular_expression_that_matches_no_megatron_linear(target, message):
    from rl_engines.config import ModelArgs
    from rl_engines.strategies.megatron_lora import adapted_modules as megatron_adapted

    with pytest.raises(ValueError, match=r"actor_train\.model_args\.lora_target=" + ".*" + message):
        megatron_adapted(ModelArgs(lora_target=target, lora_rank=4), "actor_train", 2)


def test_megatron_refuses_what_its_lora_does_not_build(tiny_model_dir):
    """Adapter dropout, and sequence parallelism over TP ranks (real where Apex / Transformer Engine are installed;
    off here, see megatron_config): the adapters would see sequence-split activations."""
    from rl_engines.strategies.megatron_config import MegatronOptions
    from rl_engines.strategies.megatron_train import check_megatron_lora

    require_engine("megatron_train")
    config = worker_config(tiny_model_dir, model_args={**LORA, "lora_dropout": 0.1},
                           strategy_args={"strategy_name": "megatron_train"})  # fmt: skip
    with pytest.raises(ValueError, match=r"actor_train\.model_args\.lora_dropout=0\.1: megatron_train's LoRA has no"):
        create_strategy(config, "actor_train")
    config = worker_config(tiny_model_dir, model_args=LORA, strategy_args={"strategy_name": "megatron_train"})
    options = MegatronOptions(tensor_model_parallel_size=2, sequence_parallel=True)
    message = r"strategy_config\.sequence_parallel=true with tensor_model_parallel_size=2 and actor_train\.model_args"
    with pytest.raises(ValueError, match=message):
        check_megatron_lora(config, "actor_train", False, options)


def test_lora_dropout_drops_adapter_inputs_in_training_only(tiny_model_dir):
    """The same seed and batch: with lora_dropout the adapters' gradients see dropped inputs, so one step trains
    other adapters; scoring (eval mode) applies no dropout."""
    batch = rollout_batch(batch_size=4, seed=6)
    adapters = []
    for dropout in (0.0, 0.5):
        strategy = make("fsdp2_train", tiny_model_dir, model_args={"lora_dropout": dropout})
        first = strategy.compute_log_probs(batch).batch["log_probs"]
        assert torch.equal(first, strategy.compute_log_probs(batch).batch["log_probs"])  # no dropout when scoring
        train(strategy, batch, steps=1)
        adapters.append(dict(strategy.adapter_weights()))
    moved = max(float((adapters[0][n] - adapters[1][n]).abs().max()) for n in adapters[0] if ".lora_B." in n)
    assert moved > 1e-4

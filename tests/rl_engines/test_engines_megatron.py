"""megatron_train / megatron_infer at tensor_model_parallel_size=2 on two Ray ranks (CPU, gloo, real megatron-core).

Expected values are independent: the HF model's log-probs (one un-padded forward per token, engine_fixtures), the
same update done by fsdp2_train on one rank in this process, and an uninterrupted run for checkpoint resume. The
workers apply the test-harness shims (megatron_shims) through the session's start-up hook.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    CORPUS,
    assert_critic_matches,
    prompt_batch,
    reference_log_probs,
    rollout_batch,
    worker_config,
)

from rl_engines.config import GeneratingArgs
from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec
from rl_engines.roles import Roles
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

pytest.importorskip("megatron.core")

CLUSTER = ClusterSpec(num_nodes=1, num_gpus_per_node=2)
TP2 = {"tensor_model_parallel_size": 2}
TP2_SP = {**TP2, "sequence_parallel": True}
"""The train role splits the sequence over its TP ranks (torch norms tagged for the gradient sum), the reference does
not: every comparison below between them, HF and fsdp2 also checks sequence parallelism."""
# adam_epsilon 1e-4: Adam divides each coordinate by its own magnitude, which would turn the rounding noise of a
# near-zero gradient (summed in another order by the TP all-reduces) into a visible step.
TRAIN_ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
              "adam_epsilon": 1e-4, "lr_scheduler_type": "linear", "max_steps": 10}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 with 4 query heads in 2 KV groups (Megatron splits whole KV groups over TP ranks)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_gqa2")
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    vocab = len(AutoTokenizer.from_pretrained(str(path)))
    build_tiny_causal_lm(path, vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, seed=2)
    return path


@pytest.fixture(scope="module")
def roles(ray_session, tiny_model_dir, tmp_path_factory):
    configs = {
        "actor_train": worker_config(tiny_model_dir, "actor_train", device_mapping=[0, 1], training_args=TRAIN_ARGS,
                                     infer_batch_size=4,
                                     strategy_args={"strategy_name": "megatron_train", "strategy_config": TP2_SP}),
        "reference": worker_config(tiny_model_dir, "reference", device_mapping=[0, 1], infer_batch_size=4,
                                   strategy_args={"strategy_name": "megatron_infer", "strategy_config": TP2}),
        "critic": worker_config(tiny_model_dir, "critic", device_mapping=[0, 1], training_args=TRAIN_ARGS,
                                infer_batch_size=4,
                                strategy_args={"strategy_name": "megatron_train", "strategy_config": TP2_SP}),
    }  # fmt: skip
    with Roles(CLUSTER, configs, rpc_timeout=120) as started:
        yield started


def hf_state(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()


def fsdp2(model_dir):
    strategy = create_strategy(worker_config(model_dir, training_args=TRAIN_ARGS, infer_batch_size=4), "actor_train")
    strategy.initialize()
    return strategy


def megatron_single(model_dir, role):
    """megatron_train at TP = 1 in this process (a world of one)."""
    config = worker_config(model_dir, role, training_args=TRAIN_ARGS, infer_batch_size=4,
                           strategy_args={"strategy_name": "megatron_train", "strategy_config": {}})  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


def test_tp2_scores_equal_the_hf_model(roles, tiny_model_dir):
    batch = rollout_batch(batch_size=8, seed=1)
    mask = batch.batch["response_mask"]
    expected = reference_log_probs(tiny_model_dir, batch)
    train = roles["actor_train"].call("compute_log_probs", batch, with_entropy=True, dispatch="dp_split")
    ref = roles["reference"].call("compute_log_probs", batch, dispatch="dp_split")
    # measured 5e-7: fp32, the TP all-reduces only reorder sums
    torch.testing.assert_close(train.batch["log_probs"][mask].double(), expected[mask], atol=2e-6, rtol=0)
    torch.testing.assert_close(ref.batch["log_probs"], train.batch["log_probs"], atol=1e-6, rtol=0)
    hf_entropy = fsdp2(tiny_model_dir).compute_log_probs(batch, with_entropy=True).batch["entropy"]
    torch.testing.assert_close(train.batch["entropy"][mask], hf_entropy[mask], atol=2e-6, rtol=0)


def test_tp2_greedy_generation_follows_hf(roles, tiny_model_dir):
    prompts = prompt_batch(tiny_model_dir, ["1+2=", "10+12=", "3+3=", "4+5="])
    args = {"max_new_tokens": 6, "temperature": 0.0}
    hf = create_strategy(worker_config(tiny_model_dir, "actor_infer", generating_args=args,
                                       strategy_args={"strategy_name": "hf_infer"}), "actor_infer")  # fmt: skip
    hf.initialize()
    expected = hf.generate(prompts)
    got = roles["reference"].call("generate", prompts, GeneratingArgs(**args), dispatch="dp_split")
    assert torch.equal(got.batch["responses"], expected.batch["responses"])
    assert list(got.non_tensor_batch["finish_reasons"]) == list(expected.non_tensor_batch["finish_reasons"])


def test_tp2_update_equals_fsdp2_and_resume_equals_uninterrupted(roles, tiny_model_dir, tmp_path):
    batch = rollout_batch(batch_size=8, seed=2)
    mask = batch.batch["response_mask"]
    batch.batch["old_log_probs"] = (
        roles["actor_train"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    )
    objective = ActorObjective()
    metrics = roles["actor_train"].call("train_step", batch, objective, dispatch="dp_split")
    assert metrics[0] == metrics[1]  # reduced identically on both TP ranks

    single = fsdp2(tiny_model_dir)
    single_metrics = single.train_step(batch, objective)  # the same 2 optimizer steps of 4 samples each
    assert metrics[0]["actor/pg_loss"] == pytest.approx(single_metrics["pg_loss"], abs=1e-6)
    assert metrics[0]["actor/grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
    roles["actor_train"].call("save_hf", str(tmp_path / "hf_step1"))
    exported, expected = hf_state(tmp_path / "hf_step1"), dict(single.named_weights())
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in expected.items()}
    for name, value in expected.items():  # measured max |diff| ~1e-7 after two lr=1e-2 AdamW steps
        torch.testing.assert_close(exported[name], value, atol=2e-6, rtol=0, msg=name)

    roles["reference"].call("offload")  # colocated turn-taking, as the pipeline does before a sync
    sync = roles.model_updater("actor_train", "reference", bucket_bytes=30_000).sync()  # q/k/v split over buckets
    assert sync["model_update/tensors"] == len(expected) - 1  # the tied lm_head travels as an alias
    synced = roles["reference"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    trained = roles["actor_train"].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]
    torch.testing.assert_close(synced[mask], trained[mask], atol=1e-6, rtol=0)

    next_batch = rollout_batch(batch_size=8, seed=3)
    next_batch.batch["old_log_probs"] = trained
    roles["actor_train"].call("save_checkpoint", str(tmp_path / "ckpt"))
    uninterrupted = roles["actor_train"].call("train_step", next_batch, objective, dispatch="dp_split")
    roles["actor_train"].call("save_hf", str(tmp_path / "hf_uninterrupted"))
    roles["actor_train"].call("load_checkpoint", str(tmp_path / "ckpt"))
    resumed = roles["actor_train"].call("train_step", next_batch, objective, dispatch="dp_split")
    roles["actor_train"].call("save_hf", str(tmp_path / "hf_resumed"))
    assert resumed == uninterrupted
    a, b = hf_state(tmp_path / "hf_uninterrupted"), hf_state(tmp_path / "hf_resumed")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf_resumed", "hf_step1", "hf_uninterrupted"]


def test_sequence_parallel_critic_values_and_update_equal_tp1(roles, tiny_model_dir):
    """The value head gathers the sequence-split hidden states; its replicated weights and the norms' get their
    gradients summed over the TP ranks."""
    single = megatron_single(tiny_model_dir, "critic")  # the same seeded value head
    assert_critic_matches(roles["critic"], single, rollout_batch(batch_size=8, seed=4), update_atol=2e-5)


@pytest.mark.parametrize(
    ("name", "config", "match"),
    [
        (
            "megatron_train",
            {"virtual_pipeline_model_parallel_size": 2},
            r"strategy_config\.virtual_pipeline_model_parallel_size=2 interleaves model chunks over pipeline stages, "
            r"but pipeline_model_parallel_size is 1",
        ),
        ("megatron_train", {"context_parallel_size": 2}, r"strategy_config\.context_parallel_size=2"),
        ("megatron_infer", {"bf16": True}, r"strategy_config\.bf16=true contradicts reference\.model_args\.dtype"),
        ("megatron_train", {"moe_token_dispatcher_type": "flex"}, r"moe_token_dispatcher_type='flex': use one of"),
        ("megatron_train", {"tensor_model_parallel_size": "2"}, r"tensor_model_parallel_size must be int"),
        ("megatron_train", {"recompute_granularity": "layer"}, r"recompute_granularity='layer'"),
        ("megatron_train", {"recompute_num_layers": 2}, r"apply to recompute_granularity: full only"),
        ("megatron_infer", {"recompute_granularity": "full"}, r"unknown key\(s\) \['reference\.strategy_args"),
        (
            "megatron_train",
            {"recompute_granularity": "full", "recompute_modules": "mlp"},
            r"recompute_modules applies to recompute_granularity: selective only",
        ),
        (
            "megatron_train",
            {"recompute_granularity": "selective", "recompute_modules": "moe,mla_up_proj"},
            r"recompute_modules names \['mla_up_proj'\]; a decoder layer recomputes",
        ),
        (
            "megatron_train",
            {"additional_configs": {"moe_permute_fusions": True}},
            r"strategy_config\.additional_configs\.moe_permute_fusions",
        ),
        ("megatron_infer", {"additional_configs": [1]}, r"additional_configs must be a mapping"),
    ],
)
def test_every_strategy_config_key_is_validated_by_name(name, config, match, tmp_path):
    role = "actor_train" if name == "megatron_train" else "reference"
    with pytest.raises(ValueError, match=match):
        create_strategy(worker_config(tmp_path, role, strategy_args={"strategy_name": name, "strategy_config": config}),
                        role)  # fmt: skip

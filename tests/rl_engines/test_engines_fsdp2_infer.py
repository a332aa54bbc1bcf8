"""``fsdp2_infer`` (a frozen FSDP2-sharded model) and the attention-kernel keys of model_args.

What it promises: log-probs and greedy generations of a model sharded over 2 ranks (gloo) equal hf_infer's unsharded
ones, packed or padded, ranks generating different lengths; training keys and roles are refused naming the key;
ROLL's ``fa2`` / ``flash_attn`` resolve to transformers' kernels and run sdpa, saying so, where flash-attention
cannot run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from engine_fixtures import prompt_batch, tiny_model_dir, worker_config
from test_engines_micro_batches import PACKED, make, varied_batch

from rl_engines.config import GeneratingArgs, ModelArgs, WorkerConfigError
from rl_engines.roles import check_strategy
from rl_engines.strategies import create_strategy
from rl_engines.strategies.model_io import attention_kernel, load_model

__all__ = ["tiny_model_dir"]


LAYOUTS = {"padded": {}, "sequence_packing": PACKED}
QUESTIONS = ["What is 2+2?", "Name a colour."]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def scaled_weights(model_dir):
    """The model's weights x 1.01, in HF names (what a weight sync from actor_train delivers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(name, value.detach() * 1.01) for name, value in model.state_dict().items()]


def _score_on_rank(rank: int, port: int, model_dir: str, folder: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        half = varied_batch(seed=5).index(list(range(rank * 4, rank * 4 + 4)))
        for layout, sections in LAYOUTS.items():
            strategy = make("fsdp2_infer", model_dir, "reference", **sections)
            log_probs = strategy.compute_log_probs(half, temperature=0.7).batch["log_probs"]
            torch.save(log_probs, os.path.join(folder, f"{layout}-{rank}.pt"))
        prompts = prompt_batch(Path(model_dir), QUESTIONS).index([rank])
        responses = strategy.generate(prompts, GeneratingArgs(**GREEDY)).batch["responses"]
        torch.save(responses, os.path.join(folder, f"generated-{rank}.pt"))
        assert strategy.load_weights(scaled_weights(model_dir)) == len(list(scaled_weights(model_dir)))
        log_probs = strategy.compute_log_probs(half, temperature=0.7).batch["log_probs"]
        torch.save(log_probs, os.path.join(folder, f"loaded-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_sharded_reference_scores_like_an_unsharded_one(tiny_model_dir, tmp_path):
    """Two ranks, each scoring its half of the batch with the parameters sharded over both, padded and packed, and
    generating greedily for its own prompt (the ranks step together until both have finished), then after a weight
    sync into its shards."""
    import torch.multiprocessing as mp

    from rl_engines.worker_group import WorkerBase

    mp.spawn(_score_on_rank, args=(WorkerBase.free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2)
    batch = varied_batch(seed=5)
    expected = make("hf_infer", tiny_model_dir, "reference").compute_log_probs(batch, temperature=0.7)
    mask = batch.batch["response_mask"]
    for layout in LAYOUTS:
        got = torch.cat([torch.load(tmp_path / f"{layout}-{rank}.pt") for rank in (0, 1)])
        torch.testing.assert_close(got[mask], expected.batch["log_probs"][mask], atol=1e-6, rtol=0)
    unsharded = make("hf_infer", tiny_model_dir, "actor_infer")
    for rank in (0, 1):
        prompts = prompt_batch(tiny_model_dir, QUESTIONS).index([rank])
        alone = unsharded.generate(prompts, GeneratingArgs(**GREEDY)).batch["responses"]
        torch.testing.assert_close(torch.load(tmp_path / f"generated-{rank}.pt"), alone)
    unsharded.load_weights(scaled_weights(str(tiny_model_dir)))
    expected = unsharded.compute_log_probs(batch, temperature=0.7).batch["log_probs"]
    got = torch.cat([torch.load(tmp_path / f"loaded-{rank}.pt") for rank in (0, 1)])
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-6, rtol=0)


def test_fsdp2_infer_needs_only_the_forward_keys_of_load_balance(tiny_model_dir):
    packing = {"algorithm": "load_balance", "max_packed_sequence_length_forward": 64}
    config = worker_config(tiny_model_dir, "reference", strategy_args={"strategy_name": "fsdp2_infer"},
                           use_sequence_packing=True, sequence_packing_args=packing)  # fmt: skip
    assert create_strategy(config, "reference").planners["infer"].balance.max_tokens == 64


def test_fsdp2_infer_refuses_training_keys_and_roles(tiny_model_dir):
    config = worker_config(tiny_model_dir, "actor_train", strategy_args={"strategy_name": "fsdp2_infer"})
    with pytest.raises(ValueError, match=r"actor_train.strategy_args.strategy_name='fsdp2_infer' is an inference"):
        check_strategy("actor_train", config)
    config = worker_config(tiny_model_dir, "reference", strategy_args={"strategy_name": "fsdp2_infer"},
                           model_args={"freeze_module_prefix": "model.embed_tokens"})  # fmt: skip
    with pytest.raises(ValueError, match=r"reference.model_args.freeze_module_prefix is set, but reference does not"):
        create_strategy(config, "reference")
    misspelt = {"strategy_name": "fsdp2_infer", "strategy_config": {"fsdp_sise": 2}}
    config = worker_config(tiny_model_dir, "reference", strategy_args=misspelt)
    with pytest.raises(ValueError, match=r"reference.strategy_args.strategy_config.fsdp_sise"):
        create_strategy(config, "reference")


# ---- attention kernels -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "kernel"),
    [({}, None), ({"attn_implementation": "fa2"}, "flash_attention_2"), ({"attn_implementation": "auto"}, None),
     ({"flash_attn": "disabled"}, "eager"), ({"flash_attn": "fa2", "attn_implementation": "fa2"}, "flash_attention_2"),
     ({"attn_implementation": "sdpa"}, "sdpa"), ({"attn_implementation": "flash_attention_2"}, "flash_attention_2")],
)  # fmt: skip
def test_roll_attention_names_resolve_to_transformers_kernels(values, kernel):
    args = ModelArgs(**values)
    args.validate("actor_train.model_args")
    assert args.attention("actor_train.model_args") == kernel


@pytest.mark.parametrize(
    ("values", "message"),
    [({"attn_implementation": "fa3"}, r"actor_train.model_args.attn_implementation='fa3'; use one of"),
     ({"flash_attn": "fa2", "attn_implementation": "sdpa"},
      r"actor_train.model_args.attn_implementation='sdpa' and actor_train.model_args.flash_attn='fa2' ask for")],
)  # fmt: skip
def test_bad_attention_keys_name_the_key(values, message):
    with pytest.raises(WorkerConfigError, match=message):
        ModelArgs(**values).validate("actor_train.model_args")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for workers without CUDA")
def test_flash_attention_without_cuda_runs_sdpa_and_says_so(tiny_model_dir, caplog):
    args = ModelArgs(model_name_or_path=str(tiny_model_dir), attn_implementation="fa2")
    with caplog.at_level(logging.WARNING, logger="rl_engines.strategies.model_io"):
        assert attention_kernel(args, "reference") == "sdpa"
        model = load_model(args, "reference", dtype=torch.float32)
    assert model.config._attn_implementation == "sdpa"
    assert "reference.model_args asks for flash_attention_2" in caplog.text and "runs sdpa" in caplog.text

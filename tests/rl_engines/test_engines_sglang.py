"""The ``sglang`` strategy where SGLang cannot be installed (it needs CUDA-only kernels).

The real engine runs the infer contract suite where ``sglang`` imports (skipped here, naming the engine). Here:
strategy_config checks, the error naming the install command, and the adapter's plumbing against a stand-in that
answers in SGLang's documented ``Engine.generate`` format (``output_ids``, ``meta_info.output_token_logprobs`` /
``input_token_logprobs`` as ``(logprob, token_id, text)``, ``finish_reason``), computed with the HF model.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_fixtures import prompt_batch, reference_log_probs, rollout_batch, tiny_model_dir, worker_config

from rl_engines.config import WorkerConfigError
from rl_engines.strategies import create_strategy
from rl_engines.strategies.engine_rollout import EngineModel, load_generation_config
from rl_engines.strategies.model_io import load_tokenizer
from rl_engines.strategies.weight_table import WeightTable

__all__ = ["tiny_model_dir"]

QUESTIONS = ["1+2=", "10+12=", "what is 3+3?"]


class StandInEngine:
    """Greedy / seeded sampling with the HF model, answering like ``sglang.Engine`` (no top-k / top-p)."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        self.updates = []

    def _log_probs(self, ids, temperature):
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits / temperature, -1)  # [len, V]

    def generate(self, input_ids, sampling_params, return_logprob, logprob_start_len=None):
        assert return_logprob
        if logprob_start_len is not None:
            return [self._score(i, p, s) for i, p, s in zip(input_ids, sampling_params, logprob_start_len)]
        return [self._sample(list(ids), params) for ids, params in zip(input_ids, sampling_params)]

    def _score(self, ids, params, start):
        log_probs = self._log_probs(ids, params["temperature"])
        entries = [(None, ids[0], None)] + [(float(log_probs[t - 1, ids[t]]), ids[t], None) for t in range(1, len(ids))]
        return {"output_ids": [0], "meta_info": {"input_token_logprobs": entries[start:]}}

    def _sample(self, ids, params):
        generator = torch.Generator().manual_seed(params.get("sampling_seed", 0))
        temperature, out, entries = params["temperature"] or 1.0, [], []
        finish = {"type": "length", "length": params["max_new_tokens"]}
        for _ in range(params["max_new_tokens"]):
            step = self._log_probs(ids + out, temperature)[-1]
            greedy = params["temperature"] == 0
            token = int(step.argmax()) if greedy else int(torch.multinomial(step.exp(), 1, generator=generator))
            out.append(token)
            entries.append((float(step[token]), token, None))
            if token in params["stop_token_ids"]:
                finish = {"type": "stop", "matched": token}
                break
        return {"output_ids": out, "meta_info": {"output_token_logprobs": entries, "finish_reason": finish}}

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        self.updates.append([name for name, _ in named_tensors])
        self.model.load_state_dict(dict(named_tensors), strict=False)
        return True, "Succeeded to update model weights."


def stand_in_strategy(model_dir, **generating_args):
    args = {"max_new_tokens": 6, "num_return_sequences": 2, "seed": 3, **generating_args}
    config = worker_config(model_dir, "actor_infer", generating_args=args, strategy_args={"strategy_name": "sglang"})
    strategy = create_strategy(config, "actor_infer")
    strategy.tokenizer = load_tokenizer(str(model_dir))
    strategy.table = WeightTable.from_model_dir(str(model_dir))
    strategy.model = EngineModel(StandInEngine(model_dir), load_generation_config(str(model_dir)))
    return strategy


@pytest.mark.parametrize(
    ("strategy_config", "message"),
    [
        ({"mem_fraction": 0.5}, r"actor_infer\.strategy_args\.strategy_config\.mem_fraction'\]"),
        ({"mem_fraction_static": 0.0}, r"actor_infer\.strategy_args\.strategy_config\.mem_fraction_static must"),
        ({"load_format": "gguf"}, r"actor_infer\.strategy_args\.strategy_config\.load_format='gguf'"),
    ],
    ids=["unknown", "range", "load_format"],
)
def test_strategy_config_errors_name_the_key(tiny_model_dir, strategy_config, message):
    config = worker_config(tiny_model_dir, "actor_infer",
                           strategy_args={"strategy_name": "sglang", "strategy_config": strategy_config})  # fmt: skip
    with pytest.raises(WorkerConfigError, match=message):
        create_strategy(config, "actor_infer")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_without_sglang_initialize_names_the_install_command(tiny_model_dir):
    config = worker_config(tiny_model_dir, "actor_infer", strategy_args={"strategy_name": "sglang"})
    with pytest.raises(ImportError, match=r"strategy_name=sglang needs the sglang package.*rl-engines\[sglang\]"):
        create_strategy(config, "actor_infer").initialize()


def test_generate_builds_the_rollout_layout_from_sglang_answers(tiny_model_dir):
    strategy = stand_in_strategy(tiny_model_dir, temperature=0.8)
    out = strategy.generate(prompt_batch(tiny_model_dir, QUESTIONS))
    assert out.batch["responses"].shape == (6, 6)
    assert list(out.non_tensor_batch["question"]) == [q for q in QUESTIONS for _ in range(2)]
    mask = out.batch["response_mask"]
    expected = reference_log_probs(tiny_model_dir, out, temperature=0.8)
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask].double(), expected[mask], atol=2e-5, rtol=0)
    seeds = [row for row in out.batch["responses"].view(3, 2, -1)]
    assert all(not torch.equal(pair[0], pair[1]) for pair in seeds)  # one sampling_seed per sample
    again = strategy.generate(prompt_batch(tiny_model_dir, QUESTIONS))
    assert torch.equal(again.batch["responses"], out.batch["responses"])


def test_scoring_reads_the_response_input_log_probs(tiny_model_dir):
    strategy = stand_in_strategy(tiny_model_dir)
    batch = rollout_batch(batch_size=4)
    mask = batch.batch["response_mask"]
    got = strategy.compute_log_probs(batch, temperature=0.7).batch["log_probs"]
    torch.testing.assert_close(got[mask].double(), reference_log_probs(tiny_model_dir, batch, 0.7)[mask], atol=2e-5,
                               rtol=0)  # fmt: skip
    assert bool((got[~mask] == 0).all())


def test_load_weights_checks_names_and_sends_tied_names_together(tiny_model_dir):
    strategy = stand_in_strategy(tiny_model_dir)
    embed = torch.zeros(strategy.table.shapes["model.embed_tokens.weight"])
    assert strategy.load_weights(iter([("model.embed_tokens.weight", embed)])) == 1
    assert strategy.engine.updates[-1] == ["model.embed_tokens.weight", "lm_head.weight"]
    with pytest.raises(KeyError, match=r"'model\.layers\.9\.mlp\.up_proj\.weight'"):
        strategy.load_weights(iter([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))]))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape \(3,\)"):
        strategy.load_weights(iter([("model.norm.weight", torch.zeros(3))]))
    with pytest.raises(RuntimeError, match="cannot export its current weights"):
        strategy.named_weights()

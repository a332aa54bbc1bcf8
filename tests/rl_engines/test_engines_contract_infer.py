"""Contract suite for inference strategies: every registered ``kind == "infer"`` strategy must pass it.

In-process; expected log-probs come from an independent un-padded reference (see engine_fixtures).
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    prompt_batch,
    reference_log_probs,
    require_engine,
    rollout_batch,
    strategies_of_kind,
    tiny_model_dir,
    tiny_untied_model_dir,
    worker_config,
)

from rl_engines.config import GeneratingArgs
from rl_engines.strategies import create_strategy
from rl_engines.weight_sync import expand_aliases, iter_buckets, pack_for_store, unpack_from_store

__all__ = ["tiny_model_dir", "tiny_untied_model_dir"]

QUESTIONS = ["1+2=", "10+12=", "what is 3+3?"]


@pytest.fixture(params=strategies_of_kind("infer"))
def strategy_name(request: pytest.FixtureRequest) -> str:
    return require_engine(str(request.param))


def make(strategy_name, model_dir, role="actor_infer", **generating_args):
    args = {"max_new_tokens": 6, "num_return_sequences": 2, "seed": 3, **generating_args}
    config = worker_config(model_dir, role, generating_args=args, infer_batch_size=2,
                           strategy_args={"strategy_name": strategy_name})  # fmt: skip
    strategy = create_strategy(config, role)
    strategy.initialize()
    return strategy


def test_generate_returns_the_rollout_layout(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir)
    prompts = prompt_batch(tiny_model_dir, QUESTIONS)
    out = strategy.generate(prompts)
    rows, width = 2 * len(QUESTIONS), 6
    assert out.batch["responses"].shape == (rows, width)
    assert out.batch["input_ids"].shape == (rows, prompts.batch["input_ids"].shape[1] + width)
    assert list(out.non_tensor_batch["question"]) == [q for q in QUESTIONS for _ in range(2)]
    assert set(out.non_tensor_batch["finish_reasons"]) <= {"stop", "length"}
    mask = out.batch["response_mask"]
    lengths = mask.sum(dim=1)
    assert torch.equal(mask, torch.arange(width)[None, :] < lengths[:, None])  # a prefix of the row
    for row, reason in enumerate(out.non_tensor_batch["finish_reasons"]):
        assert (reason == "length") == (int(lengths[row]) == width and out.batch["responses"][row, -1] != 2)
    assert torch.equal(out.batch["attention_mask"][:, -width:].bool(), mask)


def test_sampled_log_probs_equal_teacher_forced_reference(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, temperature=0.8, top_p=0.9, top_k=20)
    out = strategy.generate(prompt_batch(tiny_model_dir, QUESTIONS))
    mask = out.batch["response_mask"]
    expected = reference_log_probs(tiny_model_dir, out, temperature=0.8)
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask].double(), expected[mask], atol=2e-5, rtol=0)
    assert bool((out.batch["rollout_log_probs"][~mask] == 0).all())
    scored = strategy.compute_log_probs(out, temperature=0.8).batch["log_probs"]
    torch.testing.assert_close(scored[mask].double(), expected[mask], atol=2e-5, rtol=0)


def test_seeded_sampling_is_reproducible_and_seed_dependent(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, max_new_tokens=8)
    prompts = prompt_batch(tiny_model_dir, QUESTIONS)
    first, second = strategy.generate(prompts), strategy.generate(prompts)
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    other = strategy.generate(prompts, GeneratingArgs(max_new_tokens=8, num_return_sequences=2, seed=4))
    assert not torch.equal(first.batch["responses"], other.batch["responses"])


def test_greedy_decoding_follows_the_argmax(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, temperature=0.0, num_return_sequences=1)
    out = strategy.generate(prompt_batch(tiny_model_dir, QUESTIONS[:1]))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    context = out.batch["prompts"][0][out.batch["attention_mask"][0, : out.batch["prompts"].shape[1]].bool()]
    tokens = context.tolist()
    with torch.no_grad():
        for step in range(int(out.batch["response_mask"][0].sum())):
            expected = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
            assert int(out.batch["responses"][0, step]) == expected
            tokens.append(expected)


def _sample(strategy, prompts, seed):
    args = GeneratingArgs(max_new_tokens=8, seed=seed)
    return strategy.generate(prompts, args).batch["responses"][0].tolist()


def _clean_draw(strategy, prompts, seed):
    """No EOS in the first 4 tokens, and tokens 1-2 decode to whole ASCII characters (byte-level BPE can split a
    character across tokens, and then the text of a token slice is not a substring of the whole)."""
    tokens = _sample(strategy, prompts, seed)
    text = strategy.tokenizer.decode(tokens[1:3])
    return 2 not in tokens[:4] and text.isascii() and text.isprintable() and text.strip()


def test_eos_and_stop_strings_end_a_response(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir, temperature=0.0, num_return_sequences=1, max_new_tokens=8)
    prompts = prompt_batch(tiny_model_dir, QUESTIONS[:1])
    free = strategy.generate(prompts)
    tokens = free.batch["responses"][0].tolist()
    stop_token = tokens[3]
    strategy.model.generation_config.eos_token_id = [2, stop_token]  # the 4th greedy token now ends the response
    stopped = strategy.generate(prompts)
    first_hit = tokens.index(stop_token)
    assert int(stopped.batch["response_mask"][0].sum()) == first_hit + 1
    assert stopped.non_tensor_batch["finish_reasons"][0] == "stop"
    strategy.model.generation_config.eos_token_id = 2
    sampler = make(strategy_name, tiny_model_dir, temperature=1.0, num_return_sequences=1, max_new_tokens=8)
    seed = next(s for s in range(200) if _clean_draw(sampler, prompts, s))
    sampled = _sample(sampler, prompts, seed)
    text = sampler.tokenizer.decode(sampled[1:3])
    # ROLL's include_stop_str_in_output: true (its default): the response keeps the tokens that formed the string
    args = GeneratingArgs(max_new_tokens=8, seed=seed, stop_strings=[text], include_stop_str_in_output=True)
    by_string = sampler.generate(prompts, args)
    length = int(by_string.batch["response_mask"][0].sum())
    assert 1 <= length <= 3 and by_string.non_tensor_batch["finish_reasons"][0] == "stop"
    assert by_string.batch["responses"][0, :length].tolist() == sampled[:length]  # same draw, cut at the string
    prompt_tail = sampler.tokenizer.decode(prompts.batch["input_ids"][0, -16:].tolist())
    assert (prompt_tail + sampler.tokenizer.decode(sampled[:length])).endswith(text)


def test_right_padded_prompts_are_rejected(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir)
    prompts = prompt_batch(tiny_model_dir, QUESTIONS)
    prompts.batch["attention_mask"] = prompts.batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="left-padded"):
        strategy.generate(prompts)


def test_loaded_weights_change_the_scores_exactly(strategy_name, tiny_model_dir, tiny_untied_model_dir):
    """Weights of another model pushed in through buckets: scores equal that model's reference."""
    from transformers import AutoModelForCausalLM

    strategy = make(strategy_name, tiny_model_dir)
    source = AutoModelForCausalLM.from_pretrained(str(tiny_untied_model_dir)).state_dict()
    source = {k: v for k, v in source.items() if k != "lm_head.weight"}  # the receiver ties lm_head to embeddings
    for bucket in iter_buckets(source.items(), bucket_bytes=20_000):
        strategy.load_weights(expand_aliases(unpack_from_store(pack_for_store(bucket))))
    batch = rollout_batch(batch_size=3)
    mask = batch.batch["response_mask"]
    got = strategy.compute_log_probs(batch).batch["log_probs"]
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    reference.load_state_dict(source, strict=False)
    reference.tie_weights()
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        expected = reference_log_probs(folder, batch)
    torch.testing.assert_close(got[mask].double(), expected[mask], atol=2e-5, rtol=0)


def test_load_weights_names_a_foreign_or_misshaped_tensor(strategy_name, tiny_model_dir):
    strategy = make(strategy_name, tiny_model_dir)
    with pytest.raises(KeyError, match=r"'model\.layers\.9\.mlp\.up_proj\.weight'"):
        strategy.load_weights(iter([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))]))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape \(3,\)"):
        strategy.load_weights(iter([("model.norm.weight", torch.zeros(3))]))


def test_generation_sets_sampling_flags_only_when_sampling(tiny_model_dir):
    """transformers ignores top_k / top_p / temperature when decoding greedily and warns about each one set ("The
    following generation flags are not valid and may be ignored: ['top_k']"): greedy passes none of them, sampling
    always sets top_k (0 = off, so the model's default of 50 cannot switch it on). Greedy tokens do not change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_engines.strategies.generation import _generation_config, sample_responses

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    greedy = [GeneratingArgs(max_new_tokens=6, temperature=0.0, top_k=k, top_p=p) for k, p in ((-1, 1.0), (5, 0.5))]
    for args in greedy:
        config = _generation_config(model, tokenizer, args)
        config.validate(strict=True)  # raises for any flag this decoding mode ignores
        assert (config.do_sample, config.temperature, config.top_k, config.top_p) == (False, None, None, None)
    sampling = _generation_config(model, tokenizer, GeneratingArgs(temperature=0.7))
    sampling.validate(strict=True)
    assert (sampling.do_sample, sampling.temperature, sampling.top_k) == (True, 0.7, 0)
    assert _generation_config(model, tokenizer, GeneratingArgs(top_k=20)).top_k == 20
    prompts = prompt_batch(tiny_model_dir, QUESTIONS)
    with torch.no_grad():
        first, second = (sample_responses(model, tokenizer, prompts, args, torch.device("cpu")) for args in greedy)
    assert torch.equal(first.batch["responses"], second.batch["responses"])

"""Shared pieces of the rl-engines tests: a tiny local model, rollout batches, and independent references.

Import the fixtures into a test module with ``from engine_fixtures import tiny_model_dir`` (pytest finds
fixtures in the module namespace).
"""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfig
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

CORPUS = [f"{a}+{b}={a + b}" for a in range(40) for b in range(40)] + ["the answer is <answer>7</answer>"]


# Adapters whose engine is not importable here are skipped with the reason (issue 6 adds them).
ENGINE_OF = {"deepspeed_train": "deepspeed", "megatron_train": "megatron", "megatron_infer": "megatron",
             "vllm": "vllm", "sglang": "sglang"}  # fmt: skip


def strategies_of_kind(kind: str) -> list[str]:
    """Registered strategy names of ``kind`` ("train" or "infer"): the contract suites' parameters."""
    from rl_engines.strategies import STRATEGIES

    return [name for name in STRATEGIES.names() if STRATEGIES.get(name).kind == kind]


def require_engine(name: str) -> str:
    """``name`` itself, or a pytest skip naming the engine package that is not installed."""
    import importlib.util

    module = ENGINE_OF.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{name}: engine {module} is not installed")
    if module == "megatron":  # CPU-only torch: the test harness's shims (megatron_shims), never product code
        import megatron_shims

        megatron_shims.apply()
    return name


def make_tiny_model(path: Path, *, tie: bool = True, seed: int = 0) -> Path:
    """A tokenizer + random Qwen2 model folder at ``path``."""
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(path)))
    build_tiny_causal_lm(path, vocab_size=vocab, tie_word_embeddings=tie, seed=seed)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session-wide tiny model with tied embeddings."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_tied"))


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session-wide tiny model without tied embeddings."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_untied"), tie=False, seed=1)


def worker_config(model_dir: Path, role: str = "actor_train", **sections: Any) -> WorkerConfig:
    """A validated WorkerConfig for ``role`` on ``model_dir``; ``sections`` override YAML-style keys."""
    values: dict[str, Any] = {"model_args": {"model_name_or_path": str(model_dir)}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    return WorkerConfig.from_dict(values, role)


def prompt_batch(model_dir: Path, questions: list[str]) -> RolloutBatch:
    """Left-padded chat prompts with the question kept as a non-tensor entry."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return RolloutBatch(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}, {"question": questions}
    )


def rollout_batch(batch_size: int = 8, prompt_len: int = 6, resp_len: int = 5, seed: int = 0) -> RolloutBatch:
    """Random prompts (some left padding) and responses (some right padding) plus advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 250, (batch_size, prompt_len), generator=gen)
    responses = torch.randint(3, 250, (batch_size, resp_len), generator=gen)
    attention = torch.ones(batch_size, prompt_len + resp_len, dtype=torch.long)
    response_mask = torch.ones(batch_size, resp_len, dtype=torch.bool)
    for row in range(batch_size):
        attention[row, : row % 3] = 0  # left padding of the prompt
        cut = resp_len - (row % 2) * (1 + row % resp_len // 2)
        response_mask[row, cut:] = False
        attention[row, prompt_len + cut :] = 0
    return RolloutBatch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "response_mask": response_mask,
            "advantages": torch.randn(batch_size, resp_len, generator=gen),
        }
    )


def reference_log_probs(model_dir: Path, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """Slow, independent reference: one un-padded forward per response token with a freshly loaded model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    prompt_len = prompts.shape[1]
    mask = batch.batch["attention_mask"][:, :prompt_len].bool()
    out = torch.zeros(responses.shape, dtype=torch.float64)
    with torch.no_grad():
        for row in range(responses.shape[0]):
            context = prompts[row][mask[row]].tolist()
            for t in range(responses.shape[1]):
                if not batch.batch["response_mask"][row, t]:
                    break
                logits = model(torch.tensor([context])).logits[0, -1].double() / temperature
                out[row, t] = torch.log_softmax(logits, -1)[responses[row, t]]
                context.append(int(responses[row, t]))
    return out


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """In this process, a write past ``limit`` bytes of a file fails with EFBIG (RLIMIT_FSIZE, SIGXFSZ ignored) as
    a write to a full disk fails with ENOSPC; the limit is lifted again on exit."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def leftovers(root: Path) -> list[str]:
    """Temporary files and folders of saves under ``root`` (``*.tmp*``, ``*.old``), relative to it."""
    found = [p for p in root.rglob("*") if ".tmp" in p.name or p.name.endswith(".old")]
    return sorted(str(p.relative_to(root)) for p in found)


def assert_actor_step_equals(ours: list[dict[str, float]], theirs: dict[str, float], *, router: bool = False) -> None:
    """A train step on several ranks (their metrics, as ``train_step`` returns them to the driver) equals one rank's
    (``theirs``, a strategy's own names): every rank reports the same metrics, pg_loss to 1e-6, the gradient norm and,
    with ``router``, the router's load-balancing loss (ROLL's ``actor_train/`` name) to a relative 1e-5."""
    assert len(ours) > 1 and all(metrics == ours[0] for metrics in ours)
    assert ours[0]["actor/pg_loss"] == pytest.approx(theirs["pg_loss"], abs=1e-6)
    assert ours[0]["actor/grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    if router:
        assert ours[0]["actor_train/load_balancing_loss"] == pytest.approx(theirs["load_balancing_loss"], rel=1e-5)


def assert_critic_matches(critic: Any, single: Any, batch: RolloutBatch, update_atol: float) -> None:
    """A critic role on several ranks scores, trains and scores again as one rank's strategy ``single`` built from the
    same seeded value head: values to 2e-6, value loss to 1e-6, gradient norm to a relative 1e-5, the values after the
    update to ``update_atol``."""
    from rl_engines.objectives import CriticObjective

    mask = batch.batch["response_mask"]
    values = critic.call("compute_values", batch, dispatch="dp_split").batch["values"]
    expected = single.compute_values(batch).batch["values"]
    torch.testing.assert_close(values[mask], expected[mask], atol=2e-6, rtol=0)
    batch.batch["values"] = expected
    batch.batch["returns"] = torch.randn(batch.batch["responses"].shape, generator=torch.Generator().manual_seed(5))
    metrics = critic.call("train_step", batch, CriticObjective(), dispatch="dp_split")
    single_metrics = single.train_step(batch, CriticObjective())
    assert metrics[0]["critic/value_loss"] == pytest.approx(single_metrics["value_loss"], abs=1e-6)
    assert metrics[0]["critic/grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
    after = critic.call("compute_values", batch, dispatch="dp_split").batch["values"]
    torch.testing.assert_close(
        after[mask], single.compute_values(batch).batch["values"][mask], atol=update_atol, rtol=0
    )

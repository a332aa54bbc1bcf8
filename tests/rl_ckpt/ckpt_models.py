"""Tiny random HF models for the rl_ckpt tests (built locally, no download)."""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

VOCAB = 250  # deliberately not a multiple of the Megatron padding (128 * TP)
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}


def config_for(family: str, tied: bool) -> transformers.PretrainedConfig:
    """A tiny config of ``family`` (qwen2 / llama / mistral / qwen3)."""
    cls = {
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen3": transformers.Qwen3Config,
    }[family]
    extra = {"head_dim": 24} if family == "qwen3" else {}  # Qwen3: head_dim != hidden / heads
    return cls(**SIZES, **extra, tie_word_embeddings=tied)


def save_tiny_model(
    path: Path, family: str = "qwen2", tied: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Random-init model saved as sharded safetensors; every parameter (norms, biases too) randomized."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_for(family, tied))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.to(dtype).save_pretrained(str(path), max_shard_size="100KB")
    return path


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def checked_sharded_output(out: Path) -> list[str]:
    """Every tensor name of a converted folder written in several shards, after checking the shared invariants:
    shard names ``-of-N``, no partial files, each tensor in the shard the index names, ``total_size`` = the fp32
    bytes. Returns the names in shard order (callers compare them with what they expect)."""
    import json

    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and not list(out.glob(".partial*"))
    seen, total = [], 0
    for shard in shards:
        assert shard.name.endswith(f"-of-{len(shards):05d}.safetensors")
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                seen.append(key)
                assert index["weight_map"][key] == shard.name
                total += f.get_tensor(key).numel() * 4
    assert sorted(seen) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == total
    return seen


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """In this process, a write past ``limit`` bytes of a file fails with EFBIG (RLIMIT_FSIZE, SIGXFSZ ignored) as
    a write to a full disk fails with ENOSPC; lifted again on exit."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)

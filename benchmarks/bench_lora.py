"""Benchmark: LoRA against full-parameter training on the same model, in one run (issue 18).

One ``fsdp2_train`` strategy per variant (a world of one, CPU or the local GPU), the same tiny Qwen2 model and the
same batches. Reported per variant: trainable parameters, optimizer-state bytes (AdamW's two moments), bytes of the
model's own parameters, bytes one weight sync moves (merged weights; the adapters alone where an engine takes
adapters), mean train-step seconds over ``--steps`` steps after one warm-up step, and the ratios against the full
model. The last line is what a LoRA run saves by not loading a reference copy: the bytes of the reference role's
model (``hf_infer`` in the compute dtype), measured by loading it.

Run: python benchmarks/bench_lora.py [--hidden 512] [--layers 4] [--rank 8] [--steps 5] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from rl_engines.config import WorkerConfig
from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_causal_lm

VARIANTS = {
    "full": {},
    "lora all-linear": {"lora_target": "all-linear"},
    "lora q,v": {"lora_target": "q_proj,v_proj"},
}


def batch(vocab: int, size: int, prompt: int, response: int, seed: int) -> Any:
    from rl_core.batch import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (size, prompt), generator=gen)
    responses = torch.randint(3, vocab, (size, response), generator=gen)
    return RolloutBatch({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.ones(size, prompt + response, dtype=torch.long),
        "response_mask": torch.ones(size, response, dtype=torch.bool),
        "advantages": torch.randn(size, response, generator=gen),
    })  # fmt: skip


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct tensors (a tied weight, yielded under two names, travels once)."""
    distinct = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in distinct.values())


def measure(model: Path, model_args: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    config = WorkerConfig.from_dict({
        "model_args": {"model_name_or_path": str(model), "dtype": args.dtype, "lora_rank": args.rank,
                       "disable_gradient_checkpointing": True, **model_args},
        "training_args": {"learning_rate": 1e-4, "per_device_train_batch_size": args.batch},
    }, "actor_train")  # fmt: skip
    strategy = create_strategy(config, "actor_train")
    strategy.initialize()
    params = list(strategy.model.parameters())
    data = batch(args.vocab, args.batch, args.prompt, args.response, seed=0)
    data.batch["old_log_probs"] = strategy.compute_log_probs(data).batch["log_probs"]
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        strategy.train_step(data, ActorObjective())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step:  # the first step builds the optimizer state
            times.append(time.perf_counter() - start)
    state = [v for s in strategy.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    adapters = tensor_bytes(t for _, t in strategy.adapter_weights()) if model_args else 0
    return {
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "optimizer_bytes": tensor_bytes(state),
        "param_bytes": tensor_bytes(params),
        "sync_bytes": tensor_bytes(t for _, t in strategy.named_weights()),
        "adapter_sync_bytes": adapters,
        "step_s": statistics.mean(times),
    }


def reference_bytes(model: Path, dtype: str) -> int:
    config = WorkerConfig.from_dict({"model_args": {"model_name_or_path": str(model), "dtype": dtype},
                                     "strategy_args": {"strategy_name": "hf_infer"}}, "reference")  # fmt: skip
    strategy = create_strategy(config, "reference")
    strategy.initialize()
    return tensor_bytes(strategy.model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29617"))
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        model = Path(tmp) / "model"
        build_tiny_causal_lm(model, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                             max_position_embeddings=1024)  # fmt: skip
        results = {name: measure(model, extra, args) for name, extra in VARIANTS.items()}
        reference = reference_bytes(model, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"fsdp2_train on {device}, {args.dtype}; model hidden {args.hidden} x {args.layers} layers, vocab "
        f"{args.vocab}; LoRA rank {args.rank}; batch {args.batch} x ({args.prompt} + {args.response}) tokens"
    )
    print(
        "| variant | trainable | vs full | optimizer MiB | vs full | params MiB | sync MiB (merged) | adapter MiB | "
        "step s | vs full |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    full = results["full"]
    for name, r in results.items():
        mb = {key: r[key] / 2**20 for key in ("optimizer_bytes", "param_bytes", "sync_bytes", "adapter_sync_bytes")}
        print(f"| {name} | {r['trainable']:,} | {r['trainable'] / full['trainable']:.4f} | "
              f"{mb['optimizer_bytes']:.2f} | {r['optimizer_bytes'] / full['optimizer_bytes']:.4f} | "
              f"{mb['param_bytes']:.2f} | {mb['sync_bytes']:.2f} | {mb['adapter_sync_bytes']:.3f} | "
              f"{r['step_s']:.3f} | {r['step_s'] / full['step_s']:.2f} |")  # fmt: skip
    print(f"reference copy a LoRA run does not load (hf_infer, {args.dtype}): {reference / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()

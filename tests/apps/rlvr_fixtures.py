"""The tiny RLVR setup shared by the pipeline and alignment tests: a local tiny model, arithmetic prompts, a
ROLL-style config (``rlvr.yaml``) with two CPU slots for every role."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

CONFIG = """\
exp_name: tiny_rlvr
track_with: tensorboard
seed: 7
output_dir: {out}
num_gpus_per_node: 2
max_steps: 2
rollout_batch_size: 4
num_return_sequences_in_group: 2
prompt_length: 64
response_length: 8
adv_estimator: grpo
use_kl_loss: true
kl_loss_coef: 0.01
rollout_is_threshold: 2.0
pretrain: {model}
actor_train:
  device_mapping: [0, 1]
  training_args: {{learning_rate: 1.0e-3, per_device_train_batch_size: 2, gradient_accumulation_steps: 2}}
  data_args: {{template: native, file_name: {data}, prompt: prompt}}
  infer_batch_size: 4
actor_infer:
  device_mapping: [0, 1]
  strategy_args: {{strategy_name: hf_infer}}
  generating_args:
    max_new_tokens: ${{response_length}}
    num_return_sequences: ${{num_return_sequences_in_group}}
  infer_batch_size: 4
reference:
  device_mapping: [0, 1]
  strategy_args: {{strategy_name: hf_infer}}
eval_steps: 1
val_batch_size: 3
validation:
  data_args: {{file_name: {data}}}
  generating_args: {{max_new_tokens: 8, temperature: 0.0, num_return_sequences: 1}}
rewards:
  math_rule:
    worker_cls: roll.pipeline.rlvr.rewards.math_rule_reward_worker.MathRuleRewardWorker
"""


def make_setup(root: Path, **model: int) -> Path:
    """Model (``model`` overrides build_tiny_causal_lm's sizes), data and ``rlvr.yaml`` under ``root``."""
    corpus = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    build_tiny_tokenizer(root / "model", corpus, vocab_size=256)
    build_tiny_causal_lm(root / "model", vocab_size=259, **model)
    rows = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b)} for a in range(4) for b in range(4)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = CONFIG.format(out=root / "out", model=root / "model", data=root / "train.jsonl")
    (root / "rlvr.yaml").write_text(config)
    return root


def megatron_shim_overrides(root: Path) -> list[str]:
    """``system_envs`` overrides that make Ray workers apply tests/rl_engines/megatron_shims.py (megatron-core's CUDA
    assumptions on a CPU-only torch) through a sitecustomize on their PYTHONPATH; never product code."""
    path = Path(__file__).resolve().parents[1] / "rl_engines" / "megatron_shims.py"
    spec = importlib.util.spec_from_file_location("megatron_shims", path)
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [f"+system_envs.{name}='{value}'" for name, value in module.worker_envs(root).items()]

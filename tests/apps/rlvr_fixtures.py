"""The tiny RLVR setup shared by the pipeline and alignment tests: a local tiny model, arithmetic prompts, a
ROLL-style config (``rlvr.yaml``) on two CPU slots: actor_train and actor_infer on both, the reference on the
first (each rank is a process that imports torch and transformers: one fewer saves seconds of every run)."""

from __future__ import annotations

import importlib.util
import json
import os
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
  data_args: {{template: native, file_name: {data}, messages: messages}}
  infer_batch_size: 4
actor_infer:
  device_mapping: [0, 1]
  strategy_args: {{strategy_name: hf_infer}}
  generating_args:
    max_new_tokens: ${{response_length}}
    num_return_sequences: ${{num_return_sequences_in_group}}
  infer_batch_size: 4
reference:
  device_mapping: [0]
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


NO_KL = ["use_kl_loss=false", "kl_loss_coef=0", "init_kl_coef=0"]
"""Overrides for runs about something else than the KL: no KL term, so the reference does not start (ROLL's
enable_reference) and each run starts one process fewer."""


def make_setup(root: Path, **model: int) -> Path:
    """Model (``model`` overrides build_tiny_causal_lm's sizes), data and ``rlvr.yaml`` under ``root``."""
    corpus = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    build_tiny_tokenizer(root / "model", corpus, vocab_size=256)
    build_tiny_causal_lm(root / "model", vocab_size=259, **model)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "ground_truth": str(a + b)}
            for a in range(4) for b in range(4)]  # fmt: skip
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = CONFIG.format(out=root / "out", model=root / "model", data=root / "train.jsonl")
    (root / "rlvr.yaml").write_text(config)
    return root


def _rl_engines_test_module(name: str) -> Any:
    """A helper module of tests/rl_engines (not on this folder's import path), loaded from its file."""
    path = Path(__file__).resolve().parents[1] / "rl_engines" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def file_size_limit(limit: int) -> Any:
    """tests/rl_engines/engine_fixtures.py's ``file_size_limit``: in this process, writes past ``limit`` bytes of a
    file fail with EFBIG, as on a full disk (a context manager)."""
    return _rl_engines_test_module("engine_fixtures").file_size_limit(limit)


FILE_SIZE_SITECUSTOMIZE = """import collections, functools, resource, signal
import rl_engines.role_worker as role_worker

calls = collections.Counter()


def full_disk(method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        calls[method.__name__] += 1
        if calls[method.__name__] <= {after}:
            return method(*args, **kwargs)
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, old[1]))
        try:
            return method(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
    return call


signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
for name in ("save_checkpoint", "save_hf"):
    setattr(role_worker.RoleWorker, name, full_disk(getattr(role_worker.RoleWorker, name)))
"""


def file_size_limit_overrides(root: Path, limit: int, after: int = 0) -> list[str]:
    """``system_envs`` overrides under which the Ray workers' checkpoint saves and HF exports, after the first
    ``after`` of each, may write files of at most ``limit`` bytes: a sitecustomize on their PYTHONPATH wraps
    ``RoleWorker.save_checkpoint`` / ``save_hf`` so that RLIMIT_FSIZE holds during those calls (SIGXFSZ ignored),
    and a larger write fails with EFBIG as one to a full disk fails with ENOSPC. Test harness only: product code has
    no hook; the driver and the other calls (the weight sync's shared memory) keep no limit."""
    folder = root / "file_size_sitecustomize"
    folder.mkdir(parents=True, exist_ok=True)
    text = FILE_SIZE_SITECUSTOMIZE.replace("{after}", str(after)).replace("{limit}", str(limit))
    (folder / "sitecustomize.py").write_text(text, encoding="utf-8")
    repo = Path(__file__).resolve().parents[2]  # actors import `apps` (the reward workers)
    paths = [str(folder), str(repo), os.environ.get("PYTHONPATH", "")]
    return [f"+system_envs.PYTHONPATH='{os.pathsep.join(p for p in paths if p)}'"]

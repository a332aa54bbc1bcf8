"""The tiny agentic setup shared by the pipeline tests: a local tiny model and a ROLL-style config
(``agentic.yaml``) with FrozenLake and Sokoban environments on two CPU slots: actor_infer on both, actor_train on the
first (each rank is a process that imports torch and transformers; training on several ranks is the shared training
code of apps/common, tested with the RLVR pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_core.batch import RolloutBatch
from rl_engines.role_worker import RoleWorker
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

CONFIG = """\
exp_name: tiny_agentic
track_with: stdout
seed: 3
output_dir: {out}
render_save_dir: {out}/render
num_gpus_per_node: 2
max_steps: 2
eval_steps: 1
rollout_batch_size: 8
val_batch_size: 4
sequence_length: 600
max_tokens_per_step: 6
adv_estimator: grpo
init_kl_coef: 0.0
entropy_loss_coef: 0.1
rollout_is_threshold: 2.0
reward_normalization: {{grouping: traj_group_id, method: mean_std}}
pretrain: {model}
actor_train:
  device_mapping: [0]
  training_args: {{learning_rate: 1.0e-3, per_device_train_batch_size: 2, gradient_accumulation_steps: 2}}
  infer_batch_size: 4
actor_infer:
  device_mapping: [0, 1]
  strategy_args: {{strategy_name: hf_infer}}
  generating_args: {{max_new_tokens: 6, num_return_sequences: 1}}
  infer_batch_size: 4
train_env_manager:
  num_env_groups: 2
  group_size: 2
  tags: [FrozenLake, SimpleSokoban]
  num_groups_partition: [1, 1]
  format_penalty: -0.05
val_env_manager:
  num_env_groups: 2
  group_size: 1
  tags: [FrozenLake, SimpleSokoban]
custom_envs:
  FrozenLake:
    env_type: frozen_lake
    max_steps: 3
    agent_template: "{{observation}}\\nTurn {{turn_idx}}:"
    env_config: {{is_slippery: false, max_steps: 3}}
  SimpleSokoban:
    env_type: sokoban
    max_steps: 2
    agent_template: "{{observation}}\\nTurn {{turn_idx}}:"
    env_config: {{dim_room: [5, 5], num_boxes: 1, max_steps: 2, search_depth: 6}}
"""


def make_setup(root: Path) -> Path:
    """Model and ``agentic.yaml`` under ``root``."""
    from apps.agentic.envs import make_env

    corpus = ["<answer>Up</answer> <answer>Down</answer> <answer>Left</answer> <answer>Right</answer>"]
    corpus += [make_env(kind).instructions for kind in ("frozen_lake", "sokoban")]
    build_tiny_tokenizer(root / "model", corpus, vocab_size=500)
    build_tiny_causal_lm(root / "model", vocab_size=503, max_position_embeddings=1024)
    (root / "agentic.yaml").write_text(CONFIG.format(out=root / "out", model=root / "model"))
    return root


class InProcessGroup:
    """actor_infer's strategy in this process behind the one call the runner makes (world size 1)."""

    world_size = 1

    def __init__(self, worker: RoleWorker) -> None:
        self.worker = worker

    def call(self, method: str, batch: RolloutBatch, args: Any, dispatch: str) -> RolloutBatch:
        assert method == "generate" and dispatch == "dp_split"
        return self.worker.generate(batch, args)  # type: ignore[no-any-return]

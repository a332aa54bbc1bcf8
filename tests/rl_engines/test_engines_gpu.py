"""GPU-only behaviour of the built-in strategies (skipped on CPU machines by the ``gpu`` marker).

The contract suites run on GPU unchanged (strategies pick ``cuda`` when it is visible); these tests add what only
a GPU shows: offload really frees device memory, and bf16 compute with fp32 master weights trains.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import rollout_batch, tiny_model_dir, worker_config

from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_causal_lm

__all__ = ["tiny_model_dir"]

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def wide_model_dir(tiny_model_dir, tmp_path_factory):
    """~14M parameters (56 MB fp32): large enough that freeing it shows against CUDA's own allocations."""
    folder = tmp_path_factory.mktemp("wide")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    build_tiny_causal_lm(folder, vocab_size=259, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    return folder


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _device_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")


def _state_tensors(strategy):
    params = [p.to_local() if hasattr(p, "to_local") else p for p in strategy.model.parameters()]
    optimizer = getattr(strategy, "optimizer", None)
    states = (
        [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    )
    return params + [s.to_local() if hasattr(s, "to_local") else s for s in states]


def _check_offload(strategy, batch) -> None:
    """Offload moves every parameter and optimizer tensor off the device and frees at least their bytes;
    reload brings them back and the model scores exactly as before. (Activation blocks the caching allocator
    still holds are not the strategy's to free, so the check counts the strategy's own tensors.)"""
    before = strategy.compute_log_probs(batch).batch["log_probs"]
    own = _device_bytes(_state_tensors(strategy))
    assert own > 0
    loaded = _allocated()
    strategy.offload()
    assert _device_bytes(_state_tensors(strategy)) == 0
    assert loaded - _allocated() >= 0.95 * own, (loaded, _allocated(), own)
    strategy.reload()
    assert _device_bytes(_state_tensors(strategy)) == own
    assert torch.equal(strategy.compute_log_probs(batch).batch["log_probs"], before)


def test_train_strategy_offload_frees_weights_and_optimizer_state(wide_model_dir):
    config = worker_config(wide_model_dir, training_args={"per_device_train_batch_size": 4})
    strategy = create_strategy(config, "actor_train")
    strategy.initialize()
    assert strategy.device.type == "cuda"
    batch = rollout_batch(batch_size=4)
    batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
    strategy.train_step(batch, ActorObjective())  # creates the optimizer state on the device
    _check_offload(strategy, batch)
    strategy.train_step(batch, ActorObjective())  # the optimizer still drives the same parameters


def test_infer_strategy_offload_frees_its_weights(wide_model_dir):
    config = worker_config(wide_model_dir, "actor_infer", strategy_args={"strategy_name": "hf_infer"})
    strategy = create_strategy(config, "actor_infer")
    strategy.initialize()
    _check_offload(strategy, rollout_batch(batch_size=2))


def test_bf16_compute_with_fp32_masters_trains(tiny_model_dir):
    config = worker_config(tiny_model_dir, model_args={"dtype": "bf16"},
                           training_args={"learning_rate": 3e-3, "per_device_train_batch_size": 4})  # fmt: skip
    strategy = create_strategy(config, "actor_train")
    strategy.initialize()
    assert all(p.dtype == torch.float32 for p in strategy.model.parameters())  # masters stay fp32
    batch = rollout_batch(batch_size=4)
    batch.batch["advantages"] = torch.ones_like(batch.batch["advantages"])
    mask = batch.batch["response_mask"]
    before = strategy.compute_log_probs(batch).batch["log_probs"][mask].mean()
    for _ in range(3):
        batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
        strategy.train_step(batch, ActorObjective())
    assert strategy.compute_log_probs(batch).batch["log_probs"][mask].mean() > before + 0.1


def test_offloaded_train_strategy_still_exports_and_computes(tiny_model_dir):
    """A colocated sync or score may reach an offloaded role: it reloads for the call and offloads again."""
    strategy = create_strategy(worker_config(tiny_model_dir), "actor_train")
    strategy.initialize()
    batch = rollout_batch(batch_size=2)
    expected = {name: value.cpu().clone() for name, value in strategy.named_weights()}
    strategy.offload()
    exported = {name: value.cpu() for name, value in strategy.named_weights()}
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[name], value) for name, value in expected.items())
    assert _device_bytes(_state_tensors(strategy)) == 0  # offloaded again after the export
    assert strategy.compute_log_probs(batch).batch["log_probs"].shape == batch.batch["responses"].shape

"""Strategies by ``strategy_args.strategy_name``.

Built in: ``fsdp2_train`` (torch-native FSDP2 training, CPU and GPU), ``fsdp2_infer`` (its frozen, sharded scoring
twin for log-prob roles), ``hf_infer`` (transformers generation and scoring) and the engine adapters
(``deepspeed_train``, ``megatron_train``, ``megatron_infer``, ``vllm``, ``sglang``), each of which imports its engine
only inside its module. A built-in strategy's module is imported when the strategy is first created, or when
``STRATEGIES`` (every strategy registered) is read from this package.
"""

from __future__ import annotations

from typing import Any

from rl_engines.strategies.base import (
    BUILT_IN_STRATEGIES,
    InferStrategy,
    Strategy,
    TrainStrategy,
    create_strategy,
    registered_strategies,
)

__all__ = ["BUILT_IN_STRATEGIES", "STRATEGIES", "InferStrategy", "Strategy", "TrainStrategy", "create_strategy"]


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":  # every built-in strategy registered
        return registered_strategies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Strategies by ``strategy_args.strategy_name``; importing this package registers the built-in ones.

Built in: ``fsdp2_train`` (torch-native FSDP2 training, CPU and GPU) and ``hf_infer`` (transformers generation
and scoring). Engine adapters (vLLM, SGLang, DeepSpeed, Megatron) import their engine only inside their module.
"""

from rl_engines.strategies import deepspeed_train as _deepspeed_train  # noqa: F401  (registers deepspeed_train)
from rl_engines.strategies import fsdp2 as _fsdp2  # noqa: F401  (registers fsdp2_train)
from rl_engines.strategies import hf_infer as _hf_infer  # noqa: F401  (registers hf_infer)
from rl_engines.strategies import megatron_infer as _megatron_infer  # noqa: F401  (registers megatron_infer)
from rl_engines.strategies import megatron_train as _megatron_train  # noqa: F401  (registers megatron_train)
from rl_engines.strategies import sglang_infer as _sglang_infer  # noqa: F401  (registers sglang)
from rl_engines.strategies import vllm_infer as _vllm_infer  # noqa: F401  (registers vllm)
from rl_engines.strategies.base import STRATEGIES, InferStrategy, Strategy, TrainStrategy, create_strategy

__all__ = ["STRATEGIES", "InferStrategy", "Strategy", "TrainStrategy", "create_strategy"]

"""rl_ckpt: Megatron-core <-> HuggingFace checkpoint conversion, streamed, verified by logits.

Imports no sibling package; needs torch and safetensors, and transformers only for ``--verify`` and config.json
validation.
"""

from rl_ckpt.__about__ import __version__
from rl_ckpt.errors import CheckpointError
from rl_ckpt.families import FAMILIES, ModelFamily
from rl_ckpt.hf_to_mcore import convert_hf_to_mcore
from rl_ckpt.mcore_to_hf import McoreCheckpoint, convert_mcore_to_hf, iter_hf_tensors, open_mcore_checkpoint
from rl_ckpt.spec import ModelSpec

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "McoreCheckpoint",
    "ModelFamily",
    "ModelSpec",
    "__version__",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "iter_hf_tensors",
    "open_mcore_checkpoint",
]

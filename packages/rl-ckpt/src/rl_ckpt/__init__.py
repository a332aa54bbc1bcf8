"""rl_ckpt: Megatron-core <-> HuggingFace and DeepSpeed ZeRO -> HuggingFace conversion, streamed, verified by logits.

Imports no sibling package; needs torch and safetensors, and transformers only for ``--verify`` and config.json
validation; DeepSpeed checkpoints need deepspeed and transformers (``rl-ckpt[deepspeed]``), imported on use.
"""

from rl_ckpt.__about__ import __version__
from rl_ckpt.deepspeed_io import DeepSpeedCheckpoint, open_deepspeed_checkpoint
from rl_ckpt.deepspeed_to_hf import convert_deepspeed_to_hf
from rl_ckpt.errors import CheckpointError
from rl_ckpt.families import FAMILIES, ModelFamily
from rl_ckpt.hf_to_mcore import convert_hf_to_mcore
from rl_ckpt.mcore_dist import DistCheckpoint
from rl_ckpt.mcore_merge import McoreSource
from rl_ckpt.mcore_to_hf import McoreCheckpoint, convert_mcore_to_hf, iter_hf_tensors, open_mcore_checkpoint
from rl_ckpt.spec import ModelSpec

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "DeepSpeedCheckpoint",
    "DistCheckpoint",
    "McoreCheckpoint",
    "McoreSource",
    "ModelFamily",
    "ModelSpec",
    "__version__",
    "convert_deepspeed_to_hf",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "iter_hf_tensors",
    "open_deepspeed_checkpoint",
    "open_mcore_checkpoint",
]

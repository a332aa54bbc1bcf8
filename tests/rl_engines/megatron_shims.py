"""Test-harness shims that let megatron-core 0.16.1 run on a CPU-only torch (gloo). Never imported by product code.

megatron-core assumes CUDA in a few places the Megatron strategies reach:

1. ``torch.cuda.current_device()`` names the device of communication buffers -> ``"cpu"``;
2. ``torch.cuda.synchronize()`` -> a no-op;
3. ``tensor_parallel.model_parallel_cuda_manual_seed`` builds CUDA RNG trackers -> the inference tracker
   (``inference_rng_tracker=True``), which forks no CUDA generator;
4. activation recomputation (``recompute_granularity``) saves / restores the CUDA RNG state -> a dummy state;
5. ``moe_utils`` names its Transformer Engine kernels only when TE imports, then tests ``te_general_gemm is not
   None`` (a NameError without TE) -> the missing names set to None, so MoE routing takes its torch path.

``apply()`` is idempotent. In-process tests call it from a fixture; every other process of the test session (Ray's
workers, subprocesses) gets ``apply_on_import()`` from the session's start-up hook
(tests/harness_site/sitecustomize.py), which applies the shims when megatron-core is first imported: no product code
needs a hook, no worker needs a runtime env for them (Ray starts such a worker through an extra interpreter), and a
process that never imports megatron-core imports nothing for them.
"""

from __future__ import annotations

import functools
from typing import Any

_applied = False
RANDOM = "megatron.core.tensor_parallel.random"
"""The megatron-core module whose CUDA RNG functions the shims replace."""
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
TE_KERNELS = ("te_general_gemm", "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
              "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
              "fused_sort_chunks_by_index_with_probs", "fused_unpermute")  # fmt: skip
"""The Transformer Engine kernels megatron-core's moe_utils leaves undefined when TE is not installed."""


def apply() -> None:
    """Install the four shims when this torch has no CUDA (no-op with CUDA or when already applied)."""
    import torch

    if _applied or torch.cuda.is_available():
        return
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.tensor_parallel.random as megatron_random
    import megatron.core.transformer.moe.moe_utils as moe_utils

    _patch(megatron_random)
    _patch_moe(moe_utils)
    tensor_parallel.model_parallel_cuda_manual_seed = megatron_random.model_parallel_cuda_manual_seed


def _patch_moe(moe_utils: Any) -> None:
    """Shim 5: the TE kernel names moe_utils lacks without TE, as None."""
    for name in TE_KERNELS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _patch(megatron_random: Any) -> None:
    """The shims, on torch and on ``megatron.core.tensor_parallel.random`` (before any module copied its names)."""
    global _applied
    import torch

    if _applied or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    seed = megatron_random.model_parallel_cuda_manual_seed

    @functools.wraps(seed)
    def cpu_seed(value: int, *args: Any, **kwargs: Any) -> None:
        kwargs["inference_rng_tracker"] = True
        seed(value, *args, **kwargs)

    megatron_random.model_parallel_cuda_manual_seed = cpu_seed
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.zeros(1, dtype=torch.uint8)
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    _applied = True


def apply_on_import() -> None:
    """Apply the shims when megatron-core is first imported (what the session's start-up hook calls in every
    process), so that a process imports nothing for them until (and unless) it imports megatron-core (which takes
    seconds)."""
    import import_hooks  # loaded by the session's start-up hook before it calls this

    import_hooks.after_import(RANDOM, _patch)
    import_hooks.after_import(MOE_UTILS, _patch_moe)

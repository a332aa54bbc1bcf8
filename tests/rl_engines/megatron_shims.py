"""Test-harness shims that let megatron-core 0.16.1 run on a CPU-only torch (gloo). Never imported by product code.

megatron-core assumes CUDA in a few places the Megatron strategies reach:

1. ``torch.cuda.current_device()`` names the device of communication buffers -> ``"cpu"``;
2. ``torch.cuda.synchronize()`` -> a no-op;
3. ``tensor_parallel.model_parallel_cuda_manual_seed`` builds CUDA RNG trackers -> the inference tracker
   (``inference_rng_tracker=True``), which forks no CUDA generator;
4. activation recomputation (``recompute_granularity``) saves / restores the CUDA RNG state -> a dummy state;
5. ``moe_utils`` names its Transformer Engine kernels only when TE imports, then tests ``te_general_gemm is not
   None`` (a NameError without TE) -> the missing names set to None, so MoE routing takes its torch path.

``apply()`` is idempotent. In-process tests call it from a fixture; Ray workers get it through
``sitecustomize_dir()``, a folder whose ``sitecustomize.py`` arranges at interpreter start-up that the shims are
applied when megatron-core is first imported (put the folder on the workers' ``PYTHONPATH`` via ``system_envs``), so
no product code needs a hook and a worker that never imports megatron-core imports nothing for them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
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
    """Apply the shims when megatron-core is first imported (what the Ray workers' sitecustomize calls), so that a
    process imports nothing for them until (and unless) it imports megatron-core: a worker of another engine started
    with the shims' PYTHONPATH pays nothing (megatron-core takes seconds to import)."""
    import import_hooks  # loaded by the session's start-up hook, which the shims' sitecustomize runs first

    import_hooks.after_import(RANDOM, _patch)
    import_hooks.after_import(MOE_UTILS, _patch_moe)


SITECUSTOMIZE = """import runpy
import sys
runpy.run_path({harness!r})  # the session's own start-up hook, which this sitecustomize shadows
sys.path.insert(0, {tests_dir!r})
import megatron_shims
megatron_shims.apply_on_import()
"""


def sitecustomize_dir(root: Path) -> Path:
    """A folder under ``root`` holding a ``sitecustomize.py`` that applies the shims at Python start-up."""
    folder = root / "megatron_sitecustomize"
    folder.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    text = SITECUSTOMIZE.format(tests_dir=str(here), harness=str(here.parent / "harness_site" / "sitecustomize.py"))
    (folder / "sitecustomize.py").write_text(text, encoding="utf-8")
    return folder


def worker_envs(root: Path) -> dict[str, str]:
    """``system_envs`` that make Ray workers apply the shims (PYTHONPATH led by the sitecustomize folder)."""
    paths = [str(sitecustomize_dir(root)), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}

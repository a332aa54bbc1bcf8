"""The alignment matrix's vision-language column (issue 23): RLVR rollouts of the tiny Qwen2.5-VL (pictures through
its image processor, ``multi_modal_inputs`` in every batch) dumped once by fsdp2_train on 2 data-parallel ranks,
then replayed, pictures and all (rl-replay stores the visual tensors bit for bit, without pickle), through
deepspeed_train ZeRO-3 on 2 ranks (parameters partitioned, the vision tower's too) and megatron_train with 2 pipeline
stages (the vision tower on the first, multimodal positions on both). The per-step pg_loss, total_loss, approx_kl
and grad_norm must agree within 1e-6 (measured: ZeRO-3 6e-7, Megatron 5e-7; fsdp2_train on 1 rank with twice the
gradient accumulation, measured too, within 2.4e-7). A replay that lost the pictures could not run at all: the
prompts' image pads need their patches ("Image features and image tokens do not match").
"""

from __future__ import annotations

import pytest

from apps.rlvr.alignment import ALIGNED, AlignmentResult, alignment_matrix
from apps.rlvr.demo_vl import CONFIG, ROOT, demo_vl_model, tasks, write_data
from rl_engines.vision import VISUAL_KEY
from rl_replay import RolloutReplay

pytestmark = pytest.mark.slow

# 4 pictures x 4 responses; 2 PPO epochs of 2 optimizer steps of 8 samples (2 ranks x 2 micro-batches of 2),
# so approx_kl is not trivially 0 and the second step trains from the moments the first left. A learning rate of
# 5e-5 (the demo's 1e-3 / 20): at 1e-3 Adam turns the rounding of near-zero gradients (many in the vision tower)
# into updates of the full rate, and the later optimizer steps' grad_norm differed by 3.8e-6 between 1 and 2 ranks
# (everything else within 2e-7); an entropy term did the same at any rate (its gradient sums terms that cancel).
BASE = ["max_steps=2", "rollout_batch_size=4", "num_return_sequences_in_group=4", "ppo_epochs=2",
        "actor_infer.device_mapping=[0]", "actor_train.training_args.learning_rate=5e-5",
        "actor_train.training_args.per_device_train_batch_size=2",
        "actor_train.training_args.gradient_accumulation_steps=2"]  # fmt: skip
STRATEGY = "actor_train.strategy_args"
# fp32 on CPU: what the order of the gradient reduction explains, and the engine's own kernels (ZeRO-3's
# partitioned parameters gathered per module); the 1e-6 for both.
TOLERANCE = 1e-6


def variants() -> dict[str, list[str]]:
    """fsdp2 on 2 data-parallel ranks (the reference), ZeRO-3 on 2, Megatron with 2 pipeline stages (one data rank:
    twice the gradient accumulation, the same 8 samples per optimizer step)."""
    megatron = [f"{STRATEGY}.strategy_name=megatron_train",
                f"+{STRATEGY}.strategy_config.pipeline_model_parallel_size=2",
                "actor_train.training_args.gradient_accumulation_steps=4"]  # fmt: skip
    zero3 = [f"{STRATEGY}.strategy_name=deepspeed_train", f"+{STRATEGY}.strategy_config.zero_stage=3"]
    return {"fsdp2_dp2": [], "zero3": zero3, "megatron_pp2": megatron}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, ray_session) -> tuple[AlignmentResult, RolloutReplay]:
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("alignment_vl")
    model = demo_vl_model(ROOT / ".cache" / "rlvr_demo_vl")  # the VL demo's warm model (its cache is shared)
    data = write_data(root / "data", tasks(8, seed=3))
    base = [*BASE, f"pretrain={model}", f"actor_train.data_args.file_name={data}"]
    result = alignment_matrix(CONFIG, base, variants(), root / "work")
    print("\n" + result.table())  # the matrix, for the issue notes (pytest -s)
    return result, RolloutReplay(str(root / "work" / "rollouts"), "mock")


def _assert_aligned(result: AlignmentResult, variant: str, tolerance: float) -> None:
    reference = result.metrics[result.reference]
    for key in ALIGNED:
        scale = max(1.0, max(abs(reference[step][key]) for step in reference))
        assert result.max_abs_diff(variant, key) <= tolerance * scale, (variant, key)


def test_vl_rollouts_replay_with_their_pictures_and_zero3_trains_like_fsdp2(matrix):
    result, dumps = matrix
    visual = list(dumps.load(0).non_tensor_batch[VISUAL_KEY])
    assert len(visual) == 16 and all(sample["pixel_values"].shape[0] > 0 for sample in visual)
    reference = result.metrics["fsdp2_dp2"]
    assert sorted(reference) == [0, 1]
    assert all(reference[step]["actor/pg_loss"] != 0.0 for step in reference)
    assert any(reference[step]["actor/ppo_kl"] != 0.0 for step in reference)
    _assert_aligned(result, "zero3", TOLERANCE)
    _assert_aligned(result, "megatron_pp2", TOLERANCE)

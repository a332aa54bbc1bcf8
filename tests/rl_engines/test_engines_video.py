"""Videos as frames (issue 23): rl_engines.video builds ``pixel_values_videos`` / ``video_grid_thw`` (and Qwen2.5-VL's
``second_per_grid_ts``) from the model's own image processor, and video prompts generate, score and train in the
torch-native engines like the HF model on each sample alone."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import CORPUS, worker_config
from test_engines_micro_batches import PACKED
from transformers import AutoTokenizer
from vl_fixtures import alone, ieee_fp32_convolutions, image, prompt_batch

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs
from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_vl_model
from rl_engines.video import encode_video
from rl_engines.vision import VISUAL_KEY, encode_images, encode_prompt, load_image_processor

__all__ = ["ieee_fp32_convolutions"]  # autouse: IEEE fp32 convolutions on CUDA
FPS = 1.0  # Qwen2.5-VL: second_per_grid_ts = 2 / FPS = 2 s, not the model's default of 1 s per temporal patch


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def video_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_vl_model(path, CORPUS, model_type=request.param)
    return path, request.param


def frames(count, seed, size=(56, 84)):
    return [image(*size, seed + k) for k in range(count)]


def timing(*counts):
    """Each video's frame times (seconds) at FPS: what Qwen3-VL's prompt timestamps come from."""
    return [[k / FPS for k in range(count)] for count in counts]


def test_a_still_video_equals_its_picture_through_the_image_path(video_model):
    path, model_type = video_model
    processor = load_image_processor(path)
    picture = image(56, 84, 0)
    video = encode_video(processor, [picture, picture], fps=FPS, model_type=model_type, frame_times=[0.0, 1.0])
    still = encode_images(processor, [picture])
    assert torch.equal(video["pixel_values_videos"], still["pixel_values"])
    assert video["video_grid_thw"].tolist() == still["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert ("second_per_grid_ts" in video) == (model_type == "qwen2_5_vl")


def test_frames_pair_up_in_time_and_an_odd_count_repeats_the_last(video_model):
    path, model_type = video_model
    processor = load_image_processor(path)
    shots = frames(3, 10)
    video = encode_video(processor, shots, fps=FPS, model_type=model_type, frame_times=timing(3)[0])
    assert video["video_grid_thw"].tolist() == [[2, 4, 6]]
    temporal, patch = processor.temporal_patch_size, processor.patch_size
    groups = video["pixel_values_videos"].reshape(2, 24, 3, temporal, patch * patch)
    alone_frames = [encode_images(processor, [shot])["pixel_values"].reshape(24, 3, temporal, -1) for shot in shots]
    for group, slot, frame in ((0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 2)):
        assert torch.equal(groups[group, :, :, slot], alone_frames[frame][:, :, 0]), (group, slot)
    if model_type == "qwen2_5_vl":
        assert video["second_per_grid_ts"].tolist() == [2.0]


def test_bad_videos_are_refused_naming_why(video_model):
    path, model_type = video_model
    processor = load_image_processor(path)
    with pytest.raises(ValueError, match=r"video inputs are built for .*not model_type 'qwen2'"):
        encode_video(processor, frames(2, 0), fps=FPS, model_type="qwen2")
    with pytest.raises(ValueError, match=r"frames must share one size"):
        encode_video(processor, [image(56, 84, 0), image(28, 28, 1)], fps=FPS, model_type=model_type,
                     frame_times=timing(2)[0])  # fmt: skip
    with pytest.raises(ValueError, match=r"at least one frame"):
        encode_video(processor, [], fps=FPS, model_type=model_type)
    with pytest.raises(ValueError, match=r"a qwen3_vl video needs each frame's time \(frame_times, 2 values\)"):
        encode_video(processor, frames(2, 0), fps=FPS, model_type="qwen3_vl")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    with pytest.raises(ValueError, match=r"2 video placeholder\(s\) and 1 video\(s\).*'<video>'"):
        encode_prompt("<video><video>what?", [], tokenizer, processor, [frames(2, 0)], fps=FPS, model_type=model_type,
                      frame_times=timing(2))  # fmt: skip


def video_prompts(path, model_type) -> RolloutBatch:
    """Left-padded prompts: a 3-frame video, a picture and a 2-frame video of another size in one prompt, text alone."""
    tokenizer, processor = AutoTokenizer.from_pretrained(str(path)), load_image_processor(path)
    options = {"fps": FPS, "model_type": model_type}
    items = [("<video>1+2=", [], [frames(3, 0)]), ("<image>3+<video>4=", [image(28, 56, 5)], [frames(2, 6, (28, 28))]),
             ("5+6=", [], [])]  # fmt: skip
    encoded = [encode_prompt(text, pictures, tokenizer, processor, videos, frame_times=timing(*map(len, videos)),
                             **options) for text, pictures, videos in items]  # fmt: skip
    return prompt_batch(encoded)


def test_video_prompts_generate_score_and_train_as_the_hf_model(video_model):
    """hf_infer generates from video prompts (its log-probs agree with a fresh forward), fsdp2_train scores them as
    the HF model on each sample alone, padded and packed alike, and trains. For Qwen2.5-VL the frames' timing
    (``second_per_grid_ts``) reaches the model: without it the log-probs differ."""
    path, model_type = video_model
    args = GeneratingArgs(max_new_tokens=4, temperature=1.0, num_return_sequences=2, seed=3)
    infer = create_strategy(worker_config(path, "actor_infer", generating_args=args.__dict__,
                                          strategy_args={"strategy_name": "hf_infer"}), "actor_infer")  # fmt: skip
    infer.initialize()
    rollout = infer.generate(video_prompts(path, model_type), args)
    mask = rollout.batch["response_mask"]
    expected = alone(path, rollout)
    torch.testing.assert_close(rollout.batch["rollout_log_probs"][mask], expected[mask], atol=1e-4, rtol=0)
    training = {"learning_rate": 1e-2, "per_device_train_batch_size": 6}
    for extra in ({}, PACKED):
        train = create_strategy(worker_config(path, training_args=training, infer_batch_size=4, **extra),
                                "actor_train")  # fmt: skip
        train.initialize()
        scored = train.compute_log_probs(rollout).batch["log_probs"]
        torch.testing.assert_close(scored[mask], expected[mask], atol=1e-5, rtol=0)
    if model_type == "qwen2_5_vl":
        for visual in rollout.non_tensor_batch[VISUAL_KEY]:
            visual.pop("second_per_grid_ts", None)
        assert (alone(path, rollout)[mask] - expected[mask]).abs().max() > 1e-4  # measured 4e-4; scoring agrees to 1e-5
        return
    rollout.batch["old_log_probs"] = scored
    rollout.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    before = {name: value.clone() for name, value in train.named_weights()}
    metrics = train.train_step(rollout, ActorObjective())
    assert torch.isfinite(torch.tensor(metrics["grad_norm"]))
    after = dict(train.named_weights())
    tower = "model.visual.patch_embed.proj.weight"  # the videos' gradients reach the vision tower
    assert not torch.equal(after[tower], before[tower])


def test_qwen3_vl_prompts_give_each_temporal_patch_its_time_and_its_own_block(tmp_path):
    """Qwen3-VL's layout as transformers 5.2 (ROLL's pin) and vLLM write it: per temporal patch ``<t seconds>``, then a
    vision block of its pads; the times are the mean of the patch's first and last frame (the last repeated)."""
    from rl_engines.video import timestamped_video_text

    build_tiny_vl_model(tmp_path, CORPUS, model_type="qwen3_vl")
    tokenizer, processor = AutoTokenizer.from_pretrained(str(tmp_path)), load_image_processor(tmp_path)
    shots = frames(3, 0, (64, 64))  # 3 frames at 0, 0.5, 1 s: patches of (0, 0.5) and (1, 1): 0.25 s and 1.0 s
    ids, visual = encode_prompt("<video>1+2=", [], tokenizer, processor, [shots], fps=2.0, model_type="qwen3_vl",
                                frame_times=[[0.0, 0.5, 1.0]])  # fmt: skip
    assert visual["video_grid_thw"].tolist() == [[2, 4, 4]] and set(visual) == {"pixel_values_videos",
                                                                                  "video_grid_thw"}  # fmt: skip
    block = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"  # 4 x 4 patches, 2 x 2 merged
    assert tokenizer.decode(ids) == f"<0.2 seconds>{block}<1.0 seconds>{block}1+2="  # 0.25 s rounds half to even
    grids, times = torch.tensor([[1, 2, 2], [2, 2, 2]]), torch.tensor([3.0, 4.25, 5.5])
    text = timestamped_video_text("a<|video_pad|>b<|vision_start|><|video_pad|><|vision_end|>c", grids, times, 2)
    one = "<|vision_start|><|video_pad|><|vision_end|>"
    assert text == f"a<3.0 seconds>{one}b<4.2 seconds>{one}<5.5 seconds>{one}c"  # a bare pad (vLLM's) too

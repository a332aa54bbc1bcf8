"""Video RLVR data (issue 23): ROLL's Video-R1 records (``custom_data_kwargs_func: ...video_r1_get_data_kwargs``)
with mp4 files under ``video_folder``, sampled by ``data_args.video_*`` into a Qwen2.5-VL prompt's video inputs, and
two RLVR steps of ROLL's video_r1.yaml itself after the usual swaps, on its own Megatron engines with a tiny
Qwen3-VL-MoE (the file's architecture, experts split over expert-parallel ranks)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from apps.rlvr.data import DataError, load_records, record_layout
from apps.rlvr.video_data import VIDEO_R1, VideoOptions
from rl_engines.tiny_model import build_tiny_vl_model

av = pytest.importorskip("av")

SMALL = {"video_min_pixels": 56 * 56, "video_max_pixels": 56 * 56, "video_total_pixels": 64 * 56 * 56,
         "video_fps": 2.0, "video_max_frames": 8}  # fmt: skip
"""Frames of 56 x 56 (4 merged tokens each pair of frames): the file's 128-token frames, shrunk for a CPU."""


def write_mp4(path, seconds: float, fps: int = 8, size=(64, 64)) -> None:
    """An mp4 of ``seconds`` whose frames brighten over time."""
    count = int(seconds * fps)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for index in range(count):
            level = int(255 * index / max(count - 1, 1))
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), level, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def video_r1_rows(count: int) -> list[dict]:
    return [{"problem": f"Does clip {i} get brighter?\nOptions:\nA. yes\nB. no\n", "problem_type": "multiple choice",
             "solution": "<answer>A</answer>", "video": f"clips/clip{i % 2}.mp4", "modality_type": "video"}
            for i in range(count)]  # fmt: skip


@pytest.fixture(scope="module")
def video_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    (root / "clips").mkdir()
    write_mp4(root / "clips" / "clip0.mp4", 3.0)  # 24 frames at 8 fps: 6 sampled at 2 fps
    write_mp4(root / "clips" / "clip1.mp4", 1.0)  # 8 frames: 2 at 2 fps, raised to the minimum of 4
    (root / "data.json").write_text(json.dumps(video_r1_rows(8)))
    build_tiny_vl_model(
        root / "vl", [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)], model_type="qwen2_5_vl"
    )
    return root


def test_video_r1_rows_become_video_prompts_with_the_sampled_rate(video_setup):
    from transformers import AutoTokenizer

    from apps.rlvr.data import prompt_text
    from apps.rlvr.vl_data import vl_prompt_batch
    from rl_engines.vision import VISUAL_KEY, load_image_processor

    root = video_setup
    data_args = {"messages": "prompt", "custom_data_kwargs_func": VIDEO_R1, "video_folder": str(root), **SMALL}
    records = load_records(str(root / "data.json"), prompt_key=None, messages_key="prompt",
                           layout=record_layout(data_args, "actor_train"))  # fmt: skip
    first = records[0]
    assert first["ground_truth"] == "<answer>A</answer>" and first["reward_model"] == "multiple choice"
    assert first["tag"] == "video" and first["prompt"][0]["content"].startswith("<video>Does clip 0 get brighter?")
    assert first["prompt"][0]["content"].endswith("single option letter (e.g., A, B, C, D, etc.) within the <answer> "
                                                  "</answer> tags.")  # fmt: skip
    tokenizer, processor = AutoTokenizer.from_pretrained(root / "vl"), load_image_processor(root / "vl")
    texts = [prompt_text(r["prompt"], tokenizer, "native") for r in records[:2]]
    batch = vl_prompt_batch(texts, records[:2], tokenizer, processor, 1024, VideoOptions.from_data_args(data_args),
                            "qwen2_5_vl")  # fmt: skip
    pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for row, (frames, seconds) in enumerate(((6, 3.0), (4, 1.0))):
        inputs = batch.non_tensor_batch[VISUAL_KEY][row]
        assert inputs["video_grid_thw"].tolist() == [[frames // 2, 4, 4]]  # 56 x 56 frames: 4 x 4 patches of 14
        rate = frames / seconds  # frames sampled over the clip's length: 2 fps, 4 fps for the short clip
        assert inputs["second_per_grid_ts"].tolist() == pytest.approx([2 / rate])
        assert int((batch.batch["input_ids"][row] == pad).sum()) == frames // 2 * 4  # 2 x 2 patches per token
    with pytest.raises(DataError, match=r"record \?: video .*nothing\.mp4 does not exist"):
        vl_prompt_batch(texts[:1], [{**records[0], "video": "nothing.mp4"}], tokenizer, processor, 1024,
                        VideoOptions.from_data_args(data_args), "qwen2_5_vl")  # fmt: skip


def test_qwen3_vl_prompts_carry_the_sampled_frames_times(video_setup, tmp_path):
    """Qwen3-VL: each pair of sampled frames gets its own vision block after its time in the clip."""
    from transformers import AutoTokenizer

    from apps.rlvr.data import prompt_text
    from apps.rlvr.vl_data import vl_prompt_batch
    from rl_engines.vision import VISUAL_KEY, load_image_processor

    build_tiny_vl_model(tmp_path, ["1 2 3"], model_type="qwen3_vl")
    tokenizer, processor = AutoTokenizer.from_pretrained(tmp_path), load_image_processor(tmp_path)
    data_args = {"video_folder": str(video_setup), **SMALL}
    record = {"prompt": [{"role": "user", "content": "<video>brighter?"}], "video": "clips/clip0.mp4"}
    batch = vl_prompt_batch([prompt_text(record["prompt"], tokenizer, "native")], [record], tokenizer, processor, 256,
                            VideoOptions.from_data_args(data_args), "qwen3_vl")  # fmt: skip
    # 24 frames at 8 fps, 6 sampled: 0, 5, 9, 14, 18, 23 -> 0, 0.625, 1.125, 1.75, 2.25, 2.875 s; pairs' means
    # 0.3125, 1.4375, 2.5625. 64 x 64 frames at 32-pixel factors under 3136 pixels: 32 x 32, one token per pair.
    one = "<|vision_start|><|video_pad|><|vision_end|>"
    text = tokenizer.decode(batch.batch["input_ids"][0])
    assert f"<0.3 seconds>{one}<1.4 seconds>{one}<2.6 seconds>{one}brighter?" in text
    assert batch.non_tensor_batch[VISUAL_KEY][0]["video_grid_thw"].tolist() == [[3, 2, 2]]


def test_bad_video_data_keys_name_the_key(tmp_path):
    from apps.common.preflight import PreflightError
    from apps.rlvr.data_args import check_data_args, check_video_model

    with pytest.raises(PreflightError, match=r"actor_train.data_args.custom_data_kwargs_func='my.func': the RLVR"):
        check_data_args({"messages": "prompt", "custom_data_kwargs_func": "my.func"}, "actor_train")
    with pytest.raises(PreflightError, match=r"set data_args\.messages, not prompt"):
        check_data_args({"prompt": "problem", "custom_data_kwargs_func": VIDEO_R1}, "actor_train")
    with pytest.raises(PreflightError, match=r"validation.data_args.video_fps=0: give a positive number"):
        check_data_args({"video_fps": 0}, "validation")
    with pytest.raises(PreflightError, match=r"actor_train.data_args.video_max_frames=2.5: give a positive whole"):
        check_data_args({"video_max_frames": 2.5}, "actor_train")
    with pytest.raises(PreflightError, match=r"video_min_pixels=200 exceeds video_max_pixels=100"):
        check_data_args({"video_min_pixels": 200, "video_max_pixels": 100}, "actor_train")
    with pytest.raises(
        PreflightError,
        match=r"actor_train.data_args.video_fps \(video data\) with the actor's model: video inputs are built for",
    ):
        check_video_model({"video_fps": 2.0}, "actor_train", "qwen2")
    check_video_model({"video_fps": 2.0}, "actor_train", "qwen3_vl")
    (tmp_path / "d.json").write_text(json.dumps([{**video_r1_rows(1)[0], "problem_type": "essay"}]))
    with pytest.raises(DataError, match=r"row 0: problem_type='essay' is not one of Video-R1's"):
        load_records(str(tmp_path / "d.json"), prompt_key=None, messages_key="prompt",
                     layout=record_layout({"custom_data_kwargs_func": VIDEO_R1}, "actor_train"))  # fmt: skip


def test_rolls_video_r1_file_runs_two_steps_on_its_megatron_engines(video_setup, tmp_path, ray_session):
    """ROLL's video_r1.yaml after the usual swaps (vLLM's role on hf_infer; devices, sizes, frame sizes shrunk for a
    CPU; expert_model_parallel_size 8 x pipeline 2 over 16 GPUs as expert parallel 2 over 2 CPU ranks): its own
    megatron_train and megatron_infer (reference) run a tiny model of its Qwen3-VL-MoE architecture on Video-R1
    records with mp4 files, graded by the VideoR1 reward. The router's load-balancing loss (coefficient from the
    language model's config) gives gradients though no sample scores, so the policy moves off the reference by step 1;
    each sync carries every weight (the vision tower trains: the file freezes nothing)."""
    from test_apps_rlvr_config import ENGINES_HERE
    from test_apps_rlvr_roll_file_runs import on_cpu

    from apps.common.yaml_config import load_config
    from apps.rlvr.config import RLVRConfig
    from apps.rlvr.pipeline import RLVRPipeline
    from rl_ckpt.hf_io import HFCheckpoint
    from tests.shared_dir import require_shared, roll_target_files

    pytest.importorskip("megatron.core")
    root, model = video_setup, tmp_path / "vl"
    build_tiny_vl_model(model, [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)], model_type="qwen3_vl_moe",
                        num_key_value_heads=2)  # fmt: skip
    raw = load_config(require_shared(roll_target_files("qwen3-vl-30BA3B-video-rlvr/video_r1.yaml")[0]))
    out = tmp_path / "out"
    config = on_cpu(raw, str(model), str(root / "data.json"), str(out), ulysses=False, swaps=ENGINES_HERE)
    config["actor_train"]["data_args"].update(video_folder=str(root), **SMALL)
    config.update(prompt_length=1024, rollout_batch_size=4)  # Video-R1's template: ~800 byte-level tokens
    config["actor_train"]["training_args"].update(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    for role in ("actor_train", "actor_infer", "reference"):  # the file resolved ${pretrain} into each section
        config[role]["model_args"]["model_name_or_path"] = str(model)
    for role in ("actor_train", "reference"):
        config[role]["strategy_args"]["strategy_config"].update(expert_model_parallel_size=2,
                                                                pipeline_model_parallel_size=1)  # fmt: skip
        config[role]["device_mapping"] = [0, 1]
    assert config["actor_train"]["strategy_args"]["strategy_name"] == "megatron_train"
    assert config["reference"]["strategy_args"]["strategy_name"] == "megatron_infer"
    RLVRPipeline(RLVRConfig.from_dict(config)).run()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [0, 1]
    weights = len(HFCheckpoint(model).weight_map)
    for step in steps:
        assert {"videor1/acc_reward", "videor1/fmt_reward", "videor1/overall", "actor/pg_loss"} <= set(step)
        assert step["actor_train/load_balancing_loss"] > 0 and step["actor/grad_norm"] > 0  # ROLL's router-loss name
        assert step["model_update/tensors"] == weights
    assert steps[1]["actor/kl_loss"] > 0  # use_kl_loss: the reference scored the videos, the policy has moved


def test_a_text_model_refuses_a_record_with_a_video(video_setup):
    from transformers import AutoTokenizer

    from apps.rlvr.rollout import PromptSource

    records = [{"prompt": "1+1=", "video": "clips/clip0.mp4"}]
    source = PromptSource(records, AutoTokenizer.from_pretrained(video_setup / "vl"), "native", "prompt", None, 64)
    with pytest.raises(DataError, match=r"a record has a 'video' column and the policy is a text model"):
        source.batch([0], ["0:0"])

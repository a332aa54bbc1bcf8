"""The RLVR app's vision-language data (issue 23): ROLL's VLM record layout (images as bytes, {bytes, path} dicts,
paths or data URIs; reward_model.ground_truth and data_source), image pads expanded per picture, prompts that do
not fit refused, placeholders never sampled. Two RLVR steps of a tiny Qwen2.5-VL on ROLL's own VL config run in
tests/apps/test_apps_rlvr_roll_file_runs.py, the VL demo's learning in tests/apps/test_apps_rlvr_demo.py."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rl_engines.tiny_model import VL_MODEL_TYPES, build_tiny_vl_model


def png(count: int, seed: int) -> bytes:
    """A 56 x 56 picture with ``count`` red squares on white."""
    pixels = np.full((56, 56, 3), 255, dtype=np.uint8)
    rng = np.random.default_rng(seed)
    for index in range(count):
        row, col = 4 + 16 * index, int(rng.integers(2, 40))
        pixels[row : row + 10, col : col + 10] = (220, 30, 30)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_roll_vlm_images_load_from_bytes_dicts_paths_and_data_uris_and_bad_ones_name_the_record(tmp_path):
    import base64

    import pytest

    from apps.rlvr.data import DataError, load_records
    from apps.rlvr.vl_data import record_images

    data = png(2, 0)
    (tmp_path / "a.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    record = {"id": 7, "images": [data, {"bytes": data, "path": None}, str(tmp_path / "a.png"), uri]}
    images = record_images(record, "record 7")
    assert [image.size for image in images] == [(56, 56)] * 4
    assert all(np.array_equal(np.asarray(image), np.asarray(images[0])) for image in images)
    assert record_images({"prompt": "text only"}, "record 8") == []
    with pytest.raises(DataError, match=r"record 9 image 0: cannot read image '.*missing\.png'"):
        record_images({"images": [str(tmp_path / "missing.png")]}, "record 9")
    rows = [{"prompt": "<image>2?", "images": [{"bytes": data, "path": None}], "data_source": "mm_math",
             "reward_model": {"ground_truth": "2"}}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    [loaded] = load_records(str(tmp_path / "d.parquet"), prompt_key="prompt", messages_key=None)
    assert loaded["ground_truth"] == "2" and loaded["tag"] == "mm_math"  # ROLL's VLM mapping of the columns
    assert record_images(loaded, "record 0")[0].size == (56, 56)


@pytest.mark.parametrize("model_type", VL_MODEL_TYPES)
def test_vl_prompts_expand_image_pads_and_refuse_what_does_not_fit(tmp_path, model_type):
    """The app's prompts for each VL architecture (Qwen3-VL: 16-pixel patches) through the model's own processor."""
    from transformers import AutoTokenizer

    from apps.rlvr.data import DataError
    from apps.rlvr.vl_data import vl_prompt_batch
    from rl_engines.config import GeneratingArgs
    from rl_engines.strategies.generation import _generation_config
    from rl_engines.vision import VISUAL_KEY, load_image_processor, placeholder_token_ids

    build_tiny_vl_model(tmp_path, ["1 2 3"], model_type=model_type)
    tokenizer, processor = AutoTokenizer.from_pretrained(str(tmp_path)), load_image_processor(tmp_path)
    records = [{"images": [{"bytes": png(1, 0)}]}, {}]
    batch = vl_prompt_batch(["<image>1?", "2?"], records, tokenizer, processor, prompt_length=64)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = batch.non_tensor_batch[VISUAL_KEY][0]["image_grid_thw"]
    assert int((batch.batch["input_ids"][0] == pad).sum()) == int(grid.prod()) // 4 and not batch.non_tensor_batch[
        VISUAL_KEY][1]  # fmt: skip
    with pytest.raises(DataError, match=r"prompt_length=4; raise prompt_length or lower data_args.image_max_pixels"):
        vl_prompt_batch(["<image>1?"], records[:1], tokenizer, processor, prompt_length=4)
    with pytest.raises(DataError, match=r"the prompt has 0 image placeholder\(s\) and 1 image\(s\)"):
        vl_prompt_batch(["1?"], records[:1], tokenizer, processor, prompt_length=64)
    from transformers import AutoConfig

    vision = placeholder_token_ids(AutoConfig.from_pretrained(str(tmp_path)))
    names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    assert sorted(vision) == sorted(tokenizer.convert_tokens_to_ids(name) for name in names)

    class Model:
        config = AutoConfig.from_pretrained(str(tmp_path))
        generation_config = type("G", (), {"eos_token_id": 2, "pad_token_id": 0})()

    assert _generation_config(Model(), tokenizer, GeneratingArgs()).suppress_tokens == vision


def test_data_args_pixel_bounds_resize_the_pictures_as_rolls_keys_do(tmp_path):
    """``data_args.image_max_pixels`` / ``image_min_pixels`` (ROLL's keys, ROLL's defaults when unset or null) bound
    each picture's size, hence its image tokens; validation's own bounds apply to its prompts."""
    from types import SimpleNamespace

    from apps.rlvr.vl_data import image_processor
    from rl_engines.vision import encode_images

    build_tiny_vl_model(tmp_path, ["1 2 3"])
    picture = Image.open(io.BytesIO(png(1, 0))).resize((112, 112))

    def grid(data_args):
        config = SimpleNamespace(actor_train=SimpleNamespace(model_args=SimpleNamespace(model_name_or_path=tmp_path),
                                                             data_args=data_args))  # fmt: skip
        return encode_images(image_processor(config), [picture])["image_grid_thw"].tolist()

    assert grid({}) == grid({"image_max_pixels": None}) == [[1, 8, 8]]  # ROLL's 4096^2 bound leaves 112 x 112 be
    assert grid({"image_max_pixels": 56 * 56}) == [[1, 4, 4]]  # halved on each side
    assert grid({"image_min_pixels": 224 * 224, "image_max_pixels": 4096 * 4096}) == [[1, 16, 16]]

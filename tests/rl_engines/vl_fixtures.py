"""Vision-language test helpers: prompts with pictures through a tiny VL model's own image processor, and the
reference log-probs of the HF model on each sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from rl_core.batch import RolloutBatch
from rl_engines.vision import VISUAL_KEY, encode_prompt, load_image_processor, token_types, visual_column

SIZES = [(56, 84), (28, 56), (84, 56)]  # (height, width): 6, 2 and 6 image tokens after the 2 x 2 merge


def image(height, width, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def vl_prompts(model_dir, extra: int = 0) -> RolloutBatch:
    """Three left-padded prompts: an image before the text, an image after it, and text alone; then ``extra`` more
    with an image of the third size in the middle of the text."""
    from transformers import AutoTokenizer

    tokenizer, processor = AutoTokenizer.from_pretrained(str(model_dir)), load_image_processor(model_dir)
    items = [("<image>1+2=", [image(*SIZES[0], 0)]), ("3+4=<image>", [image(*SIZES[1], 1)]), ("5+6=", [])]
    items += [(f"{k}+<image>{k}=", [image(*SIZES[2], 2 + k)]) for k in range(extra)]
    encoded = [encode_prompt(text, images, tokenizer, processor) for text, images in items]
    return prompt_batch(encoded)


def prompt_batch(encoded) -> RolloutBatch:
    """Encoded prompts (``encode_prompt``'s ``(ids, visual inputs)`` pairs) as a left-padded batch."""
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.zeros(len(encoded), width, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for row, (tokens, _) in enumerate(encoded):
        ids[row, width - len(tokens) :], mask[row, width - len(tokens) :] = torch.tensor(tokens), 1
    return RolloutBatch({"input_ids": ids, "attention_mask": mask},
                        {VISUAL_KEY: visual_column(visual for _, visual in encoded)})  # fmt: skip


def alone(model_dir, rollout: RolloutBatch) -> torch.Tensor:
    """Each sample's response log-probs from the HF model on that sample alone (no padding, its own images)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    resp = rollout.batch["responses"].shape[1]
    out = torch.zeros(rollout.batch["responses"].shape)
    for row in range(len(rollout)):
        keep = rollout.batch["attention_mask"][row].bool()
        ids = rollout.batch["input_ids"][row][keep].unsqueeze(0)
        visual = rollout.non_tensor_batch[VISUAL_KEY][row]
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=token_types(ids, model.config), **visual).logits[0].float()
        n = int(rollout.batch["response_mask"][row].sum())
        targets = ids[0, ids.shape[1] - n :]
        log_probs = torch.log_softmax(logits[ids.shape[1] - n - 1 : -1], dim=-1)
        out[row, :n] = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert out.shape[1] == resp
    return out


def teacher_forced(rollout: RolloutBatch) -> RolloutBatch:
    """The prompts as their own responses (their last 3 tokens): all a forward or a train_step needs."""
    rollout.batch["responses"] = rollout.batch["input_ids"][:, -3:]
    rollout.batch["response_mask"] = rollout.batch["attention_mask"][:, -3:].bool()
    return rollout


@pytest.fixture(autouse=True)
def ieee_fp32_convolutions():
    """On CUDA, cuDNN runs fp32 convolutions (the vision towers' patch embedding) in TF32 by default
    (``torch.backends.cudnn.conv.fp32_precision == "tf32"``): a 10-bit mantissa, rounded differently for each batch
    shape. VL tests compare layouts and engines on the same samples in fp32, so their convolutions run in IEEE fp32
    (no effect on CPU)."""
    conv = torch.backends.cudnn.conv
    before, conv.fp32_precision = conv.fp32_precision, "ieee"
    yield
    conv.fp32_precision = before

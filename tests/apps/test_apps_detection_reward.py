"""ROLL's DetectionRewardWorker (issue 23): box parsing, the two greedy IoU matchings, COCO mAP of one image, the
size penalty and the weighted final score, on hand-computed cases; the mAP also against pycocotools' own results
on three cases (computed once with pycocotools 2.0.11, which is not a dependency here)."""

from __future__ import annotations

import json

import pytest

from apps.rlvr.config import RewardSpec
from apps.rlvr.detection_reward import (
    accuracy,
    iou_score,
    map_scores,
    parse_boxes,
    scaled_to_thousand,
    verify_format,
)
from apps.rlvr.rewards import REWARD_FUNCTIONS


def box(x1, y1, x2, y2, label="cat"):
    return {"bbox_2d": [x1, y1, x2, y2], "label": label}


def answer(boxes) -> str:
    return f"<think>look</think>\n<answer>\n{json.dumps(boxes)}\n</answer>"


def test_boxes_parse_as_roll_repairs_them():
    assert parse_boxes("[{'bbox_2d': [1, 2, 3, 4], 'label': 'cat'}]") == [box(1, 2, 3, 4)]  # single quotes
    assert parse_boxes("[[{'bbox_2d': [1, 2, 3, 4], 'label': 'cat'}]]") == [box(1, 2, 3, 4)]
    cut = '[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}, {"bbox_2d": [5, 6'  # a response cut at max_new_tokens
    assert parse_boxes(cut) == [box(1, 2, 3, 4)]
    mixed = json.dumps([box(1, 2, 3, 4), box(1, 2, 3, 4, "dog"), box(5, 5, 4, 9), {"bbox_2d": [1, 2, 3]}])
    assert parse_boxes(mixed) == [box(1, 2, 3, 4)]  # a repeated position, x1 > x2, three numbers: dropped
    assert parse_boxes("no boxes") is None and parse_boxes("[]") is None


def test_iou_scores_of_both_matchings():
    gt = [box(0, 0, 10, 20), box(50, 50, 60, 60, "dog")]
    pred = [box(0, 0, 10, 10), box(50, 50, 60, 60, "cat")]  # IoU 0.5 (right label), IoU 1 (wrong label)
    by_iou = iou_score(pred, gt, "iou_max_iou_first", 0.5, completeness=0.0)
    assert by_iou["mean_iou"] == pytest.approx((0.5 + 0.0) / 2)  # both matched; the wrong label scores 0
    assert by_iou["recall"] == 1.0 and by_iou["precision"] == 1.0
    by_label = iou_score(pred, gt, "iou_max_label_first", 0.5, completeness=0.5)
    assert by_label["mean_iou"] == pytest.approx(0.5 / 2) and by_label["recall"] == 0.5
    assert by_label["precision"] == 0.5 and by_label["weighted"] == pytest.approx(0.5 * 0.25 + 0.5 * 0.5)
    assert iou_score(pred, gt, "iou_max_label_first", 0.55, completeness=0.0)["mean_iou"] == 0.0


@pytest.mark.parametrize(
    ("pred", "gt", "expected"),
    [
        ([box(6, 36, 27, 47, "dog"), box(42, 64, 54, 85), box(75, 35, 111, 50)],
         [box(5, 33, 22, 49, "dog"), box(38, 61, 50, 80), box(64, 17, 74, 22), box(79, 32, 109, 50)],
         (0.09207920792079208, 0.5841584158415841, 0.0)),
        ([box(21, -2, 34, 18, "dog"), box(72, 27, 80, 51), box(49, 45, 69, 64), box(13, 78, 40, 79, "dog")],
         [box(17, 1, 35, 18, "dog"), box(46, 74, 67, 75)], (0.15, 0.5, 0.0)),
        ([box(80, 49, 86, 61), box(76, 17, 90, 48, "dog"), box(69, 10, 70, 16), box(80, 14, 91, 44, "dog"),
          box(58, 66, 64, 89, "dog")],
         [box(16, 35, 30, 57), box(76, 18, 89, 46, "dog"), box(65, 7, 71, 12), box(61, 5, 85, 32)], (0.35, 0.5, 0.5)),
    ],
)  # fmt: skip
def test_map_equals_pycocotools(pred, gt, expected):
    got = map_scores(pred, gt)
    assert (got["map"], got["map50"], got["map75"]) == pytest.approx(expected, abs=1e-12)


def test_map_by_hand_one_hit_one_miss():
    """Two cat boxes, predictions [exact, far]: precision 1 up to recall 0.5, so AP = 51 / 101 at every IoU."""
    got = map_scores([box(0, 0, 10, 10), box(80, 80, 90, 90)], [box(0, 0, 10, 10), box(30, 30, 40, 40)])
    assert got == pytest.approx({"map": 51 / 101, "map50": 51 / 101, "map75": 51 / 101})
    assert map_scores([box(0, 0, 10, 10, "dog")], [box(0, 0, 10, 10)]) == {"map": 0.0, "map50": 0.0, "map75": 0.0}


def test_the_final_score_weights_penalises_size_and_adds_format(monkeypatch):
    gt, exact = answer([box(0, 0, 10, 10)]), answer([box(0, 0, 10, 10)])
    params = {"det_reward_ratio": {"iou_max_label_first": 1.0, "map": 1.0}}
    assert accuracy(exact, gt, params, image_size=None) == pytest.approx(1.0) and verify_format(exact) == 1.0
    extra = answer([box(0, 0, 10, 10), box(50, 50, 60, 60)])  # one false alarm: penalty 0.6, completeness
    params = {"det_reward_ratio": {"iou_max_label_first": 1.0, "iou_completeness": 0.5}}
    assert accuracy(extra, gt, params, image_size=None) == pytest.approx(0.6 * (0.5 * 1.0 + 0.5 * 0.75))
    half = answer([box(0, 0, 10, 5)])  # IoU 0.5: matched at threshold 0.5 only, 1 of the 11 averaged
    params = {"det_reward_ratio": {"iou_max_iou_first": 1.0}}
    assert accuracy(half, gt, params, image_size=None) == pytest.approx(0.5 / 11)
    monkeypatch.setenv("DET_IOU_THRESHOLD", "0.5")
    assert accuracy(half, gt, params, image_size=None) == pytest.approx(0.5)
    monkeypatch.setenv("DET_IOU_THRESHOLD", "dynamic")  # 0.85 early in training: no match
    assert accuracy(half, gt, params, image_size=None, step=0, max_steps=10) == 0.0
    assert verify_format("<answer>[]</answer>") == 0.0 and verify_format(f"{exact}\n</answer>") == 0.0


def test_the_registered_reward_reads_the_record_as_roll_and_scales_qwen25_pixel_answers():
    reward = REWARD_FUNCTIONS.get("DetectionRewardWorker")
    assert reward is REWARD_FUNCTIONS.get("detection")
    parm = {"det_verifier_normalized": True, "det_reward_ratio": {"iou_max_label_first": 1.0}}
    record = {"reward_model": {"ground_truth": answer([box(0, 0, 500, 500)]), "verifier_parm": parm},
              "image_sizes": [(1, 200, 400)], "vl_model_type": "qwen2_5_vl"}  # fmt: skip
    pixels = answer([box(0, 0, 200, 100)])  # the top-left quarter of a 400 x 200 image: 0..500 in 0..1000
    assert scaled_to_thousand([box(0, 0, 200, 100)], width=400, height=200) == [box(0, 0, 500, 500)]
    assert reward(pixels, record, RewardSpec()) == pytest.approx((1.0 * 1.0 + 1.0 * 0.1) / 1.1)
    qwen3 = {**record, "vl_model_type": "qwen3_vl"}  # answers already in 0..1000: taken as they are
    assert reward(pixels, qwen3, RewardSpec()) == pytest.approx(0.1 / 1.1)  # IoU 0.08 in that frame: format only
    assert reward(answer([box(0, 0, 500, 500)]), qwen3, RewardSpec()) == pytest.approx(1.0)
    with pytest.raises(KeyError, match=r"reward_model\.ground_truth"):
        reward(pixels, {"ground_truth": "x"}, RewardSpec())

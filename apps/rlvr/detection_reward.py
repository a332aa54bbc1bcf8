"""Object-detection reward (ROLL's ``DetectionRewardWorker``, the verifier of One-RL-to-See-Them-All / Orsta data).

A response answers with boxes inside ``<answer>``: ``[{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}, ...]`` (single
quotes, ``[[...]]`` and a cut-off tail are repaired as ROLL does; boxes with x1 > x2 or y1 > y2 and repeated
positions are dropped). The record's ``reward_model`` holds the ``ground_truth`` (the same form inside
``<answer>``), ``format_ratio`` (0.1) and ``accuracy_ratio`` (1.0), and ``verifier_parm``: ``det_reward_ratio``
(weights of ``iou_max_iou_first``, ``iou_max_label_first``, ``map``, ``map50``, ``map75``, and ``iou_completeness``,
the share of completeness in an IoU score) and ``det_verifier_normalized`` (Qwen2.5-VL answers in pixels of the
resized image: its boxes are scaled to 0..1000, the ground truth's frame, using the image's size after the
processor).

Accuracy, as ROLL computes it:

- IoU scores: boxes matched greedily at an IoU threshold, either the largest IoU first (a match counts its IoU only
  when the labels agree) or per ground-truth box among same-label predictions. Score = (1 - c) x mean IoU over the
  ground-truth boxes + c x completeness (1 - (miss rate + false-alarm rate) / 2), c = ``iou_completeness``. The
  threshold is ``DET_IOU_THRESHOLD`` (environment; one of 0.5, 0.55, ..., 0.95, 0.99), ``average`` (default: the
  mean over those eleven) or ``dynamic`` (0.85, 0.95, then 0.99 as training passes 10 % and 25 % of its steps).
- mAP, mAP50, mAP75: COCO's box AP of the one image (every prediction scored 1, in answer order; 101-point
  interpolated precision; averaged over the ground truth's labels), as pycocotools computes it.
- Each times a size penalty 0.6 ** |#predicted - #ground truth|, then the ``det_reward_ratio`` weighted mean.

Format: 1 when the response has one ``\\n<answer>\\n ... \\n</answer>`` block holding at least one valid box. The
reward and the score are ``(accuracy x accuracy_ratio + format x format_ratio) / (accuracy_ratio + format_ratio)``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from apps.rlvr.config import RewardSpec
from apps.rlvr.rewards import REWARD_FUNCTIONS

Box = dict[str, Any]
IOU_THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
RATIO_KEYS = ("iou_max_label_first", "iou_max_iou_first", "iou_completeness", "map", "map50", "map75")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
COCO_IOUS = np.linspace(0.5, 0.95, 10)
RECALL_STEPS = np.linspace(0.0, 1.0, 101)


def answer_content(text: str) -> str:
    match = ANSWER.search(text)
    return match.group(1).strip() if match else ""


def parse_boxes(text: str) -> list[Box] | None:
    """The valid, distinct boxes of an answer (None when there is none or it does not parse)."""
    if not text or not text.strip():
        return None
    text = text.replace("[[", "[").replace("]]", "]")
    if not text.endswith("]"):
        text = text.rsplit("},", 1)[0] + "}]"
    try:
        items = json.loads(text.replace("'", '"').replace("\\", ""))
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list):
        return None
    boxes, seen = [], set()
    for item in items:
        if _valid(item) and tuple(item["bbox_2d"]) not in seen:
            seen.add(tuple(item["bbox_2d"]))
            boxes.append(item)
    return boxes or None


def _valid(item: Any) -> bool:
    if not (isinstance(item, dict) and isinstance(item.get("label"), str) and isinstance(item.get("bbox_2d"), list)):
        return False
    box = item["bbox_2d"]
    numbers = len(box) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)
    return numbers and box[0] <= box[2] and box[1] <= box[3]


def box_iou(a: list[float], b: list[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes (0 when they do not overlap)."""
    x1, y1, x2, y2 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    if x2 <= x1 or y2 <= y1:
        return 0.0
    inter = (x2 - x1) * (y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter) / union


def match_max_iou_first(pred: list[Box], gt: list[Box], threshold: float) -> list[float]:
    """Greedy matching, the pair with the largest remaining IoU first (the first such pair in prediction, then
    ground-truth order), down to ``threshold``; each match's IoU, 0 when the labels differ. (ROLL's loop reuses its
    loop variables as the argmax, so it pairs the last remaining boxes with the largest IoU's value; here the pair is
    the one that has it.)"""
    ious = [[box_iou(p["bbox_2d"], g["bbox_2d"]) for g in gt] for p in pred]
    free_pred, free_gt, matches = list(range(len(pred))), list(range(len(gt))), []
    while free_pred and free_gt:
        best, pi, gi = -1.0, -1, -1
        for p in free_pred:
            for g in free_gt:
                if ious[p][g] > best:
                    best, pi, gi = ious[p][g], p, g
        if best < threshold:
            break
        matches.append(best if pred[pi]["label"].lower() == gt[gi]["label"].lower() else 0.0)
        free_pred.remove(pi)
        free_gt.remove(gi)
    return matches


def match_max_label_first(pred: list[Box], gt: list[Box], threshold: float) -> list[float]:
    """For each ground-truth box in turn, the unmatched prediction of the same label with the largest IoU, when it
    reaches ``threshold``; each match's IoU."""
    matches, used = [], set()
    for g in gt:
        label = g["label"].lower()
        candidates = [(box_iou(p["bbox_2d"], g["bbox_2d"]), i) for i, p in enumerate(pred)
                      if i not in used and p["label"].lower() == label]  # fmt: skip
        if not candidates:
            continue
        best = max(iou for iou, _ in candidates)
        if best >= threshold:
            used.add(next(i for iou, i in candidates if iou == best))
            matches.append(best)
    return matches


MATCHERS = {"iou_max_iou_first": match_max_iou_first, "iou_max_label_first": match_max_label_first}


def iou_score(pred: list[Box], gt: list[Box], matcher: str, threshold: float, completeness: float) -> dict[str, float]:
    """ROLL's IoU score of one matching: mean IoU over the ground truth, completeness, precision, recall, and their
    weighted sum (``completeness`` the weight of completeness)."""
    matches = MATCHERS[matcher](pred, gt, threshold)
    mean_iou = sum(matches) / len(gt) if matches else 0.0
    miss = (len(gt) - len(matches)) / len(gt)
    false_alarm = (len(pred) - len(matches)) / len(pred) if pred else 0.0
    complete = 1.0 - (miss + false_alarm) / 2.0
    return {"mean_iou": mean_iou, "completeness": complete, "precision": 1 - false_alarm, "recall": 1 - miss,
            "weighted": mean_iou * (1.0 - completeness) + complete * completeness}  # fmt: skip


def category_ap(pred: list[list[float]], gt: list[list[float]], threshold: float) -> float:
    """COCO's AP of one label on one image at one IoU threshold: predictions (all scored 1, in answer order) each
    take the unmatched ground-truth box of the largest IoU (the last of equal ones) at or above the threshold;
    precision made non-increasing, read at 101 recall steps."""
    taken, hits = set(), []
    for box in pred[:100]:  # maxDets 100
        limit, found = min(threshold, 1 - 1e-10), -1
        for index, other in enumerate(gt):
            if index in taken:
                continue
            iou = box_iou(box, other)
            if iou >= limit:
                limit, found = iou, index
        if found >= 0:
            taken.add(found)
        hits.append(found >= 0)
    if not hits:
        return 0.0
    tp = np.cumsum(hits, dtype=float)
    fp = np.cumsum(np.logical_not(hits), dtype=float)
    recall = tp / len(gt)
    precision = (tp / (tp + fp + np.spacing(1))).tolist()
    for i in range(len(precision) - 1, 0, -1):
        precision[i - 1] = max(precision[i - 1], precision[i])
    steps = np.searchsorted(recall, RECALL_STEPS, side="left")
    return float(np.mean([precision[i] if i < len(precision) else 0.0 for i in steps]))


def map_scores(pred: list[Box], gt: list[Box]) -> dict[str, float]:
    """COCO box mAP over IoU 0.5:0.05:0.95, and at 0.5 and 0.75, averaged over the ground truth's labels
    (predictions of other labels are left out, as ROLL does)."""
    labels = list(dict.fromkeys(g["label"] for g in gt))
    known = [p for p in pred if p["label"] in labels]
    if not known:
        return {"map": 0.0, "map50": 0.0, "map75": 0.0}
    table = np.array([[category_ap([p["bbox_2d"] for p in known if p["label"] == label],
                                   [g["bbox_2d"] for g in gt if g["label"] == label], float(t))
                       for label in labels] for t in COCO_IOUS])  # fmt: skip
    return {"map": float(table.mean()), "map50": float(table[0].mean()), "map75": float(table[5].mean())}


def iou_threshold(step: int, max_steps: int) -> float | str:
    """``DET_IOU_THRESHOLD`` as ROLL reads it: a listed threshold, ``average`` (also for anything else) or
    ``dynamic`` (by the share of training done)."""
    value = os.environ.get("DET_IOU_THRESHOLD", "average")
    try:
        chosen: float | str = float(value) if value not in ("average", "dynamic") else value
    except ValueError:
        chosen = "average"
    if chosen not in (*IOU_THRESHOLDS, "average", "dynamic"):
        chosen = "average"
    if chosen != "dynamic":
        return chosen
    done = step / max_steps if max_steps else 0.0
    return 0.85 if done <= 0.1 else 0.95 if done <= 0.25 else 0.99


def reward_ratios(params: dict[str, Any]) -> dict[str, float]:
    """``det_reward_ratio`` with ROLL's fallbacks: a missing key, or a value outside [0, 1], counts 0."""
    given = params.get("det_reward_ratio") or {}
    return {key: float(given[key]) if key in given and 0 <= float(given[key]) <= 1 else 0.0 for key in RATIO_KEYS}


def verify_format(response: str) -> float:
    """1 when the response has one ``\\n<answer>\\n ... \\n</answer>`` block with at least one valid box."""
    if not (response.count("\n<answer>\n") and response.count("\n</answer>") == 1):
        return 0.0
    return 1.0 if parse_boxes(answer_content(response.strip()).lower()) else 0.0


def scaled_to_thousand(boxes: list[Box], width: float, height: float) -> list[Box]:
    """Pixel boxes of a ``width`` x ``height`` image in the 0..1000 frame (truncated to integers, as ROLL)."""
    out = []
    for box in boxes:
        x1, y1, x2, y2 = box["bbox_2d"]
        frame = [int(x1 / width * 1000), int(y1 / height * 1000), int(x2 / width * 1000), int(y2 / height * 1000)]
        out.append({**box, "bbox_2d": frame})
    return out


def accuracy(response: str, solution: str, params: dict[str, Any], *, image_size: tuple[int, int] | None,
             step: int = 0, max_steps: int = 0) -> float:  # fmt: skip
    """ROLL's ``verify_accuracy`` final score (see the module docstring); ``image_size`` (height, width) of the
    processed image normalises pixel answers when ``det_verifier_normalized``."""
    pred = parse_boxes(answer_content(response.strip()).lower())
    gt = parse_boxes(answer_content(solution.strip()).lower())
    if gt is None or pred is None:
        return 0.0
    if params.get("det_verifier_normalized") and image_size is not None:
        pred = scaled_to_thousand(pred, width=image_size[1], height=image_size[0])
    ratios = reward_ratios(params)
    penalty = 0.6 ** abs(len(pred) - len(gt))
    threshold = iou_threshold(step, max_steps)
    scores = {}
    for matcher in MATCHERS:
        thresholds = IOU_THRESHOLDS if threshold == "average" else (float(threshold),)
        values = [iou_score(pred, gt, matcher, t, ratios["iou_completeness"])["weighted"] for t in thresholds]
        scores[matcher] = sum(values) / len(values) * penalty
    scores.update({key: value * penalty for key, value in map_scores(pred, gt).items()})
    weights = {key: ratios[key] for key in ("iou_max_iou_first", "iou_max_label_first", "map", "map50", "map75")}
    total = sum(weights.values())
    return sum(scores[key] * weight for key, weight in weights.items()) / total if total > 0 else 0.0


@REWARD_FUNCTIONS.register("detection", "DetectionRewardWorker", "cv_detection")
def detection_reward(response: str, record: dict[str, Any], spec: RewardSpec) -> float:
    """ROLL's detection reward of one response (see the module docstring); the record's ``reward_model`` holds the
    ground truth and the verifier's parameters, ``image_sizes`` the processed images' sizes (added by the app)."""
    reward_model = record.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise KeyError(f"the detection reward needs reward_model.ground_truth in the record; columns: {sorted(record)}")
    params = dict(reward_model.get("verifier_parm") or {})
    sizes = record.get("image_sizes") or []
    normalized = bool(params.get("det_verifier_normalized")) and record.get("vl_model_type") == "qwen2_5_vl"
    params["det_verifier_normalized"] = normalized  # Qwen2.5-VL answers in pixels; Qwen2-VL / Qwen3-VL in 0..1000
    size = (int(sizes[0][1]), int(sizes[0][2])) if sizes else None
    score = accuracy(response, str(reward_model["ground_truth"]), params, image_size=size,
                     step=int(record.get("global_step", 0)), max_steps=int(record.get("max_steps", 0)))  # fmt: skip
    format_ratio = float(reward_model.get("format_ratio", 0.1))
    accuracy_ratio = float(reward_model.get("accuracy_ratio", 1.0))
    total = accuracy_ratio + format_ratio
    return score * accuracy_ratio / total + verify_format(response) * format_ratio / total

"""The ``data_args`` keys of RLVR's ``actor_train`` and ``validation`` sections, checked against ROLL's
DataArguments: each is read with ROLL's meaning, accepted with a pre-flight note where it changes no result, or
refused naming it (a misspelt key never passes silently)."""

from __future__ import annotations

from typing import Any

from apps.common.preflight import PreflightError
from apps.rlvr.data import DataError, record_layout
from apps.rlvr.video_data import VideoOptions

READ = (
    "template",
    "file_name",
    "prompt",
    "messages",
    "domain_interleave_probs",
    "image_min_pixels",
    "image_max_pixels",
    "video_fps",
    "video_max_frames",
    "video_min_pixels",
    "video_max_pixels",
    "video_total_pixels",
    "video_folder",
    "custom_data_kwargs_func",
)
"""Keys the pipeline reads (``domain_interleave_probs`` only on actor_train; the pixel bounds for a
vision-language model's images, apps.rlvr.vl_data; how videos are sampled, apps.rlvr.video_data; the Video-R1
record layout, apps.rlvr.data.record_layout)."""
DEFAULTS_ONLY = {"tag": "tag", "id": "id", "response": "solution", "dataset_type": "json"}
"""ROLL keys accepted at ROLL's default only: the pipeline reads the ``tag`` column and json / jsonl / csv files."""
NOTES = {
    "preprocessing_num_workers": "processes ROLL tokenizes the data set with before training; here prompts are "
    "tokenized as batches are drawn, so it changes nothing",
    "dataset_dir": "not a field of ROLL's DataArguments, so ROLL's parser keeps no value for it (its get_dataset "
    "then joins file_name to '.'); file_name is read as written here too",
    "video_resize_chunk_frames": "frames ROLL resizes at a time to bound its memory; here each sampled frame is "
    "resized on its own, so it changes nothing",
    "interleave_probs": "not a field of ROLL's DataArguments (domain_interleave_probs mixes the domains); ROLL reads "
    "it nowhere, and neither does this pipeline",
}
"""Accepted keys that change no result, and why."""
PROMPT_NOTE = (
    "[preflight] {name}: a text model reads the {value!r} column's text as it is, with no chat template (as ROLL, "
    "whose data_args.template formats a messages column only): give the formatted prompt there, or the chat as a "
    "messages column (a vision-language model's prompt goes into ROLL's VL question template)."
)
"""The note of ``data_args.prompt``: what ROLL's RLVR ``encode_function`` does with that column."""


def check_data_args(data_args: dict[str, Any], section: str) -> list[str]:
    """Refuse unknown keys and non-default values of the defaults-only keys (naming ``<section>.data_args.<key>``);
    return a pre-flight note for each key that changes nothing here."""
    notes = []
    for key, value in data_args.items():
        name = f"{section}.data_args.{key}"
        if key in READ:
            if key == "domain_interleave_probs" and section != "actor_train":
                raise PreflightError(f"{name}: domains mix training batches only; set actor_train.data_args.{key}.")
            try:
                if key == "custom_data_kwargs_func":
                    record_layout(data_args, section)
                if key.startswith("video_"):
                    VideoOptions.check(data_args, section)
            except DataError as err:
                raise PreflightError(str(err)) from None
            if key == "prompt" and value is not None:
                notes.append(PROMPT_NOTE.format(name=name, value=value))
        elif key in DEFAULTS_ONLY:
            if value != DEFAULTS_ONLY[key]:
                raise PreflightError(
                    f"{name}={value!r}: only ROLL's default {DEFAULTS_ONLY[key]!r} is supported (the pipeline reads "
                    "the tag column and .json / .jsonl / .csv files); rename the column or drop the key."
                )
        elif key in NOTES:
            notes.append(f"[preflight] {name}: {NOTES[key]}.")
        else:
            known = sorted([*READ, *DEFAULTS_ONLY, *NOTES])
            raise PreflightError(f"{name} is not a data_args key the RLVR pipeline knows; known: {known}.")
    return notes


def check_video_model(data_args: dict[str, Any], section: str, model_type: str | None) -> None:
    """Video data (a ``video_*`` key or the Video-R1 layout) needs a model whose videos are built here (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE); ``model_type`` None (no local config.json yet) is not checked."""
    from rl_engines.video import check_video_model as check_model

    keys = [key for key in data_args if key.startswith("video_") or key == "custom_data_kwargs_func"]
    if not keys or model_type is None:
        return
    try:
        check_model(model_type)
    except ValueError as err:
        raise PreflightError(f"{section}.data_args.{keys[0]} (video data) with the actor's model: {err}") from None

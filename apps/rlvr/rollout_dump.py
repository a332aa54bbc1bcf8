"""ROLL's ``rollout_dump_dir``: each step's scored rollouts, human-readable, in ROLL's layout.

One file a step, ``<rollout_dump_dir>/rollout_dump_data.step_<N>.jsonl``, holding one JSON object of columns (a list
with a value per sample each), under ROLL's column names (its ``COLUMMNS_CONFIG``): ``global_step``; the data
columns ``id`` / ``source`` / ``difficulty`` / ``prompt`` / ``messages`` / ``ground_truth`` / ``case_type`` /
``test_case_function`` / ``test_cases`` / ``tag`` that any sample's record has (null where a record lacks it, as a
dataset column is); ``domain`` always (the record's ``domain`` column, else its reward section: ROLL's default
domain); ``responses`` (decoded, special tokens skipped); ``scores`` (the verifiable score of each response) and
``sampling_params`` (as ROLL's, the step's request as JSON: ``global_step`` and ``generation_config``, the
generating_args; ROLL's scheduler adds keys of its own). A value JSON cannot hold is written as its ``str()``.

ROLL writes it from a background process and a failed write does not stop its run; here the write is atomic (a
temporary file renamed), timed as ``time/rollout_dump``, and a failure is logged, naming the file, while the run
goes on."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rl_core.batch import RolloutBatch
from rl_engines.config import GeneratingArgs

DATA_COLUMNS = ("id", "source", "difficulty", "prompt", "messages", "ground_truth", "case_type", "test_case_function",
                "test_cases", "tag")  # fmt: skip
"""ROLL's dumped data columns besides ``domain``."""


def dump_path(folder: str, step: int) -> Path:
    """The file of ``step``'s rollouts."""
    return Path(folder) / f"rollout_dump_data.step_{step}.jsonl"


def dump_columns(
    rollout: RolloutBatch,
    records: Sequence[dict[str, Any]],
    domains: Sequence[str],
    responses: Sequence[str],
    generating: GeneratingArgs,
    step: int,
) -> dict[str, list[Any]]:
    """The columns of ``step``'s dump (see the module docstring); ``records`` / ``domains`` / ``responses``: the
    samples' data records, domains and decoded responses."""
    count = len(rollout)
    columns: dict[str, list[Any]] = {"global_step": [step] * count}
    for name in DATA_COLUMNS:
        if any(name in record for record in records):
            columns[name] = [record.get(name) for record in records]
    columns["domain"] = list(domains)
    columns["responses"] = list(responses)
    columns["scores"] = [float(score) for score in rollout.batch["scores"]]
    config = dataclasses.asdict(generating)
    del config["max_length"]  # ROLL's GeneratingArguments.to_dict() leaves it out when max_new_tokens is set
    if config["include_stop_str_in_output"] is None:  # and this one when None
        del config["include_stop_str_in_output"]
    columns["sampling_params"] = [json.dumps({"global_step": step, "generation_config": config})] * count
    return columns


def write_dump(folder: str, step: int, columns: dict[str, list[Any]], log: Callable[[str], None]) -> Path | None:
    """Write ``columns`` to ``step``'s file, atomically; a failure is logged (the run goes on, as ROLL's does) and
    leaves no partial file. Returns the file, or None when the write failed."""
    path = dump_path(folder, step)
    temporary = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(columns, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        log(f"[rlvr] rollout_dump_dir: could not write {path} ({error}); step {step}'s rollouts are not dumped")
        return None
    return path

"""ROLL's rollout_dump_dir when the write fails (the pipeline run that writes it: test_apps_rlvr_pipeline.py): the
failure is logged naming the file, no partial file is left, and the run goes on (ROLL writes from a background
process whose failure does not stop its run)."""

from __future__ import annotations

import json

from rlvr_fixtures import file_size_limit

from apps.rlvr.rollout_dump import dump_path, write_dump


def test_a_full_disk_loses_only_that_steps_dump_and_says_so(tmp_path):
    columns = {"global_step": [3, 3], "responses": ["x" * 5000, "y"], "scores": [1.0, 0.0]}
    logged: list[str] = []
    with file_size_limit(1000):  # a write past 1000 bytes fails as on a full disk
        assert write_dump(str(tmp_path), 3, columns, logged.append) is None
    assert len(logged) == 1 and str(dump_path(str(tmp_path), 3)) in logged[0] and "not dumped" in logged[0]
    assert list(tmp_path.iterdir()) == []  # no partial file
    small = {"global_step": [4], "responses": ["z"], "scores": [0.5]}
    with file_size_limit(1000):
        path = write_dump(str(tmp_path), 4, small, logged.append)
    assert path == tmp_path / "rollout_dump_data.step_4.jsonl" and json.loads(path.read_text()) == small

import json
import math

import pytest

from rl_replay import DEFAULT_METRICS, MetricsError, append_metrics, compare_metrics, read_metrics
from rl_replay import metrics as metrics_module
from rl_replay.metrics import format_table, match_names, values_close


def write_run(path, rows):
    for row in rows:
        append_metrics(path, row["step"], {k: v for k, v in row.items() if k != "step"})
    return path


BASE = [
    {"step": 0, "actor/pg_loss": 0.5, "actor/grad_norm": 1.25, "critic/value_loss": 0.1, "total_loss": 0.6},
    {"step": 1, "actor/pg_loss": 0.4, "actor/grad_norm": 1.0, "critic/value_loss": 0.09, "total_loss": 0.49},
]


def test_jsonl_format_round_trip_and_merge(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_run(path, BASE)
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"step": 1, "val/score": 0.75, "note": "text is ignored", "ok": True}) + "\n")
        f.write('{"step": 2, "actor/approx_kl": NaN}\n')
    got = read_metrics(path)
    assert got[0] == {k: v for k, v in BASE[0].items() if k != "step"}
    assert got[1]["val/score"] == 0.75 and "note" not in got[1] and "ok" not in got[1]
    assert math.isnan(got[2]["actor/approx_kl"])
    assert read_metrics(tmp_path) == got  # a directory holding metrics.jsonl


def test_malformed_lines_name_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "a": 1}\nnot json\n')
    with pytest.raises(MetricsError, match=r"m\.jsonl:2: not JSON"):
        read_metrics(path)
    path.write_text('{"step": "0", "a": 1}\n')
    with pytest.raises(MetricsError, match=r'm\.jsonl:1: each line must be an object with an int "step"'):
        read_metrics(path)
    with pytest.raises(MetricsError, match="does not exist"):
        read_metrics(tmp_path / "missing.jsonl")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(MetricsError, match=r"neither metrics\.jsonl nor TensorBoard"):
        read_metrics(tmp_path / "empty_dir")


def test_name_matching_by_last_component():
    logged = ["actor/pg_loss", "critic/pg_loss", "pg_loss_extra", "pg_loss"]
    assert match_names("pg_loss", logged) == ["actor/pg_loss", "critic/pg_loss", "pg_loss"]
    assert match_names("actor/pg_loss", logged) == ["actor/pg_loss"]


def test_identical_runs_do_not_diverge(tmp_path):
    a = read_metrics(write_run(tmp_path / "a.jsonl", BASE))
    b = read_metrics(write_run(tmp_path / "b.jsonl", BASE))
    result = compare_metrics(a, b)
    assert not result.diverged and result.not_logged == ["approx_kl"]
    assert {r.metric for r in result.rows} == {"actor/pg_loss", "actor/grad_norm", "critic/value_loss", "total_loss"}
    assert len(result.rows) == 8 and DEFAULT_METRICS == (
        "pg_loss",
        "total_loss",
        "value_loss",
        "approx_kl",
        "grad_norm",
    )


def test_a_tiny_difference_diverges_unless_tolerated(tmp_path):
    changed = [dict(BASE[0]), {**BASE[1], "actor/pg_loss": 0.4 + 1e-9}]
    a = read_metrics(write_run(tmp_path / "a.jsonl", BASE))
    b = read_metrics(write_run(tmp_path / "b.jsonl", changed))
    result = compare_metrics(a, b)
    bad = [r for r in result.rows if not r.ok]
    assert result.diverged and [(r.step, r.metric) for r in bad] == [(1, "actor/pg_loss")]
    assert bad[0].abs_diff == pytest.approx(1e-9, rel=1e-3)
    assert not compare_metrics(a, b, atol=2e-9).diverged
    assert not compare_metrics(a, b, rtol=1e-8).diverged
    assert compare_metrics(a, b, rtol=1e-10).diverged
    assert "DIFF" in format_table(result) and "1.000e-09" in format_table(result)


def test_missing_steps_and_values(tmp_path):
    a = read_metrics(write_run(tmp_path / "a.jsonl", BASE))
    b = read_metrics(write_run(tmp_path / "b.jsonl", BASE[:1]))
    result = compare_metrics(a, b)
    assert result.diverged and all(r.b is None for r in result.rows if not r.ok)
    assert "missing" in format_table(result)
    assert not compare_metrics(a, b, common_steps_only=True).diverged


def test_values_close_rules():
    nan, inf = float("nan"), float("inf")
    assert values_close(nan, nan, 0, 0) and not values_close(nan, 1.0, 1e9, 1e9)
    assert values_close(inf, inf, 0, 0) and not values_close(inf, -inf, 0, 0) and not values_close(1e300, inf, 1e9, 0)
    assert values_close(1.0, 1.0, 0, 0) and not values_close(1.0, 1.0 + 2**-52, 0, 0)
    assert values_close(100.0, 101.0, 0, 0.01) and not values_close(100.0, 101.0, 0, 0.009)


def test_tensorboard_logs(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    for name, shift in (("a", 0.0), ("b", 0.5)):
        writer = SummaryWriter(log_dir=str(tmp_path / name))
        for step in range(3):
            writer.add_scalar("actor/pg_loss", 0.25 * step + shift * (step == 2), step)
            writer.add_scalar("critic/value_loss", 1.0, step)
        writer.close()
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert a[1] == {"actor/pg_loss": 0.25, "critic/value_loss": 1.0}
    result = compare_metrics(a, b)
    assert [(r.step, r.metric) for r in result.rows if not r.ok] == [(2, "actor/pg_loss")]


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"")
    monkeypatch.setattr(metrics_module, "tensorboard_available", lambda: False)
    with pytest.raises(MetricsError, match=r"install the tensorboard package.*rl-replay\[tensorboard\]"):
        read_metrics(tmp_path)

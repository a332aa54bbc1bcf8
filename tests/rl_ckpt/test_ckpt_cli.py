"""`rl-ckpt convert` end to end: both directions with --verify, and clear errors for broken inputs."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from ckpt_models import VOCAB, checked_sharded_output, file_size_limit, load_state

from rl_ckpt import convert_hf_to_mcore
from rl_ckpt.cli import main


def rank_path(root, tp_rank, pp_rank=None):
    name = f"mp_rank_{tp_rank:02d}" if pp_rank is None else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return root / "iter_0000001" / name / "model_optim_rng.pt"


def run_cli(*args):
    cmd = [sys.executable, "-m", "rl_ckpt.cli", "convert", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_ckpt_cli_both_directions_verify(tiny_hf, tmp_path, capsys):
    """hf -> mcore in this process, mcore -> hf through the module's entry point in a process of its own."""
    src = tiny_hf("qwen2", True)
    argv = ["convert", "--checkpoint_path", str(src), "--output_path", str(tmp_path / "mc"), "--tp", "2", "--pp", "2"]
    assert main([*argv, "--verify"]) == 0
    assert "max abs logits difference 0.000e+00" in capsys.readouterr().out
    assert rank_path(tmp_path / "mc", 1, 1).is_file()
    args = (
        "--checkpoint_path",
        tmp_path / "mc",
        "--output_path",
        tmp_path / "hf",
        "--verify",
        "--max_shard_size",
        "50KB",
    )
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert "verify: max abs logits difference 0.000e+00" in done.stdout
    assert load_state(tmp_path / "hf").keys() == load_state(src).keys()


def test_ckpt_index_lists_every_tensor_once(tiny_hf, tmp_path):
    src = tiny_hf("qwen2", False)
    assert main(["convert", "--checkpoint_path", str(src), "--output_path", str(tmp_path / "mc"), "--tp", "2"]) == 0
    out = tmp_path / "hf"
    assert (
        main(
            [
                "convert",
                "--checkpoint_path",
                str(tmp_path / "mc"),
                "--output_path",
                str(out),
                "--max_shard_size",
                "40KB",
            ]
        )
        == 0
    )
    seen = checked_sharded_output(out)
    assert sorted(seen) == sorted(set(seen))  # every tensor once
    assert sorted(seen) == sorted(load_state(src))


@pytest.fixture
def mcore_tp2(tiny_hf, tmp_path):
    convert_hf_to_mcore(tiny_hf("qwen2", False), tmp_path / "mc", tp=2)
    return tmp_path / "mc"


def convert_fails(capsys, src, out, *extra):
    code = main(["convert", "--checkpoint_path", str(src), "--output_path", str(out), *extra])
    return code, capsys.readouterr().err


def test_ckpt_missing_rank_file_is_named(mcore_tp2, tmp_path, capsys):
    rank_path(mcore_tp2, 1).unlink()
    code, err = convert_fails(capsys, mcore_tp2, tmp_path / "out")
    assert code == 2
    assert str(rank_path(mcore_tp2, 1)) in err and "missing rank file" in err


def test_ckpt_missing_rank_folder_is_named(mcore_tp2, tmp_path, capsys):
    shutil.rmtree(rank_path(mcore_tp2, 1).parent)  # folder names alone now say TP=1; the args say TP=2
    code, err = convert_fails(capsys, mcore_tp2, tmp_path / "out")
    assert code == 2
    assert str(rank_path(mcore_tp2, 1)) in err


def test_ckpt_wrong_shape_across_ranks_is_named(mcore_tp2, tmp_path, capsys):
    path = rank_path(mcore_tp2, 1)
    state = torch.load(path, weights_only=True)
    state["model"]["decoder.layers.2.self_attention.linear_proj.weight"] = torch.zeros(64, 16)
    torch.save(state, path)
    code, err = convert_fails(capsys, mcore_tp2, tmp_path / "out")
    assert code == 2
    assert "decoder.layers.2.self_attention.linear_proj.weight" in err and str(path) in err


def test_ckpt_wrong_shape_tp1_is_named(tiny_hf, tmp_path, capsys):
    convert_hf_to_mcore(tiny_hf("llama", False), tmp_path / "mc")
    path = rank_path(tmp_path / "mc", 0)
    state = torch.load(path, weights_only=True)
    state["model"]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(64, 95)
    torch.save(state, path)
    code, err = convert_fails(capsys, tmp_path / "mc", tmp_path / "out")
    assert code == 2
    assert "decoder.layers.0.mlp.linear_fc2.weight" in err and str(path) in err and "(64, 96)" in err


def test_ckpt_wrong_path_and_unknown_model(tiny_hf, tmp_path, capsys):
    code, err = convert_fails(capsys, tmp_path / "nope", tmp_path / "out")
    assert code == 2 and str(tmp_path / "nope") in err
    (tmp_path / "empty").mkdir()
    code, err = convert_fails(capsys, tmp_path / "empty", tmp_path / "out")
    assert code == 2 and "not a Megatron checkpoint" in err
    bad = shutil.copytree(tiny_hf("qwen2", False), tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    code, err = convert_fails(capsys, bad, tmp_path / "out", "--tp", "2")
    assert code == 2 and "unknown model type 'gpt_neox'" in err and "qwen2" in err


def test_ckpt_bad_tp_is_named(tiny_hf, tmp_path, capsys):
    code, err = convert_fails(capsys, tiny_hf("qwen2", False), tmp_path / "out", "--tp", "4")
    assert code == 2 and "num_key_value_heads=2" in err


def test_ckpt_verify_failure_exits_1(mcore_tp2, tmp_path, capsys):
    code = main(
        [
            "convert",
            "--checkpoint_path",
            str(mcore_tp2),
            "--output_path",
            str(tmp_path / "o"),
            "--verify",
            "--verify_atol",
            "-1",
        ]
    )
    assert code == 1
    assert "FAILED" in capsys.readouterr().out


def test_ckpt_tokenizer_copied_and_vocab_from_it(mcore_tp2, tmp_path):
    for r in range(2):  # drop what our args carry so the vocabulary size must come from the tokenizer folder
        state = torch.load(rank_path(mcore_tp2, r), weights_only=True)
        state["args"].update(vocab_size=None, hf_config=None, hf_generation_config=None)
        torch.save(state, rank_path(mcore_tp2, r))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(VOCAB)}}}))
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    code = main(
        [
            "convert",
            "--checkpoint_path",
            str(mcore_tp2),
            "--output_path",
            str(tmp_path / "hf"),
            "--tokenizer_path",
            str(tok),
            "--verify",
        ]
    )
    assert code == 0
    out = tmp_path / "hf"
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 7
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB


@pytest.mark.parametrize("direction", ["hf2mcore", "mcore2hf"])
def test_ckpt_full_disk_is_one_clear_error_and_leaves_nothing(direction, tiny_hf, mcore_tp2, tmp_path, capsys):
    """Writes past 32 KiB fail (EFBIG, as ENOSPC on a full disk): exit 2 with one message naming the output, the bytes
    written and free and the fix; nothing the conversion created stays (what was there before does); then, with the
    limit lifted, the same conversion succeeds."""
    src = tiny_hf("qwen2", False) if direction == "hf2mcore" else mcore_tp2
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("kept")
    for out in (fresh, existing):
        with file_size_limit(32 << 10):
            code, err = convert_fails(capsys, src, out, "--max_shard_size", "20KB")
        assert code == 2, err
        expected = f"rl-ckpt: error: cannot write the converted checkpoint to {out}: out of disk space ("
        assert err.startswith(expected), err
        assert "File too large" in err or "file write failed" in err or "unexpected pos" in err, err
        assert re.search(r"\d+(\.\d\d KiB| B) had been written when it failed; that partial output was removed and "
                         r"\d+\.\d\d [KMGT]iB are free there now, and this process may write files of at most "
                         r"32\.00 KiB \(ulimit -f\)\. Fix: free space on that file system, or pass an --output_path "
                         r"on a larger one, or raise the file-size limit \(ulimit -f\)\.", err), err  # fmt: skip
    assert not fresh.exists() and [p.name for p in existing.iterdir()] == ["notes.txt"]
    assert main(["convert", "--checkpoint_path", str(src), "--output_path", str(fresh)]) == 0


def test_ckpt_cli_virtual_pipeline_verifies_and_names_bad_sizes(tiny_hf, tmp_path, capsys):
    """--vp writes each stage's chunks (model0, model1) and --verify reads them back to the source's logits; a
    virtual pipeline without pipeline stages is refused naming both options."""
    src = tiny_hf("qwen2", True)
    argv = ["convert", "--checkpoint_path", str(src), "--output_path", str(tmp_path / "mc"), "--pp", "2", "--vp", "2"]
    assert main([*argv, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "PP=2 (virtual pipeline: 2 chunks per stage)" in out and "max abs logits difference 0.000e+00" in out
    assert {"model0", "model1"} <= set(torch.load(rank_path(tmp_path / "mc", 0, 1), weights_only=True))
    code, err = convert_fails(capsys, src, tmp_path / "bad", "--vp", "2")
    assert code == 2 and "--vp 2 needs --pp >= 2" in err

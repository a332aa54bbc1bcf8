"""DeepSpeed ZeRO -> HF on real checkpoints: ``deepspeed_train`` (one process, gloo, CPU) trains two AdamW steps,
saves, and ``rl-ckpt convert`` must give back exactly the trained fp32 weights.

Tolerances: the converted tensors are the optimizer's fp32 masters copied bit for bit (``torch.equal``); logits of
the converted folder vs the live trained module differ only by kernel order, measured 0 here (CPU, same
attention kernel), bounded by 1e-6.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import PurePosixPath

import pytest
import torch
from ckpt_models import checked_sharded_output
from safetensors import safe_open

pytest.importorskip("deepspeed")
pytest.importorskip("rl_engines")

from rl_ckpt import convert_deepspeed_to_hf, open_deepspeed_checkpoint
from rl_ckpt.cli import main
from rl_core.batch import RolloutBatch
from rl_engines.config import WorkerConfig
from rl_engines.objectives import ActorObjective
from rl_engines.strategies import create_strategy
from rl_engines.tiny_model import build_tiny_causal_lm, build_tiny_tokenizer

CORPUS = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
INPUT_IDS = (torch.arange(16) * 37 % 200 + 3).unsqueeze(0)  # [1, 16]
LOGITS_ATOL = 1e-6
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def make_model(path, tied):
    build_tiny_tokenizer(path, CORPUS, vocab_size=256)
    build_tiny_causal_lm(path, vocab_size=256, tie_word_embeddings=tied, seed=int(tied))
    return path


def rollout(vocab, batch_size=2, prompt_len=6, resp_len=5):
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (batch_size, prompt_len), generator=gen)
    responses = torch.randint(3, vocab, (batch_size, resp_len), generator=gen)
    return RolloutBatch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                         "attention_mask": torch.ones(batch_size, prompt_len + resp_len, dtype=torch.long),
                         "response_mask": torch.ones(batch_size, resp_len, dtype=torch.bool),
                         "advantages": torch.randn(batch_size, resp_len, generator=gen)})  # fmt: skip


def train_and_save(model_dir, stage, ckpt_dir):
    """Two optimizer steps of deepspeed_train at ZeRO ``stage``, saved; returns (trained weights, logits [1, 16, V])."""
    config = WorkerConfig.from_dict({
        "model_args": {"model_name_or_path": str(model_dir)}, "infer_batch_size": 2,
        "training_args": {"learning_rate": 1e-2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2},
        "strategy_args": {"strategy_name": "deepspeed_train", "strategy_config": {"zero_stage": stage}},
    }, "actor_train")  # fmt: skip
    strategy = create_strategy(config, "actor_train")
    strategy.initialize()
    for _ in range(2):
        batch = rollout(vocab=200)
        batch.batch["old_log_probs"] = strategy.compute_log_probs(batch).batch["log_probs"]
        strategy.train_step(batch, ActorObjective())
    strategy.save_checkpoint(str(ckpt_dir))
    weights = {name: value.clone() for name, value in strategy.named_weights()}
    with torch.no_grad():
        logits = strategy.engine.module.eval()(input_ids=INPUT_IDS).logits.float()
    return weights, logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{"zero1": ZeRO-1 on an untied model, "zero3": ZeRO-3 on a tied one} -> (model dir, ckpt, weights, logits)."""
    out = {}
    for name, stage, tied in (("zero1", 1, False), ("zero3", 3, True)):
        root = tmp_path_factory.mktemp(name)
        model_dir = make_model(root / "model", tied)
        out[name] = (model_dir, root / "ckpt", *train_and_save(model_dir, stage, root / "ckpt"))
    return out


def convert(*args):
    return main(["convert", *map(str, args)])


def load_folder(path):
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return tensors


@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_ckpt_deepspeed_converts_to_the_trained_weights(trained, tmp_path, capsys, name):
    from transformers import AutoModelForCausalLM

    model_dir, ckpt, weights, logits = trained[name]
    out = tmp_path / "hf"
    assert convert("--checkpoint_path", ckpt, "--output_path", out, "--hf_config_path", model_dir,
                   "--tokenizer_path", model_dir, "--max_shard_size", "60KB", "--verify") == 0  # fmt: skip
    stdout = capsys.readouterr().out
    assert f"from DeepSpeed ZeRO-{name[-1]} x 1 ranks" in stdout
    assert "verify: max abs logits difference 0.000e+00 (tolerance 1e-05): OK" in stdout

    tied = json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"]
    written = load_folder(out)
    assert set(written) == set(weights) - ({"lm_head.weight"} if tied else set())
    for key, value in written.items():
        assert value.dtype == torch.float32 and torch.equal(value, weights[key]), key
    initial = load_folder(model_dir)
    assert max(float((written[k] - initial[k]).abs().max()) for k in written) > 1e-3  # the steps are in there

    model = AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    with torch.no_grad():
        diff = float((model(input_ids=INPUT_IDS).logits - logits).abs().max())
    assert diff <= LOGITS_ATOL
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert (out / "generation_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_ckpt_deepspeed_index_lists_every_tensor_once(trained, tmp_path):
    model_dir, ckpt, weights, _ = trained["zero1"]
    out = tmp_path / "hf"
    assert convert("--checkpoint_path", ckpt, "--output_path", out, "--hf_config_path", model_dir,
                   "--max_shard_size", "40KB") == 0  # fmt: skip
    assert sorted(checked_sharded_output(out)) == sorted(weights)


def test_ckpt_deepspeed_layouts_and_config_sources(trained, tmp_path):
    """The engine folder, the tag folder, and HF Trainer's layout (``latest`` + config.json in the root)."""
    model_dir, ckpt, weights, _ = trained["zero3"]
    for path in (ckpt / "deepspeed", ckpt / "deepspeed" / "state"):
        found = open_deepspeed_checkpoint(path)
        assert (found.zero_stage, found.dp_world_size, found.tag_dir) == (3, 1, ckpt / "deepspeed" / "state")
    trainer = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt / "deepspeed" / "state", trainer / "global_step2")
    (trainer / "latest").write_text("global_step2")
    shutil.copy(model_dir / "config.json", trainer / "config.json")
    done = convert_deepspeed_to_hf(trainer, tmp_path / "hf")  # config.json found next to `latest`
    assert done.checkpoint.tag_dir == trainer / "global_step2"
    assert load_folder(tmp_path / "hf").keys() == set(weights) - {"lm_head.weight"}


def broken_copy(trained, tmp_path, name="zero3"):
    model_dir, ckpt, _, _ = trained[name]
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    return model_dir, copy, copy / "deepspeed" / "state"


def expect_error(capsys, *args, match):
    assert convert(*args) == 2
    err = capsys.readouterr().err
    assert "rl-ckpt: error:" in err and match in err, err
    return err


def test_ckpt_deepspeed_errors_wrong_path_and_interrupted_save(trained, tmp_path, capsys):
    out = tmp_path / "out"
    expect_error(capsys, "--checkpoint_path", tmp_path / "nope", "--output_path", out, match="does not exist")
    (tmp_path / "empty").mkdir()
    expect_error(capsys, "--checkpoint_path", tmp_path / "empty", "--output_path", out, "--direction", "ds2hf",
                 match="is not a DeepSpeed checkpoint: expected a 'latest' file")  # fmt: skip
    model_dir, copy, _ = broken_copy(trained, tmp_path)
    (copy / "COMPLETE").unlink()
    expect_error(capsys, "--checkpoint_path", copy, "--output_path", out, "--hf_config_path", model_dir,
                 match="without its COMPLETE marker: the save was interrupted")  # fmt: skip
    assert not out.exists()


def test_ckpt_deepspeed_error_missing_rank_file(trained, tmp_path, capsys):
    model_dir, copy, state = broken_copy(trained, tmp_path)
    (state / OPTIM_FILE).unlink()
    expect_error(capsys, "--checkpoint_path", copy, "--output_path", tmp_path / "out", "--hf_config_path", model_dir,
                 match=f"missing rank file {state / OPTIM_FILE} (ZeRO-3, 1 data-parallel ranks)")  # fmt: skip


def test_ckpt_deepspeed_foreign_pickle_needs_trust_checkpoint(trained, tmp_path, capsys):
    model_dir, copy, state = broken_copy(trained, tmp_path)
    optim = torch.load(state / OPTIM_FILE, weights_only=False)
    optim["run_dir"] = PurePosixPath("/data/run")  # e.g. a client_state entry: not tensors or DeepSpeed's records
    torch.save(optim, state / OPTIM_FILE)
    args = ("--checkpoint_path", copy, "--output_path", tmp_path / "out", "--hf_config_path", model_dir)
    err = expect_error(
        capsys, *args, match=f"{state / OPTIM_FILE} holds pickled Python objects (pathlib.PurePosixPath)"
    )
    assert "runs code from the file. Re-run with --trust_checkpoint" in err
    assert convert(*args, "--trust_checkpoint") == 0


def test_ckpt_deepspeed_error_deepspeed_not_installed(trained, tmp_path, capsys, monkeypatch):
    model_dir, ckpt, _, _ = trained["zero1"]
    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", None)  # `import` now raises ImportError
    expect_error(capsys, "--checkpoint_path", ckpt, "--output_path", tmp_path / "out", "--hf_config_path", model_dir,
                 match="DeepSpeed -> HF conversion needs deepspeed: pip install 'rl-ckpt[deepspeed]'")  # fmt: skip


def edited_config(model_dir, tmp_path, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path / "cfg"


@pytest.mark.parametrize(
    ("name", "changes", "match"),
    [
        ("zero1", {"intermediate_size": 96},
         "tensor model.layers.0.mlp.gate_proj.weight in {state} has shape (128, 64) but {cfg}/config.json implies "
         "(96, 64)"),
        ("zero1", {"tie_word_embeddings": True},
         "{cfg}/config.json ties lm_head.weight to model.embed_tokens.weight, but {state} holds different values"),
        ("zero1", {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}, "missing ['model.layers.2."),
        ("zero1", {"num_hidden_layers": 3}, "config.json is not a valid qwen2 config: "),
        ("zero3", {"model_type": "nonesuch"}, "unknown model_type 'nonesuch' in {cfg}/config.json"),
        ("zero3", {"model_type": "t5"}, "model_type 't5' has no causal-LM class in transformers"),
    ],
    ids=["shape", "tied_vs_untied", "layer_count", "invalid_config", "unknown_model", "not_causal_lm"],
)  # fmt: skip
def test_ckpt_deepspeed_errors_config_mismatch(trained, tmp_path, capsys, name, changes, match):
    model_dir, ckpt, _, _ = trained[name]
    cfg = edited_config(model_dir, tmp_path, **changes)
    state = ckpt / "deepspeed" / "state"
    expect_error(capsys, "--checkpoint_path", ckpt, "--output_path", tmp_path / "out", "--hf_config_path", cfg,
                 match=match.format(state=state, cfg=cfg))  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_ckpt_deepspeed_finds_the_config_through_the_recorded_model_path(trained, tmp_path, capsys):
    """deepspeed_train records model_name_or_path in meta.json: no --hf_config_path needed; without it, an error."""
    _, ckpt, weights, _ = trained["zero1"]
    assert convert("--checkpoint_path", ckpt, "--output_path", tmp_path / "out") == 0
    assert set(load_folder(tmp_path / "out")) == set(weights)
    copy = tmp_path / "no_model_path"
    shutil.copytree(ckpt, copy)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["model_name_or_path"]
    (copy / "meta.json").write_text(json.dumps(meta))
    expect_error(capsys, "--checkpoint_path", copy, "--output_path", tmp_path / "out2",
                 match=f"{copy} does not record the model's HF config; pass --hf_config_path")  # fmt: skip

"""`rl-ckpt merge-lora`: a PEFT LoRA adapter merged into its base model scores as peft's base + adapter, and the
adapters it cannot merge exactly, or that belong to another model, are refused naming the file and key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from ckpt_models import VOCAB, load_state, save_tiny_model

from rl_ckpt.cli import main

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "v_proj", "down_proj"]


def make_adapter(base, folder, **config):
    """A peft adapter on ``base`` with random (non-zero) factors, saved in PEFT's format; returns the peft model."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **config)
    wrapped = peft.get_peft_model(model, lora)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    wrapped.save_pretrained(str(folder))
    return wrapped.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(("tied", "rslora"), [(False, False), (True, True)], ids=["untied", "tied_rslora"])
def test_the_merged_model_scores_as_base_plus_adapter(tiny_hf, tmp_path, capsys, tied, rslora):
    import transformers

    base = tiny_hf("qwen2", tied)
    wrapped = make_adapter(base, tmp_path / "adapter", use_rslora=rslora)
    argv = ["merge-lora", "--base_model_path", str(base), "--adapter_path", str(tmp_path / "adapter"),
            "--output_path", str(tmp_path / "merged"), "--max_shard_size", "100KB"]  # fmt: skip
    assert main(argv) == 0
    assert "merged" in capsys.readouterr().out
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = logits(wrapped, ids)
    with wrapped.disable_adapter():
        plain = logits(wrapped, ids)
    assert not torch.allclose(expected, plain, atol=1e-3)  # the adapter matters...
    torch.testing.assert_close(logits(merged, ids), expected, atol=1e-5, rtol=0)  # ...and is merged in
    before, after = load_state(base), load_state(tmp_path / "merged")
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {n for n in before if n.rsplit(".", 2)[-2] in TARGETS and n.endswith(".weight")}


def megatron_checkpoint(adapter, folder, tp, pp=1):
    """``adapter`` (PEFT folder) as megatron_train writes its LoRA checkpoints: per TP rank (and stage) the rank's
    factors by HF module path, column-parallel B split by rows, row-parallel A by columns, the rest replicated."""
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    factors = {
        k.removeprefix("base_model.model."): v for k, v in load_file(adapter / "adapter_model.safetensors").items()
    }
    folder.mkdir()
    layers = sorted({int(name.split(".")[2]) for name in factors})
    for stage in range(pp):
        mine = layers[stage * len(layers) // pp : (stage + 1) * len(layers) // pp]
        for rank in range(tp):
            model = {}
            for name, tensor in factors.items():
                if int(name.split(".")[2]) not in mine:
                    continue
                row = name.split(".lora_")[0].endswith(("o_proj", "down_proj"))
                dim = 1 if row and ".lora_A." in name else 0 if not row and ".lora_B." in name else None
                model[name] = tensor if dim is None else tensor.chunk(tp, dim=dim)[rank].clone()
            tag = f"{rank:02d}" if pp == 1 else f"{rank:02d}_{stage:03d}"
            torch.save({"model": model}, folder / f"mp_rank_{tag}.pt")
    meta = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "adapters_only": True,
            "lora": {"lora_target": TARGETS, "lora_rank": config["r"], "lora_alpha": config["lora_alpha"]}}  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_a_megatron_lora_checkpoint_merges_as_its_peft_adapter(tiny_hf, tmp_path, capsys, tp, pp):
    """megatron_train's LoRA checkpoint (adapters only, split over TP ranks and stages) merges into the same model
    as the PEFT adapter it holds; `rl-ckpt convert` on it points at merge-lora."""
    base = tiny_hf("qwen2", False)
    make_adapter(base, tmp_path / "adapter")
    ckpt = megatron_checkpoint(tmp_path / "adapter", tmp_path / "ckpt", tp, pp)
    for source, out in ((tmp_path / "adapter", "peft"), (ckpt, "megatron")):
        assert main(["merge-lora", "--base_model_path", str(base), "--adapter_path", str(source),
                     "--output_path", str(tmp_path / out)]) == 0  # fmt: skip
    peft_merged, megatron_merged = load_state(tmp_path / "peft"), load_state(tmp_path / "megatron")
    assert peft_merged.keys() == megatron_merged.keys()
    assert all(torch.equal(peft_merged[name], megatron_merged[name]) for name in peft_merged)
    assert main(["convert", "--checkpoint_path", str(ckpt), "--output_path", str(tmp_path / "x")]) == 2
    assert "holds the LoRA adapters of a megatron_train run only" in capsys.readouterr().err


def test_a_bf16_base_stays_bf16(tmp_path):
    base = save_tiny_model(tmp_path / "base", dtype=torch.bfloat16)
    make_adapter(base, tmp_path / "adapter")
    assert main(["merge-lora", "--base_model_path", str(base), "--adapter_path", str(tmp_path / "adapter"),
                 "--output_path", str(tmp_path / "merged")]) == 0  # fmt: skip
    assert {t.dtype for t in load_state(tmp_path / "merged").values()} == {torch.bfloat16}


def test_adapters_it_cannot_merge_are_refused_naming_the_cause(tiny_hf, tmp_path, capsys):
    base = tiny_hf("qwen2", False)
    make_adapter(base, tmp_path / "adapter")

    def merge(adapter, out="merged"):
        code = main(["merge-lora", "--base_model_path", str(base), "--adapter_path", str(adapter),
                     "--output_path", str(tmp_path / out)])  # fmt: skip
        return code, capsys.readouterr().err

    code, err = merge(tmp_path / "nothing")
    assert code == 2 and "has no adapter_config.json" in err
    dora = tmp_path / "dora"
    shutil.copytree(tmp_path / "adapter", dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    code, err = merge(dora)
    assert code == 2 and "use_dora is set" in err
    other = save_tiny_model(tmp_path / "other", family="llama")  # another architecture: other module names
    (other / "model.safetensors.index.json").unlink()
    from safetensors.torch import save_file

    state = {k.replace("down_proj", "w2"): v for k, v in load_state(other).items()}
    for file in other.glob("*.safetensors"):
        file.unlink()
    save_file(state, str(other / "model.safetensors"))
    code = main(["merge-lora", "--base_model_path", str(other), "--adapter_path", str(tmp_path / "adapter"),
                 "--output_path", str(tmp_path / "merged_other")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "which" in err and "does not have" in err and "down_proj" in err
    assert not (tmp_path / "merged_other").exists()  # nothing half-written

"""Real ROLL RLVR files run two steps on CPU after the swaps a CPU needs and nothing else: model paths (a tiny local
model, the judge's too), devices (two CPU slots: training and inference on the first, a judge on the second; reward
sections graded in the driver), engines (torch-native), sizes (a small batch, short responses), files (a local data
file with the tags and columns of the file's rewards, outputs in a temp dir) and the two sample masks a random model
would fail. ROLL's multi-domain example (math, code, LLM judge, instruction following and multiple choice by
domain_interleave_probs) and the roll-targets files of issue 16: the LLM-judge config, GSPO (importance_sampling: seq),
the off-policy config (ActorPGWorker with TOPR) and the fsdp2 config; the two LoRA configs of issue 18 (adapters
trained, merged weights synced); the Qwen3-30B-A3B fsdp2 and Megatron configs of issue 19 on a tiny Qwen3-MoE (the
fsdp2 file's Ulysses sizes are device counts: one rank); and issue 15's dynamic batching, sequence packing
(load_balance) and Ulysses files (the Ulysses roles on 2 ranks with ulysses_size 2: one data-parallel group). Every
reward section grades its own domain's samples, each on a timeline track of its own; the LLM judge runs as its own
role."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlvr_fixtures import make_setup
from test_apps_rlvr_config import ENGINES_HERE, adapt

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.pipeline import RLVRPipeline
from rl_engines.tiny_model import build_tiny_moe_lm
from tests.shared_dir import require_shared, roll_example_files, roll_target_files

FILES = roll_example_files("qwen2.5-7B-rlvr_megatron/rlvr_config.yaml") + roll_target_files(
    "qwen2.5-7B-rlvr_megatron/rlvr_config_8gpus_llm_as_judge.yaml",
    "docs_examples/example_gspo.yaml",
    "qwen2.5-7B-rlvr-offpolicy/rlvr_config.yaml",
    "qwen3-8B-rlvr_fsdp2/rlvr_config.yaml",
    "qwen2.5-7B-rlvr_megatron/rlvr_config_lora.yaml",  # LoRA (issue 18): all-linear on megatron_train
    "qwen2.5-7B-rlvr_megatron/rlvr_lora_fsdp2.yaml",  # LoRA (issue 18): q/k/v/o on fsdp2_train
    "qwen3-30BA3B-rlvr_fsdp2/rlvr_config.yaml",  # MoE (issue 19): Qwen3-MoE on fsdp2_train / fsdp2_infer
    "qwen3-30BA3B-rlvr_megatron/rlvr_config.yaml",  # MoE (issue 19): EP, PP x virtual pipeline, on the swaps' engines
    "qwen2.5-7B-rlvr_megatron/rlvr_config_dynamic_batching.yaml",  # dynamic batching (issue 15), train and infer
    "qwen2.5-7B-rlvr_megatron/rlvr_config_sequence_packing.yaml",  # sequence packing (issue 15), load_balance
    "qwen2.5-7B-rlvr_megatron/rlvr_fsdp2_sp2.yaml",  # Ulysses (issue 15): fsdp2_train and fsdp2_infer, 2 ranks
)
MOE_FILES = {"qwen3-30BA3B-rlvr_fsdp2/rlvr_config.yaml", "qwen3-30BA3B-rlvr_megatron/rlvr_config.yaml"}
"""Files of a mixture-of-experts model: they run a tiny Qwen3-MoE and report the router's load-balancing loss."""


def records(tags: set[str]) -> list[dict]:
    """Four prompts of each domain whose tag a reward claims, in the columns its reward reads (ROLL's data files
    use a messages column)."""

    def row(tag: str, question: str, **columns) -> dict:
        return {"tag": tag, "messages": [{"role": "user", "content": question}], **columns}

    rows = []
    for a in range(4):
        rows += [
            row("deepmath_103k", f"{a}+1=", ground_truth=str(a + 1)),
            row("KodCode", f"print {a}+1", case_type="input",
                test_cases=json.dumps([{"stdin": "", "expected_stdout": str(a + 1)}])),
            row("RLVR", f"Is {a}+1 equal to {a + 1}?", ground_truth="yes"),
            row("ifeval", f"Say {a} in lowercase.", ground_truth=json.dumps({"func_name": "validate_lowercase"})),
            row("crossthinkqa", f"{a}+1? A:{a + 1} B:{a + 2}", ground_truth="A"),
        ]  # fmt: skip
    return [r for r in rows if r["tag"] in tags]


def on_cpu(raw: dict, model: str, data: str, out: str, *, ulysses: bool, swaps: dict | None = None) -> dict:
    """The ROLL file with the swaps above (adapt() did the engines, ``swaps`` if given); ``ulysses``: roles keep
    their sequence parallelism (ulysses_size 2 on 2 ranks), else they run it on one rank."""
    config = adapt(raw) if swaps is None else adapt(raw, swaps)
    config.update(pretrain=model, reward_pretrain=model, num_nodes=1, num_gpus_per_node=2, max_steps=2,
                  save_steps=2, eval_steps=0, rollout_batch_size=10, num_return_sequences_in_group=2,
                  prompt_length=64, response_length=8, output_dir=out, logging_dir=f"{out}/logs",
                  checkpoint_config={"type": "file_system", "output_dir": f"{out}/checkpoints"},
                  tracker_kwargs={"log_dir": f"{out}/tensorboard"},
                  # a random tiny model never stops within 8 tokens and gets no group right, so ROLL's
                  # max_len_mask and difficulty_mask would leave nothing to train on (tests/apps/test_apps_sample_
                  # filters.py checks them)
                  max_len_mask=False, difficulty_mask=False)  # fmt: skip
    train, infer = config["actor_train"], config["actor_infer"]
    train["device_mapping"], infer["device_mapping"] = [0], [0]  # a judge takes slot 1
    infer["num_gpus_per_worker"] = 1  # (vLLM's tensor parallel engines: hf_infer here)
    train["training_args"].update(per_device_train_batch_size=4, gradient_accumulation_steps=5, warmup_steps=0)
    train["data_args"]["file_name"] = [data]
    infer["generating_args"].update(max_new_tokens=8, num_return_sequences=2)
    config["reference"]["device_mapping"] = [0]
    if config.get("validation"):
        config["validation"]["data_args"]["file_name"] = [data]
        if "eval_steps" in config["validation"]:  # ROLL reads it nowhere; it must agree with eval_steps
            config["validation"]["eval_steps"] = 0
    for section in (train, config["reference"]):
        options = section.get("strategy_args", {}).get("strategy_config") or {}
        if "fsdp_size" in options:  # a device count: shard over the role's ranks
            options["fsdp_size"] = -1
        if section.get("model_args", {}).get("ulysses_size", 1) > 1:  # a device count too
            section["model_args"]["ulysses_size"] = 2 if ulysses else 1
            section["device_mapping"] = [0, 1] if ulysses else [0]
    for name, section in config["rewards"].items():
        section["model_args"]["model_name_or_path"] = model
        section.pop("world_size", None)  # graded in the driver (reward actors: tests/apps/test_apps_reward_workers.py)
        if name == "llm_judge":
            section["device_mapping"] = [1]
            section["generating_args"]["max_new_tokens"] = 4
    return config


@pytest.mark.parametrize("roll_file", FILES, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_roll_file_runs_two_steps_on_cpu_with_every_reward(roll_file: Path, tmp_path, ray_session):
    raw = load_config(require_shared(roll_file))
    sections = sorted(raw["rewards"])
    setup = make_setup(tmp_path / "setup")
    moe = f"{roll_file.parent.name}/{roll_file.name}" in MOE_FILES
    if moe:
        build_tiny_moe_lm(setup / "model", vocab_size=259)  # over the dense model, the same tokenizer
    data = tmp_path / "data.jsonl"
    tags = {tag for section in raw["rewards"].values() for tag in section["tag_included"]}
    data.write_text("\n".join(json.dumps(row) for row in records(tags)))
    out = tmp_path / "out"
    config = RLVRConfig.from_dict(on_cpu(raw, str(setup / "model"), str(data), str(out), ulysses=not moe))
    RLVRPipeline(config).run()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [0, 1]
    for step in steps:
        for section in sections:
            assert f"{section}/critic/score/mean" in step and step[f"time/reward/{section}"] > 0, section
        assert "actor/pg_loss" in step  # trained (nothing masked it all)
        assert ("actor_train/load_balancing_loss" in step) == moe  # ROLL's name for the router loss
        passes = {key.rsplit("/", 1)[0] for key in step if key.startswith("dynamic_batching/")}
        if "dynamic_batching" in roll_file.name:  # ROLL's metrics of each pass with a token budget
            names = ("actor_train/train_step", "actor_train/compute_log_probs", "reference/compute_log_probs")
            assert passes == {f"dynamic_batching/{name}" for name in names}
            prefix = "dynamic_batching/actor_train/train_step/"
            train = {key.removeprefix(prefix): value for key, value in step.items() if key.startswith(prefix)}
            # a pass is never wider than its batch, so the file's rounding to 128 keeps these 72-token rows whole
            assert train["valid_tokens"] < train["actual_tokens"] <= train["actual_tokens_origin"]
            assert train["removed_padding_tokens"] == train["actual_tokens_origin"] - train["actual_tokens"]
            assert step["dynamic_batching/reference/compute_log_probs/valid_tokens"] == train["valid_tokens"]
        else:
            assert not passes
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    graded = {(e["name"], e["args"]["step"]) for e in events if e["name"].startswith("reward/")}
    assert graded == {(f"reward/{section}", step) for section in sections for step in (0, 1)}  # a track each


VL_FILES = {
    "qwen2_5-vl-3B-rlvr_fsdp2/rlvr_fsdp2_offload.yaml": ("qwen2_5_vl", None),
    "qwen2.5-vl-7B-rlvr/rlvr_megatron.yaml": ("qwen2_5_vl", None),  # TP 4 x CP 2: a device count, swapped
    "qwen3-vl-4B-rlvr_megatron/rlvr_megatron_80G.yaml": ("qwen3_vl", ENGINES_HERE),
}
"""The VL roll-targets that run here, with the tiny model's architecture and the engine swaps (None: adapt()'s)."""


@pytest.mark.parametrize("name", VL_FILES)
def test_rolls_vl_files_run_two_steps_on_a_tiny_vl_model(name, tmp_path, ray_session):
    """The Qwen2.5-VL fsdp2 and Megatron and the Qwen3-VL Megatron roll-targets (issue 23) after the same swaps
    (the Qwen3-VL file on its own megatron_train / megatron_infer, vLLM's role on hf_infer): their parquet data in
    ROLL's VLM layout (a chat ``prompt`` column with ``<image>``, PNG ``images``, ``reward_model`` and
    ``data_source``: math and detection domains mixed by domain_interleave_probs), a tiny model of the file's
    architecture with its vision tower frozen where the file's own freeze_module_prefix says (``model.visual``;
    ``vision_model`` on Megatron), every reward section grading its domain."""

    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_apps_rlvr_vl import png

    from rl_engines.tiny_model import build_tiny_vl_model

    path = require_shared(roll_target_files(name)[0])
    raw = load_config(path)
    model_type, swaps = VL_FILES[name]
    build_tiny_vl_model(tmp_path / "vl", [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)],
                        model_type=model_type)  # fmt: skip

    boxes = '<answer>[{"bbox_2d": [10, 10, 500, 500], "label": "cat"}]</answer>'
    detection = {"ground_truth": boxes, "verifier_parm": {"det_verifier_normalized": True,
                 "det_reward_ratio": {"iou_max_label_first": 1.0, "map": 1.0}}}  # fmt: skip

    def domains(i: int) -> tuple[tuple[str, dict, str], ...]:
        return (f"{i}+1=", {"ground_truth": str(i + 1)}, "mm_math"), ("Find the cat.", detection, "v3det_train")

    rows = [{"prompt": [{"role": "user", "content": f"<image>{question}"}],
             "images": [{"bytes": png(1 + i % 3, i), "path": None}], "reward_model": reward_model,
             "data_source": source}
            for i in range(4) for question, reward_model, source in domains(i)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet")
    out = tmp_path / "out"
    config = on_cpu(raw, str(tmp_path / "vl"), str(tmp_path / "data.parquet"), str(out), ulysses=False, swaps=swaps)
    config["actor_train"]["training_args"].update(per_device_train_batch_size=4, gradient_accumulation_steps=5)
    for role in ("actor_train", "actor_infer", "reference"):  # the file resolved ${pretrain} into each section
        config[role]["model_args"]["model_name_or_path"] = str(tmp_path / "vl")
    RLVRPipeline(RLVRConfig.from_dict(config)).run()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [0, 1]
    for step in steps:
        assert {"math/critic/score/mean", "cv_detection/critic/score/mean", "actor/pg_loss"} <= set(step)
        assert step["time/reward/math"] > 0 and step["time/reward/cv_detection"] > 0
    from rl_ckpt.hf_io import HFCheckpoint

    weights = HFCheckpoint(tmp_path / "vl").weight_map  # the tower: visual.* (Qwen2.5-VL), model.visual.* (Qwen3-VL)
    vision = sum(name.startswith(("visual.", "model.visual.")) for name in weights)
    sent = [step["model_update/tensors"] for step in steps]
    if raw["actor_train"]["model_args"].get("freeze_module_prefix"):
        assert vision > 0 and sent[0] - sent[1] == vision  # the frozen vision tower travels with the first sync only
    else:
        assert vision > 0 and sent[0] == sent[1]  # a trained one with every sync
    exported = out / "checkpoints" / "checkpoint-1" / "actor_hf"  # with the image processor: it loads and serves
    assert (exported / "preprocessor_config.json").is_file()

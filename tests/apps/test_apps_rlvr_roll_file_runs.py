"""ROLL's own multi-domain RLVR example (roll-examples/qwen2.5-7B-rlvr_megatron/rlvr_config.yaml: math, code, LLM
judge, instruction following and multiple choice in every batch by domain_interleave_probs) runs two steps on CPU
after the swaps a CPU needs and nothing else: model paths (a tiny local model, the judge's too), devices (two CPU
slots, one reward actor per section), engines (torch-native), sizes (a small batch, short responses) and files (a
local data file with each domain's tag and columns, outputs in a temp dir) and the two sample masks a random model
would fail. Every reward section grades its own
domain's samples; the LLM judge runs as its own role."""

from __future__ import annotations

import json

from rlvr_fixtures import make_setup
from test_apps_rlvr_config import adapt

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.pipeline import RLVRPipeline
from tests.shared_dir import require_shared, roll_example_files

ROLL_FILE = roll_example_files("qwen2.5-7B-rlvr_megatron/rlvr_config.yaml")[0]
SECTIONS = ("code_sandbox", "crossthinkqa", "ifeval", "llm_judge", "math_rule")


def records() -> list[dict]:
    """Four prompts of each domain, in the columns its reward reads (ROLL's data files use a messages column)."""

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
    return rows


def on_cpu(raw: dict, model: str, data: str, out: str) -> dict:
    """The ROLL file with the swaps above (adapt() did the engines)."""
    config = adapt(raw)
    config.update(pretrain=model, reward_pretrain=model, num_nodes=1, num_gpus_per_node=2, max_steps=2,
                  save_steps=2, eval_steps=0, rollout_batch_size=10, num_return_sequences_in_group=2,
                  prompt_length=64, response_length=8, output_dir=out, logging_dir=f"{out}/logs",
                  checkpoint_config={"type": "file_system", "output_dir": f"{out}/checkpoints"},
                  tracker_kwargs={"log_dir": f"{out}/tensorboard"},
                  # a random tiny model never stops within 8 tokens and gets no group right, so the file's
                  # max_len_mask and difficulty_mask would leave nothing to train on (tests/apps/test_apps_sample_
                  # filters.py checks them)
                  max_len_mask=False, difficulty_mask=False)  # fmt: skip
    train, infer = config["actor_train"], config["actor_infer"]
    train["device_mapping"], infer["device_mapping"] = [0], [0]  # the judge has slot 1
    train["training_args"].update(per_device_train_batch_size=4, gradient_accumulation_steps=5, warmup_steps=0)
    train["data_args"]["file_name"] = [data]
    infer["generating_args"].update(max_new_tokens=8, num_return_sequences=2)
    config["reference"]["device_mapping"] = [0]
    config["validation"]["data_args"]["file_name"] = [data]
    for name, section in config["rewards"].items():
        section["model_args"]["model_name_or_path"] = model
        if "world_size" in section:
            section["world_size"] = 1
        if name == "llm_judge":
            section["device_mapping"] = [1]
            section["generating_args"]["max_new_tokens"] = 4
    return config


def test_rolls_multi_domain_example_runs_two_steps_with_every_reward(tmp_path, ray_session):
    raw = load_config(require_shared(ROLL_FILE))
    assert set(raw["rewards"]) == set(SECTIONS)
    setup = make_setup(tmp_path / "setup")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in records()))
    out = tmp_path / "out"
    config = RLVRConfig.from_dict(on_cpu(raw, str(setup / "model"), str(data), str(out)))
    RLVRPipeline(config).run()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [0, 1]
    for step in steps:  # 10 prompts: math 4, code 3, judge 1, multiple choice 1, instruction following 1
        for section in SECTIONS:
            assert f"{section}/critic/score/mean" in step and step[f"time/reward/{section}"] > 0, section
        assert "actor/pg_loss" in step  # trained (nothing masked it all)
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    graded = {(e["name"], e["args"]["step"]) for e in events if e["name"].startswith("reward/")}
    assert graded == {(f"reward/{section}", step) for section in SECTIONS for step in (0, 1)}  # one track per section
    # step 0: every reward 0 (whitened advantages 0, no gradient); step 1: some right, so the policy moves
    assert steps[-1]["critic/score/mean"] > 0 and steps[-1]["actor/grad_norm"] > 0

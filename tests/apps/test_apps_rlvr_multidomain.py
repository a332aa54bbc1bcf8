"""The shipped multi-domain config (apps/rlvr/configs/rlvr_cpu_multidomain.yaml): math, code and multiple-choice
prompts in every batch by domain_interleave_probs, each graded by its reward; per-domain metrics in metrics.jsonl and
each section's grading on the timeline. Its data, on a random tiny model (the demo's warm-up is not needed here)."""

from __future__ import annotations

import json

from rlvr_fixtures import make_setup

from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.demo_multidomain import CONFIG, DOMAINS, records
from apps.rlvr.pipeline import RLVRPipeline

SECTIONS = sorted(DOMAINS.values())


def test_every_step_grades_each_domain_and_logs_it_apart(tmp_path, ray_session):
    setup = make_setup(tmp_path)
    (tmp_path / "multi.jsonl").write_text("\n".join(json.dumps(row) for row in records()))
    out = tmp_path / "out"
    overrides = [f"pretrain={setup / 'model'}", f"actor_train.data_args.file_name={tmp_path / 'multi.jsonl'}",
                 f"output_dir={out}", f"logging_dir={out}/logs", "max_steps=2", "save_steps=2", "eval_steps=0",
                 "rollout_batch_size=4", "num_return_sequences_in_group=2", "actor_train.device_mapping=[0]",
                 "actor_train.training_args.per_device_train_batch_size=8"]  # fmt: skip
    config = RLVRConfig.from_dict(load_config(CONFIG, overrides))
    assert [config.rewards[s].spec.tag_included for s in SECTIONS] == [["code"], ["mc"], ["math"]]
    RLVRPipeline(config).run()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    for step in steps:
        for section in SECTIONS:  # 2 math, 1 code and 1 multiple-choice prompt of 4 (0.5 / 0.25 / the rest)
            assert f"{section}/critic/score/mean" in step and f"{section}/critic/advantages/mean" in step
            assert step[f"time/reward/{section}"] > 0
        # multiple choice on soft rewards: a wrong answer earns -1 or -0.5, never the 0 a score can be
        assert step["crossthinkqa/critic/rewards/mean"] < 0 or step["crossthinkqa/critic/score/mean"] > 0
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    graded = {(e["name"], e["args"]["step"]) for e in events if e["name"].startswith("reward/")}
    assert graded == {(f"reward/{section}", step) for section in SECTIONS for step in (0, 1)}

"""The outer loop of both pipelines (apps.common.loop.run_loop): when validation runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from apps.common.loop import run_loop
from apps.common.timeline import Timeline
from apps.common.training import PIPELINE_STATE, checkpoint_dir, resume_folder
from apps.rlvr.config import RLVRConfig


class Recording:
    """A pipeline that records the calls the loop makes and "trains" by counting its updates."""

    def __init__(self, eval_steps: int) -> None:
        self.log, self.progress_bar, self.timeline = print, False, Timeline()
        self.eval_steps, self.updates, self.calls = eval_steps, 0, []

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def resume(self, folder: Path) -> int:
        raise AssertionError("not resumed here")

    def step(self, step: int) -> dict[str, float]:
        self.calls.append(f"step {step}")
        self.updates += 1
        return {"critic/score/mean": 0.0}

    def validates_at(self, step: int) -> bool:
        return step % self.eval_steps == 0

    def validate(self, step: int) -> dict[str, float]:
        self.calls.append(f"validate {step}")
        return {"val/updates": float(self.updates)}

    def save(self, step: int) -> Path:
        return Path(".")


def test_validation_runs_before_the_step_trains_as_in_roll(tmp_path):
    """ROLL syncs the weights, validates every eval_steps, then trains: step 0 scores the model before any update and
    step s the weights of s updates. It had run after the step, so one update later."""
    config = RLVRConfig.from_dict({"rewards": {"math": {"worker_cls": "x.ExactMatchRewardWorker"}},
                                   "output_dir": str(tmp_path), "max_steps": 5, "save_steps": 100})  # fmt: skip
    pipeline = Recording(eval_steps=2)
    rows = run_loop(pipeline, config, "test", shown=("critic/score/mean",))
    assert pipeline.calls == ["validate 0", "step 0", "step 1", "validate 2", "step 2", "step 3", "validate 4",
                              "step 4"]  # fmt: skip
    assert [row.get("val/updates") for row in rows] == [0.0, None, 2.0, None, 4.0]


class Saving(Recording):
    """Saves complete checkpoint folders where the pipelines do."""

    def __init__(self, config: RLVRConfig) -> None:
        super().__init__(eval_steps=100)
        self.config, self.lines = config, []
        self.log = self.lines.append

    def save(self, step: int) -> Path:
        folder = checkpoint_dir(self.config, step)
        folder.mkdir(parents=True)
        (folder / PIPELINE_STATE).write_text("{}")
        return folder


def test_max_ckpt_to_keep_deletes_the_older_checkpoints_after_each_save_as_roll(tmp_path):
    """ROLL's max_ckpt_to_keep: after each save the newest N complete checkpoints stay (and so resume_from_checkpoint
    true still finds the latest); a folder a killed save left half-written among the older ones goes too."""
    config = RLVRConfig.from_dict({"rewards": {"math": {"worker_cls": "x.ExactMatchRewardWorker"}},
                                   "output_dir": str(tmp_path), "max_steps": 6, "save_steps": 2,
                                   "max_ckpt_to_keep": 2})  # fmt: skip
    (checkpoint_dir(config, 0).parent / "checkpoint-0").mkdir(parents=True)  # no pipeline_state.json: killed
    pipeline = Saving(config)
    run_loop(pipeline, config, "test", shown=("critic/score/mean",))
    assert sorted(p.name for p in checkpoint_dir(config, 0).parent.iterdir()) == ["checkpoint-3", "checkpoint-5"]
    assert resume_folder(replace(config, resume_from_checkpoint=True)) == checkpoint_dir(config, 5)
    assert [line for line in pipeline.lines if "Cleaning" in line] == [
        "[test] Cleaning up old checkpoints. Keeping 2, deleting steps: [0, 1]"  # after the third save
    ]
    everything = replace(config, max_ckpt_to_keep=0, output_dir=str(tmp_path / "all"))
    run_loop(Saving(everything), everything, "test", shown=())
    assert len(list(checkpoint_dir(everything, 0).parent.iterdir())) == 3  # 0: every checkpoint stays

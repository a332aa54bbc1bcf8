"""The RLVR loop end to end on CPU: a tiny local model, arithmetic prompts, math-verify rewards, two GRPO steps."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from rlvr_fixtures import NO_KL, make_setup

from apps.rlvr.__main__ import main

pytestmark = pytest.mark.usefixtures("ray_session")  # the session's shared Ray (tests/conftest.py)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory.mktemp("rlvr"))


DUMP = ["+rollout_mock.enable=true", "+rollout_mock.mode=dump"]
# For the tests about something else than the KL or data-parallel training: no reference, one training rank. Each
# rank is a process that imports torch and transformers (~6 s of CPU).
LEAN = [*NO_KL, "actor_train.device_mapping=[0]"]


@pytest.fixture(scope="module")
def dumped(setup):
    """The config's run as it is (two GRPO steps, validation at each, output in ``out``), its rollouts dumped by
    rl-replay's rollout_mock into ``dumps`` (train and validation), and ROLL's human-readable rollout dump into
    ``rollout_dump``: what the tests below read."""
    dumps = setup / "dumps"
    assert main(["--config_path", str(setup), "--config_name", "rlvr", *DUMP, f"+rollout_mock.dump_dir={dumps}",
                 f"+rollout_dump_dir={setup / 'rollout_dump'}"]) == 0  # fmt: skip
    return setup / "out", dumps


def test_two_grpo_steps_run_and_log_metrics(setup, dumped):
    lines = (setup / "out" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps] == [0, 1]
    for metrics in steps:
        assert metrics["val/samples"] == 16  # every validation prompt once, the padded batches trimmed
        assert 0.0 <= metrics["val/score/mean"] <= 1.0 and "val/score/math_rule" in metrics
        assert metrics["val_correct/all/mean"] == metrics["val/score/mean"]  # math scores are 0 or 1 (ROLL's name)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "time/rollout",
                    "time/model_update", "mismatch/mismatch_kl", "response_length/mean"):  # fmt: skip
            assert key in metrics, key
        assert metrics["model_update/tensors"] == 26
    # The last step is saved: a HuggingFace folder that transformers loads and generates with, resumable role
    # checkpoints, the driver's state, and the PNG of the curves.
    checkpoint = setup / "out" / "checkpoints" / "checkpoint-1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint / "actor_hf"))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint / "actor_hf"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)  # fmt: skip
    generated = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert (checkpoint / "actor_train" / "COMPLETE").exists()
    state = json.loads((checkpoint / "pipeline_state.json").read_text())
    assert state["step"] == 1 and state["sampler"]["position"] == 8  # 2 steps x 4 prompts of 16
    assert (setup / "out" / "curves.png").stat().st_size > 1000
    from rl_replay.metrics import read_metrics

    trace = json.loads((setup / "out" / "timeline.json").read_text())["traceEvents"]  # opens in Perfetto
    assert {e["name"] for e in trace} >= {"rollout", "logprobs", "advantages", "train", "sync"}
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in trace) and {e["args"]["step"] for e in trace} == {0, 1}
    events = read_metrics(str(setup / "out" / "tensorboard" / "tiny_rlvr"))
    assert sorted(events) == [0, 1] and "actor/pg_loss" in events[1]


def test_rolls_rollout_dump_holds_each_steps_trained_responses_with_their_scores(setup, dumped):
    """ROLL's rollout_dump_dir: a JSON object of columns a step, in ROLL's file names and column names; its
    responses and scores are those of the rollouts the step trained on (rl-replay's exact dump of them)."""
    from transformers import AutoTokenizer

    from rl_replay import RolloutReplay

    out, dumps = dumped
    folder = setup / "rollout_dump"
    assert sorted(p.name for p in folder.iterdir()) == [f"rollout_dump_data.step_{step}.jsonl" for step in (0, 1)]
    replay = RolloutReplay.from_config({"enable": True, "mode": "mock", "dump_dir": str(dumps)})
    assert replay is not None
    tokenizer = AutoTokenizer.from_pretrained(str(setup / "model"))
    question = lambda messages: messages[0]["content"]  # noqa: E731
    records = {
        question(row["messages"]): row["ground_truth"] for row in map(json.loads, (setup / "train.jsonl").open())
    }
    for step, metrics in enumerate(_rows(out)):
        (line,) = (folder / f"rollout_dump_data.step_{step}.jsonl").read_text().splitlines()
        columns = json.loads(line)
        assert list(columns) == ["global_step", "messages", "ground_truth", "domain", "responses", "scores",
                                 "sampling_params"]  # fmt: skip
        trained = replay.load(step)
        assert columns["global_step"] == [step] * len(trained)
        # ROLL decodes each whole padded row, skipping special tokens (EOS and the padding)
        assert columns["responses"] == tokenizer.batch_decode(trained.batch["responses"], skip_special_tokens=True)
        assert columns["scores"] == trained.batch["scores"].tolist()
        assert sum(columns["scores"]) / len(trained) == pytest.approx(metrics["critic/score/mean"], abs=1e-6)
        assert [records[question(messages)] for messages in columns["messages"]] == columns["ground_truth"]
        assert columns["domain"] == ["math_rule"] * len(trained)  # the reward section (ROLL's default domain)
        request = json.loads(columns["sampling_params"][0])
        assert request["global_step"] == step and request["generation_config"]["max_new_tokens"] == 8
        assert metrics["time/rollout_dump"] > 0


def test_a_bad_config_exits_2_before_anything_starts(setup, capsys):
    assert main(["--config_path", str(setup), "--config_name", "rlvr", "adv_estimator=gae"]) == 2
    assert "adv_estimator: gae needs a value model" in capsys.readouterr().err


def test_prompts_need_not_divide_over_the_inference_workers(setup):
    """3 prompts plus 2 additional ones (dynamic sampling) on 2 inference workers (ROLL runs 64 on 12): generation
    is padded, the padding dropped, the surplus group dropped; or, with generate_opt_level 1, scheduled prompt by
    prompt. The two runs also use verl 0.9.1's rollout_correction, in bypass mode and in decoupled mode."""
    overrides = ["max_steps=1", "eval_steps=0", "rollout_batch_size=3", *LEAN,
                 "actor_train.training_args.per_device_train_batch_size=3",
                 "actor_train.training_args.gradient_accumulation_steps=1"]  # fmt: skip
    additional = ["is_use_additional_prompts=true", "max_additional_running_prompts=2",
                  "+rewards.math_rule.query_filter_config.type=mean_filter",
                  "+rewards.math_rule.query_filter_config.filter_args.threshold_down=-1"]  # fmt: skip
    config = ["--config_path", str(setup), "--config_name", "rlvr", *overrides]
    bypass = ["rollout_is_threshold=null", "+rollout_correction.bypass_mode=true",  # verl's bypass mode too
              "+rollout_correction.rollout_is=token", "+rollout_correction.loss_type=reinforce",
              "+rollout_correction.rollout_is_batch_normalize=true"]  # fmt: skip
    assert main([*config, *additional, *bypass, f"output_dir={setup / 'odd'}"]) == 0
    (row,) = _rows(setup / "odd")
    assert row["dynamic_sampling/generated_groups"] == 5.0 and row["dynamic_sampling/rounds"] == 1.0
    assert "actor/pg_loss" in row and "rollout_corr/rollout_is_mean" in row  # from the actor's bypass loss
    # batch normalisation in the actor's worker, inside its process group (one rank here: the sum over ranks is
    # tested in tests/rl_core/test_rollout_corr_distributed.py)
    assert row["rollout_corr/rollout_is_batch_norm_factor"] > 0
    # generate_opt_level 1: one prompt per request, at most 2 in flight, to whichever worker has room; and verl
    # 0.9.1's rollout_correction instead of the rollout_is_* keys (its metrics reach the step's)
    scheduler = ["generate_opt_level=1", "max_running_requests=2", "actor_infer.infer_batch_size=1"]
    correction = ["rollout_is_threshold=null", "+rollout_correction.rollout_is=token",
                  "+rollout_correction.rollout_rs=token_k1",
                  "+rollout_correction.rollout_rs_threshold=0.5_2.0"]  # fmt: skip
    assert main([*config, *scheduler, *correction, f"output_dir={setup / 'scheduled'}"]) == 0
    (row,) = _rows(setup / "scheduled")
    assert "actor/pg_loss" in row and row["response_length/mean"] > 0
    assert row["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and "mismatch/mismatch_kl" not in row


def test_dump_then_mock_gives_identical_training_metrics(setup, dumped, capsys):
    """The rollout-dump-mock guide's workflow: dump once, replay; compare-metrics exits 0 (exact). The replay equals
    the run that generated its rollouts bit for bit, so it equals any other replay too. The replay, validation
    included, generates nothing: actor_infer does not start and no weights are synced."""
    import subprocess
    import sys

    out, dumps = dumped
    base = ["--config_path", str(setup), "--config_name", "rlvr", "eval_steps=1", "max_steps=2"]
    mock = ["+rollout_mock.enable=true", "+rollout_mock.mode=mock", f"+rollout_mock.dump_dir={dumps}"]
    steps = ["step_000000.safetensors", "step_000001.safetensors"]
    assert sorted(p.name for p in (dumps / "train").iterdir()) == steps
    assert sorted(p.name for p in (dumps / "val").iterdir()) == steps  # the validation scheduler's split
    capsys.readouterr()
    assert main([*base, *mock, f"output_dir={setup / 'mock'}"]) == 0
    assert (
        "[preflight] actor_infer: not started (rollout_mock.mode mock replays every rollout" in capsys.readouterr().out
    )
    rows = {run: _rows(folder) for run, folder in (("dumped", out), ("mock", setup / "mock"))}
    synced = lambda row: any(key.startswith("model_update/") for key in row)  # noqa: E731
    assert all(synced(r) for r in rows["dumped"]) and not any(synced(r) for r in rows["mock"])
    assert [r["val/score/mean"] for r in rows["mock"]] == [r["val/score/mean"] for r in rows["dumped"]]
    result = subprocess.run(
        [sys.executable, "-m", "rl_replay", "compare-metrics", str(setup / "mock"), str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert main([*base[:-1], "max_steps=3", *mock, f"output_dir={setup / 'too_far'}"]) == 2  # only 2 steps dumped


def _rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_async_generation_runs_one_step_ahead_on_separate_devices(setup):
    """async_generation_ratio=1: train on slot 0, infer on slot 1; staleness 0 at step 0, then 1; validation
    pauses generation; rollout IS compares the trained policy with the behaviour policy's log-probs. Rewards are
    scored by two reward workers on Ray."""
    overrides = ["max_steps=3", "eval_steps=2", "async_generation_ratio=1", f"output_dir={setup / 'async'}",
                 *LEAN, "actor_infer.device_mapping=[1]", "actor_train.training_args.per_device_train_batch_size=4",
                 "entropy_loss_coef=0.1",  # a gradient even when every reward is 0: the weights move
                 "+rewards.math_rule.world_size=2"]  # fmt: skip
    assert main(["--config_path", str(setup), "--config_name", "rlvr", *overrides]) == 0
    rows = _rows(setup / "async")
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["async/staleness/mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert "time/validation_pause" in rows[0] and "val/score/mean" in rows[2] and "val/score/mean" not in rows[1]
    assert all("mismatch/mismatch_kl" in r and "time/generate_wait" in r for r in rows)
    # A stale batch was sampled by older weights, so the behaviour and trained policies differ there.
    assert abs(rows[1]["mismatch/mismatch_kl"]) > 100 * abs(rows[0]["mismatch/mismatch_kl"])


def test_async_generation_needs_separate_devices(setup, capsys):
    assert main(["--config_path", str(setup), "--config_name", "rlvr", "async_generation_ratio=1"]) == 2
    assert "async_generation_ratio=1 needs actor_infer on devices of its own" in capsys.readouterr().err
    assert main(["--config_path", str(setup), "--config_name", "rlvr", "async_generation_ratio=0.5"]) == 2
    assert "async_generation_ratio must be a whole number" in capsys.readouterr().err


def test_sample_masks_reach_the_loop_and_an_all_masked_step_skips_training(setup):
    """Every tiny-model response runs into response_length, so max_len_mask leaves nothing to train on; the
    weight sync follows actor_infer.model_update_frequency."""
    overrides = ["max_steps=2", "eval_steps=0", "max_len_mask=true", f"output_dir={setup / 'masked'}", *LEAN,
                 "actor_infer.model_update_frequency=2"]  # fmt: skip
    assert main(["--config_path", str(setup), "--config_name", "rlvr", *overrides]) == 0
    rows = _rows(setup / "masked")
    for row in rows:
        assert row["actor/max_len_mask_ratio"] == 0.0 and row["mask/final_mask_sum_eq_0"] == 1.0
        assert "actor/pg_loss" not in row and row["response_length/clip_ratio"] == 1.0
    # actor_infer.model_update_frequency=2: weights are synced every second step
    assert "time/model_update" not in rows[0] and "time/model_update" in rows[1]


def test_global_template_overrides_the_data_args_template(setup):
    """ROLL: global_template, when set, is the chat template of every prompt (training and validation)."""
    from apps.common.yaml_config import load_config
    from apps.rlvr.config import RLVRConfig
    from apps.rlvr.pipeline import RLVRPipeline

    def templates(*overrides):
        config = RLVRConfig.from_dict(load_config(setup / "rlvr.yaml", list(overrides)))
        pipeline = RLVRPipeline(config, log=lambda line: None)
        assert pipeline.validator is not None
        return pipeline.prompts.template, pipeline.validator.prompts.template

    assert templates() == ("native", "native")
    assert templates("+global_template=qwen2_5") == ("qwen2_5", "qwen2_5")


def test_a_text_models_validation_prompts_are_encoded_as_trainings_as_roll(setup):
    """ROLL's RLVR pipeline encodes validation prompts with the training encode_function: a different
    validation.data_args.template (or column) is not read, and pre-flight says so; the per-tag templates apply."""
    from apps.common.yaml_config import load_config
    from apps.rlvr.config import RLVRConfig
    from apps.rlvr.pipeline import RLVRPipeline

    lines: list[str] = []
    overrides = ["+validation.data_args.template=chatml", "+tag_to_template={math: qwen3}"]
    pipeline = RLVRPipeline(RLVRConfig.from_dict(load_config(setup / "rlvr.yaml", overrides)), log=lines.append)
    assert pipeline.validator is not None
    shown = pipeline.validator.prompts
    assert (shown.template, shown.messages_key, shown.tag_templates) == ("native", "messages", {"math": "qwen3"})
    assert any("validation.data_args.template='chatml' is not read" in line for line in lines)


def test_a_lora_actor_trains_adapters_against_its_own_base_as_the_reference(setup, capsys):
    """LoRA (ROLL's model_args.lora_*) with the KL loss: no reference role starts, actor_train scores the base with
    its adapters disabled. At step 0 the fresh adapters (B = 0) are the base, so the KL to the reference is 0; once
    trained it is not (a reference that were the adapted actor, or ROLL's old-log-prob stand-in, would stay 0).
    actor_infer receives merged weights under the base names; the checkpoint holds adapters, the export both."""
    overrides = ["max_steps=2", "eval_steps=0", f"output_dir={setup / 'lora'}", "actor_train.device_mapping=[0]",
                 "actor_infer.device_mapping=[0]", "+actor_train.model_args.lora_target=all-linear",
                 "+actor_train.model_args.lora_rank=4",
                 "actor_train.training_args.learning_rate=2e-2", "entropy_loss_coef=0.1"]  # fmt: skip
    assert main(["--config_path", str(setup), "--config_name", "rlvr", *overrides]) == 0
    assert "[preflight] reference: the actor's base model with its LoRA adapters disabled" in capsys.readouterr().out
    from apps.common.preflight import role_sections
    from apps.common.yaml_config import load_config
    from apps.rlvr.config import RLVRConfig

    config = RLVRConfig.from_dict(load_config(setup / "rlvr.yaml", overrides))
    assert (
        "reference" not in role_sections(config)
        and "reference"
        in role_sections(  # not started with LoRA
            RLVRConfig.from_dict(load_config(setup / "rlvr.yaml", overrides[:4]))
        )
    )
    rows = _rows(setup / "lora")
    assert rows[0]["critic/kl"] == 0.0 and rows[1]["critic/kl"] > 1e-6
    assert rows[1]["model_update/tensors"] == 26  # the base model's weights, adapters merged in
    checkpoint = setup / "lora" / "checkpoints" / "checkpoint-1"
    assert json.loads((checkpoint / "actor_train" / "meta.json").read_text())["adapters_only"] is True
    assert (checkpoint / "actor_hf" / "adapter" / "adapter_model.safetensors").exists()


def test_profiler_timeline_writes_a_trace_per_role_call(setup):
    """ROLL's profiler_timeline: rank 0 of each role profiles every generate / log-prob / train call into
    profiler_output_dir/<exp_name>/<start time>/<role>/<method>/ (torch.profiler's trace files)."""
    folder = setup / "profiles"
    overrides = ["max_steps=1", "eval_steps=0", *LEAN, "+profiler_timeline=true", f"+profiler_output_dir={folder}",
                 f"output_dir={setup / 'profiled'}"]  # fmt: skip
    assert main(["--config_path", str(setup), "--config_name", "rlvr", *overrides]) == 0
    (run,) = (folder / "tiny_rlvr").iterdir()  # the start time
    traces = {str(p.parent.relative_to(run)) for p in run.rglob("*.pt.trace.json")}
    assert traces >= {"actor_infer/generate", "actor_train/compute_log_probs", "actor_train/train_step"}
    trace = json.loads(next((run / "actor_train" / "train_step").glob("*.pt.trace.json")).read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])  # torch ops recorded


def test_the_rollout_pipeline_scores_the_validation_set_as_training_validates_and_trains_nothing(
    setup, dumped, tmp_path, capsys
):
    """ROLL's RLVRRolloutPipeline on the training file itself (as ROLL runs it on rlvr_config_8gpus.yaml): one pass
    over the validation set whose generations and scores are bit for bit the training run's step-0 validation
    (both dumped by rollout_mock), logged once as step 0 whatever max_steps says; nothing trains or is saved. What
    it cannot run is refused before anything starts."""
    from safetensors.torch import load_file

    from apps.rlvr.rollout_pipeline import main as rollout_main

    trained_out, train_dumps = dumped
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    out.mkdir()
    shutil.copy(trained_out / "metrics.jsonl", out / "metrics.jsonl")  # the training run's output_dir, as ROLL runs it
    args = ["--config_path", str(setup), "--config_name", "rlvr", f"output_dir={out}"]
    assert rollout_main([*args, "resume_from_checkpoint=true"]) == 2
    assert "the rollout pipeline trains nothing" in capsys.readouterr().err
    assert rollout_main([*args, "validation=null"]) == 2
    assert "give validation.data_args.file_name" in capsys.readouterr().err
    assert rollout_main([*args, *DUMP, f"+rollout_mock.dump_dir={dumps}"]) == 0
    step_0 = "val/step_000000.safetensors"
    ours, trained = load_file(dumps / step_0), load_file(train_dumps / step_0)
    assert ours.keys() == trained.keys() and all(torch.equal(ours[k], trained[k]) for k in ours)
    (row,) = [json.loads(line) for line in (out / "rollout_pipeline" / "metrics.jsonl").read_text().splitlines()]
    assert (out / "metrics.jsonl").read_bytes() == (trained_out / "metrics.jsonl").read_bytes()  # left as it was
    first = json.loads((setup / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 0 and row["time/step_generate"] > 0
    for key in ("val_correct/all/mean", "val/score/mean", "val/score/math_rule", "val/samples"):
        assert row[key] == first[key], key
    logged = capsys.readouterr().out
    examples = json.loads(next(line for line in logged.splitlines() if line.startswith("[{")))
    assert len(examples) == 10 and all("+" in example["prompt"] for example in examples)
    assert not (out / "checkpoints").exists()

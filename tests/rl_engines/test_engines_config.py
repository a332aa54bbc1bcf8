"""WorkerConfig: ROLL's worker keys, key-path errors, YAML coercions; and fsdp2_train's strategy_config checks."""

from __future__ import annotations

import pytest
from engine_fixtures import tiny_model_dir, worker_config

from rl_engines.config import WorkerConfig, WorkerConfigError
from rl_engines.strategies import create_strategy
from tests.shared_dir import ROLL_EXAMPLES, require_shared

__all__ = ["tiny_model_dir"]


def test_a_roll_worker_section_loads_with_its_keys():
    section = {
        "model_args": {"disable_gradient_checkpointing": False, "dtype": "bf16", "model_type": None},
        "training_args": {"learning_rate": "1.0e-6", "weight_decay": 0, "per_device_train_batch_size": 1,
                          "gradient_accumulation_steps": 32, "warmup_steps": 20, "num_train_epochs": 50},
        "data_args": {"template": "qwen2_5", "file_name": ["a.jsonl"], "messages": "messages"},
        "strategy_args": {"strategy_name": "megatron_train",
                          "strategy_config": {"tensor_model_parallel_size": 1, "recompute_granularity": "full"}},
        "device_mapping": "list(range(0,16))",
        "infer_batch_size": 4,
    }  # fmt: skip
    config = WorkerConfig.from_dict(section, "actor_train")
    assert config.device_mapping == list(range(16))
    assert config.training_args.learning_rate == pytest.approx(1e-6)  # YAML reads 1.0e-6 as a string
    assert config.training_args.weight_decay == 0.0 and isinstance(config.training_args.weight_decay, float)
    assert config.model_args.dtype == "bf16"
    assert config.strategy_args.strategy_config["recompute_granularity"] == "full"
    assert config.data_args["template"] == "qwen2_5"


def test_the_worker_sections_of_a_real_roll_file_load():
    yaml = pytest.importorskip("yaml")
    path = require_shared(ROLL_EXAMPLES / "qwen2.5-7B-rlvr_megatron" / "rlvr_config.yaml")
    document = yaml.safe_load(path.read_text())
    for role in ("actor_train", "actor_infer", "reference"):
        section = dict(document[role])
        generating = section.get("generating_args", {})
        for key, value in list(generating.items()):
            if isinstance(value, str) and value.startswith("${"):  # the apps resolve interpolations
                generating[key] = 8
        config = WorkerConfig.from_dict(section, role)
        assert config.device_mapping, role


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"training_args": {"learning_rat": 1e-6}}, r"unknown key\(s\) \['actor_train\.training_args\.learning_rat'\]"),
        (
            {"training_args": {"per_device_train_batch_size": "two"}},
            r"actor_train\.training_args\.per_device_train_batch_size must be int, got str 'two'",
        ),
        (
            {"training_args": {"gradient_accumulation_steps": 0}},
            r"actor_train\.training_args\.gradient_accumulation_steps must be >= 1",
        ),
        ({"model_args": {"dtype": "fp8"}}, r"actor_train\.model_args\.dtype='fp8' is not supported"),
        ({"model_args": "bf16"}, r"actor_train\.model_args must be a mapping"),
        ({"generating_args": {"num_beams": 4}}, r"actor_train\.generating_args\.num_beams=4"),
        ({"generating_args": {"top_p": 0}}, r"actor_train\.generating_args\.top_p must be in \(0, 1\]"),
        (
            {"generating_args": {"include_stop_str_in_output": False}},
            r"actor_train\.generating_args\.include_stop_str_in_output=false is not supported: .* set it to true",
        ),
        ({"generating_args": {"do_sample": False}}, r"generating_args\.do_sample=False is not supported: for greedy"),
        ({"generating_args": {"max_length": 512}}, r"generating_args\.max_length=512 .* cap the response with max_new"),
        ({"generating_args": {"length_penalty": 0.5}}, r"generating_args\.length_penalty=0\.5 .* beam search"),
        ({"generating_args": {"logprobs": 5}}, r"generating_args\.logprobs=5 is not supported"),
        ({"infer_batch_size": True}, r"actor_train\.infer_batch_size must be int, got bool"),
        ({"device_mapping": "list(range(0,8)) + os.system('x')"}, r"actor_train\.device_mapping"),
        ({"training_args": {"max_grad_norm": -1}}, r"actor_train\.training_args\.max_grad_norm must be > 0 or null"),
    ],
)
def test_bad_values_are_rejected_with_the_key_path(section, message):
    with pytest.raises(WorkerConfigError, match=message):
        WorkerConfig.from_dict(section, "actor_train")


def test_rolls_other_generating_args_keys_load_at_their_defaults():
    """ROLL's GeneratingArguments keys that change nothing here at their defaults (as its to_dict() passes them)."""
    keys = {"do_sample": True, "max_length": 8192, "length_penalty": 1.0, "logprobs": 0}
    config = WorkerConfig.from_dict({"generating_args": keys}, "actor_infer")
    assert (config.generating_args.do_sample, config.generating_args.logprobs) == (True, 0)
    assert (
        WorkerConfig.from_dict({"generating_args": {"logprobs": None}}, "actor_infer").generating_args.logprobs is None
    )


def test_null_is_accepted_only_where_the_default_allows_it():
    config = WorkerConfig.from_dict({"training_args": {"max_grad_norm": None, "max_steps": None}}, "critic")
    assert config.training_args.max_grad_norm is None
    with pytest.raises(WorkerConfigError, match=r"critic\.training_args\.learning_rate must not be null"):
        WorkerConfig.from_dict({"training_args": {"learning_rate": None}}, "critic")


@pytest.mark.parametrize(
    ("strategy_config", "message"),
    [
        ({"fsdp_sizes": 2}, r"unknown key\(s\) \['actor_train\.strategy_args\.strategy_config\.fsdp_sizes'\]"),
        (
            {"reshard_after_forward": "false"},
            r"actor_train\.strategy_args\.strategy_config\.reshard_after_forward must be bool, got str 'false'",
        ),
        ({"fsdp_size": True}, r"strategy_config\.fsdp_size must be int, got bool"),
    ],
)
def test_fsdp2_strategy_config_is_checked_before_loading(tiny_model_dir, strategy_config, message):
    config = worker_config(tiny_model_dir, strategy_args={"strategy_name": "fsdp2_train",
                                                          "strategy_config": strategy_config})  # fmt: skip
    with pytest.raises(ValueError, match=message):
        create_strategy(config, "actor_train")


def test_fsdp2_mesh_and_wrap_policy_errors_name_the_fix(tiny_model_dir):
    config = worker_config(tiny_model_dir, strategy_args={"strategy_config": {"fsdp_size": 2}})
    with pytest.raises(ValueError, match=r"fsdp_size=2 must divide the role's world size 1"):
        create_strategy(config, "actor_train").initialize()
    wrap = {"wrap_policy": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    config = worker_config(tiny_model_dir, strategy_args={"strategy_config": wrap})
    with pytest.raises(ValueError, match=r"its layer classes are \['Qwen2DecoderLayer'\]"):
        create_strategy(config, "actor_train").initialize()
    good = {"wrap_policy": {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}, "reshard_after_forward": False}
    create_strategy(worker_config(tiny_model_dir, strategy_args={"strategy_config": good}), "actor_train").initialize()


def test_fsdp2_options_that_change_nothing_here_are_accepted_with_a_note(tiny_model_dir):
    """ROLL's use_batched_model_update (and offload_policy on a CPU) are accepted, each with a line saying what it
    does in ROLL and what happens here; false says nothing."""
    options = {"use_batched_model_update": True, "offload_policy": True}
    config = worker_config(tiny_model_dir, strategy_args={"strategy_name": "fsdp2_train", "strategy_config": options})
    notes = create_strategy(config, "actor_train").notes()
    assert [note.split(":")[0] for note in notes] == [
        "actor_train.strategy_args.strategy_config.offload_policy",
        "actor_train.strategy_args.strategy_config.use_batched_model_update",
    ]
    assert "each weight is gathered on its own" in notes[1]
    quiet = {"use_batched_model_update": False}
    config = worker_config(tiny_model_dir, strategy_args={"strategy_name": "fsdp2_train", "strategy_config": quiet})
    assert create_strategy(config, "actor_train").notes() == []


def test_an_fsdp_size_that_does_not_divide_the_ranks_fails_before_any_worker_starts(tiny_model_dir):
    config = worker_config(
        tiny_model_dir,
        device_mapping=[0, 1],
        strategy_args={"strategy_name": "fsdp2_train", "strategy_config": {"fsdp_size": 16}},
    )
    with pytest.raises(ValueError, match=r"strategy_config\.fsdp_size=16 must divide the role's world size 2"):
        create_strategy(config, "actor_train")  # what pre-flight calls


def test_an_unknown_strategy_name_lists_the_registered_ones(tiny_model_dir):
    config = worker_config(tiny_model_dir, "reference", strategy_args={"strategy_name": "megatron_inference"})
    with pytest.raises(ValueError, match=r"reference\.strategy_args\.strategy_name='megatron_inference' is not a"):
        create_strategy(config, "reference")


def test_a_missing_engine_names_the_install_command():
    from rl_engines.strategies.base import require_engine_package

    with pytest.raises(
        ImportError, match=r"strategy_name=vllm needs the no_such_engine_pkg package.*rl-engines\[vllm\]"
    ):
        require_engine_package("no_such_engine_pkg", "vllm", "vllm")
    require_engine_package("torch", "fsdp2_train", "-")  # importable: nothing raised

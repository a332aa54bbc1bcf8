"""The ``vllm`` strategy beyond the infer contract: agreement with hf_infer, weight sync, seeds, and a Ray run.

Engine tests run where vLLM imports (``bash scripts/setup_vllm.sh`` builds ``.venv-vllm``); elsewhere they skip
and only the strategy_config checks run. The in-process engines use a small KV cache to start fast.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from engine_fixtures import make_tiny_model, prompt_batch, rollout_batch, tiny_model_dir, worker_config

from rl_core.rollout_is import compute_mismatch_metrics
from rl_engines.config import GeneratingArgs, WorkerConfigError
from rl_engines.objectives import ActorObjective
from rl_engines.placement import ClusterSpec
from rl_engines.ray_cluster import cpu_device_resources, start_ray, stop_ray
from rl_engines.roles import Roles
from rl_engines.strategies import create_strategy
from rl_engines.weight_sync import expand_aliases, iter_buckets

__all__ = ["tiny_model_dir"]

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed here; "
                                "run in .venv-vllm (bash scripts/setup_vllm.sh)")  # fmt: skip
QUESTIONS = ["1+2=", "10+12=", "what is 3+3?", "4+5="]
SMALL_KV = {"kv_cache_memory_bytes": 32 << 20}


def make_vllm(model_dir, *, strategy_config=None, model_args=None, **generating_args):
    args = {"max_new_tokens": 8, "num_return_sequences": 4, "seed": 0, **generating_args}
    config = worker_config(model_dir, "actor_infer", generating_args=args, model_args=model_args or {},
                           strategy_args={"strategy_name": "vllm",
                                          "strategy_config": {**SMALL_KV, **(strategy_config or {})}})  # fmt: skip
    strategy = create_strategy(config, "actor_infer")
    strategy.initialize()
    return strategy


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One engine for the tests that leave its weights alone (at ROLL's optimization_level 1: vLLM takes it)."""
    strategy = make_vllm(tiny_model_dir, strategy_config={"optimization_level": 1})
    yield strategy
    strategy.close()


@pytest.fixture(scope="module")
def hf_scorer(tiny_model_dir):
    config = worker_config(
        tiny_model_dir, "reference", infer_batch_size=16, strategy_args={"strategy_name": "hf_infer"}
    )
    strategy = create_strategy(config, "reference")
    strategy.initialize()
    return strategy


# ---- strategy_config: checked without vLLM ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("strategy_config", "message"),
    [
        ({"gpu_memory_util": 0.5}, r"actor_infer\.strategy_args\.strategy_config\.gpu_memory_util'\]"),
        ({"gpu_memory_utilization": 1.5}, r"actor_infer\.strategy_args\.strategy_config\.gpu_memory_utilization must"),
        ({"load_format": "npz"}, r"actor_infer\.strategy_args\.strategy_config\.load_format='npz'"),
        ({"block_size": "16"}, r"actor_infer\.strategy_args\.strategy_config\.block_size must be int"),
        ({"sleep_level": 3}, r"actor_infer\.strategy_args\.strategy_config\.sleep_level must be 1 or 2"),
        ({"optimization_level": 4}, r"actor_infer\.strategy_args\.strategy_config\.optimization_level must be 0"),
        ({"limit_mm_per_prompt": {"image": -1}}, r"strategy_config\.limit_mm_per_prompt\.image must be an int >= 0"),
        ({"disable_mm_preprocessor_cache": "yes"}, r"strategy_config\.disable_mm_preprocessor_cache must be bool"),
        ({"cudagraph_capture_sizes": [1, 0]}, r"strategy_config\.cudagraph_capture_sizes must be batch sizes >= 1"),
    ],
    ids=[
        "unknown",
        "range",
        "load_format",
        "type",
        "sleep_level",
        "optimization_level",
        "limit_mm_per_prompt",
        "disable_mm_preprocessor_cache",
        "cudagraph_capture_sizes",
    ],
)
def test_strategy_config_errors_name_the_key(tiny_model_dir, strategy_config, message):
    config = worker_config(tiny_model_dir, "actor_infer",
                           strategy_args={"strategy_name": "vllm", "strategy_config": strategy_config})  # fmt: skip
    with pytest.raises(WorkerConfigError, match=message):
        create_strategy(config, "actor_infer")


def test_rolls_pass_through_engine_options_reach_the_engine(tiny_model_dir):
    """ROLL hands its vLLM strategy_config to vLLM: these reach vllm.LLM's arguments (the engine tests below build
    engines with them)."""
    from rl_engines.strategies.vllm_config import engine_kwargs, parse_vllm_config

    options = {"tensor_parallel_size": 1, "disable_log_stats": False, "disable_custom_all_reduce": True,
               "optimization_level": 1, "limit_mm_per_prompt": {"image": 10},
               "disable_mm_preprocessor_cache": True}  # fmt: skip
    config = worker_config(tiny_model_dir, "actor_infer",
                           strategy_args={"strategy_name": "vllm", "strategy_config": options})  # fmt: skip
    kwargs = engine_kwargs(config, parse_vllm_config(config, "actor_infer"), on_cpu=True, seed=0)
    assert (kwargs["tensor_parallel_size"], kwargs["disable_log_stats"], kwargs["disable_custom_all_reduce"],
            kwargs["optimization_level"]) == (1, False, True, 1)  # fmt: skip
    # vLLM refuses these on a text model; VL models are refused here
    assert "limit_mm_per_prompt" not in kwargs and "disable_mm_preprocessor_cache" not in kwargs


def test_cuda_graph_sizes_reach_a_gpu_engine_that_captures_graphs(tiny_model_dir):
    """ROLL's Qwen3.5 files give vLLM cudagraph_capture_sizes: its compilation config on a GPU engine that is not
    eager; a CPU or eager engine captures no graphs and gets none."""
    from rl_engines.strategies.vllm_config import engine_kwargs, parse_vllm_config

    def kwargs(on_cpu: bool, **options):
        strategy = {"strategy_name": "vllm", "strategy_config": {"cudagraph_capture_sizes": [8, 1, 4], **options}}
        config = worker_config(tiny_model_dir, "actor_infer", strategy_args=strategy)
        return engine_kwargs(config, parse_vllm_config(config, "actor_infer"), on_cpu=on_cpu, seed=0)

    assert kwargs(False)["compilation_config"] == {"cudagraph_capture_sizes": [1, 4, 8]}
    assert kwargs(False, cuda_graph_sizes=[8, 1, 4])["compilation_config"] == {"cudagraph_capture_sizes": [1, 4, 8]}
    # vLLM 0.10's one value N: [1, 2, 4] and the multiples of 8 up to N
    assert kwargs(False, cuda_graph_sizes=[24], cudagraph_capture_sizes=None)["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24]}  # fmt: skip
    with pytest.raises(WorkerConfigError, match=r"cuda_graph_sizes and .*cudagraph_capture_sizes are two names"):
        kwargs(False, cuda_graph_sizes=[2])
    assert "compilation_config" not in kwargs(True) and "compilation_config" not in kwargs(False, enforce_eager=True)


def test_a_tensor_parallel_engine_takes_its_devices_per_worker_from_the_size_as_in_roll(tiny_model_dir, caplog):
    """ROLL's worker config sets a vllm role's num_gpus_per_worker to tensor_parallel_size (default 1): video_r1.yaml
    gives only the latter, ROLL's Qwen3.5-27B file a different num_gpus_per_worker (replaced, with a warning)."""
    vllm = {"strategy_name": "vllm", "strategy_config": {"tensor_parallel_size": 2}}
    derived = worker_config(tiny_model_dir, "actor_infer", device_mapping=[0, 1, 2, 3], strategy_args=vllm)
    assert derived.num_gpus_per_worker == 2 and not caplog.records
    replaced = worker_config(tiny_model_dir, "actor_infer", device_mapping=[0, 1, 2, 3], num_gpus_per_worker=4,
                             strategy_args=vllm)  # fmt: skip
    assert replaced.num_gpus_per_worker == 2
    assert "actor_infer.num_gpus_per_worker=4 is replaced by strategy_args.strategy_config.tensor_parallel_size=2" in (
        caplog.text)  # fmt: skip
    single = worker_config(tiny_model_dir, "actor_infer", device_mapping=[0, 1], num_gpus_per_worker=2,
                           strategy_args={"strategy_name": "vllm"})  # fmt: skip
    assert single.num_gpus_per_worker == 1  # no tensor_parallel_size: ROLL's default 1, two engines
    hf = {"strategy_name": "hf_infer", "strategy_config": {"tensor_parallel_size": 2}}  # not vLLM's: not read
    assert worker_config(tiny_model_dir, "actor_infer", strategy_args=hf).num_gpus_per_worker == 1


# ---- agreement with hf_infer --------------------------------------------------------------------------------
@needs_vllm
@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}])
def test_sampled_log_probs_equal_hf_teacher_forcing(engine, hf_scorer, tiny_model_dir, sampling):
    args = GeneratingArgs(max_new_tokens=8, num_return_sequences=4, seed=1, **sampling)
    rollout = engine.generate(prompt_batch(tiny_model_dir, QUESTIONS), args)
    mask = rollout.batch["response_mask"]
    hf = hf_scorer.compute_log_probs(rollout, temperature=args.temperature).batch["log_probs"]
    diff = float((rollout.batch["rollout_log_probs"] - hf)[mask].abs().max())
    kl = compute_mismatch_metrics(hf, rollout.batch["rollout_log_probs"], mask)["mismatch_kl"]
    print(f"\n[vllm vs hf_infer, {sampling}] max |rollout_log_probs - hf| = {diff:.2e}, mismatch_kl = {kl:.2e}")
    assert diff < 1e-5 and abs(kl) < 1e-6
    scored = engine.compute_log_probs(rollout, temperature=args.temperature).batch["log_probs"]
    torch.testing.assert_close(scored[mask], hf[mask], atol=1e-5, rtol=0)


@needs_vllm
def test_n_samples_per_prompt_are_adjacent_and_distinct(engine, tiny_model_dir):
    rollout = engine.generate(prompt_batch(tiny_model_dir, QUESTIONS))
    assert len(rollout) == 4 * len(QUESTIONS)
    assert list(rollout.non_tensor_batch["question"]) == [q for q in QUESTIONS for _ in range(4)]
    prompts = rollout.batch["prompts"].view(len(QUESTIONS), 4, -1)
    assert bool((prompts == prompts[:, :1]).all())
    responses = rollout.batch["responses"].view(len(QUESTIONS), 4, -1)
    assert all(len({tuple(r.tolist()) for r in group}) > 1 for group in responses)  # the n draws differ


@needs_vllm
def test_seeds_reproduce_and_differ_by_seed_and_rank(engine, tiny_model_dir, monkeypatch):
    prompts = prompt_batch(tiny_model_dir, QUESTIONS[:2])
    first, again = engine.generate(prompts), engine.generate(prompts)
    assert torch.equal(first.batch["responses"], again.batch["responses"])
    assert torch.equal(first.batch["rollout_log_probs"], again.batch["rollout_log_probs"])
    other_seed = engine.generate(prompts, GeneratingArgs(max_new_tokens=8, num_return_sequences=4, seed=1))
    assert not torch.equal(first.batch["responses"], other_seed.batch["responses"])
    monkeypatch.setenv("RANK", "1")  # a second data-parallel worker with the same generating_args
    assert not torch.equal(first.batch["responses"], engine.generate(prompts).batch["responses"])


@needs_vllm
def test_entropy_and_export_after_sync_are_refused_clearly(engine, tiny_model_dir):
    with pytest.raises(NotImplementedError, match="does not compute entropy"):
        engine.compute_log_probs(rollout_batch(batch_size=2), with_entropy=True)
    names = {name for name, _ in engine.named_weights()}  # before any sync: the checkpoint
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= names


# ---- weight sync --------------------------------------------------------------------------------------------
def reference_scores(state, model_dir, batch, tmp_path):
    """log-probs of ``batch`` under ``model_dir``'s architecture holding ``state`` (tied like the receiver)."""
    from engine_fixtures import reference_log_probs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.save_pretrained(str(tmp_path))
    return reference_log_probs(tmp_path, batch)


def push(strategy, state, bucket_bytes):
    """Send ``state`` in buckets the way a weight sync does (small buckets split decoder layers)."""
    return sum(strategy.load_weights(expand_aliases(bucket)) for bucket in iter_buckets(state.items(), bucket_bytes))


@needs_vllm
def test_sync_into_tied_embeddings_updates_scores_and_generations(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    strategy = make_vllm(tiny_model_dir, temperature=0.0, num_return_sequences=1)
    other = make_tiny_model(tmp_path / "other", seed=7)  # same architecture, other weights, tied
    state = AutoModelForCausalLM.from_pretrained(str(other)).state_dict()
    batch = rollout_batch(batch_size=3)
    mask = batch.batch["response_mask"]
    before = strategy.compute_log_probs(batch).batch["log_probs"]
    assert push(strategy, state, bucket_bytes=30_000) == len(state)
    expected = reference_scores(state, tiny_model_dir, batch, tmp_path / "ref")
    got = strategy.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(got[mask].double(), expected[mask], atol=2e-5, rtol=0)
    assert float((got - before)[mask].abs().max()) > 1e-2

    # Only the embedding changes: the tied lm_head must follow it.
    embed = state["model.embed_tokens.weight"] * 1.5
    strategy.load_weights(iter([("model.embed_tokens.weight", embed)]))
    scaled = {**state, "model.embed_tokens.weight": embed, "lm_head.weight": embed}
    expected = reference_scores(scaled, tiny_model_dir, batch, tmp_path / "ref_scaled")
    torch.testing.assert_close(strategy.compute_log_probs(batch).batch["log_probs"][mask].double(), expected[mask],
                               atol=2e-5, rtol=0)  # fmt: skip

    # Greedy generation follows the new weights too.
    prompts = prompt_batch(tiny_model_dir, QUESTIONS[:1])
    tokens = strategy.generate(prompts).batch["responses"][0].tolist()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref_scaled")).eval()
    context = prompts.batch["input_ids"][0][prompts.batch["attention_mask"][0].bool()].tolist()
    with torch.no_grad():
        for token in tokens[:4]:
            assert token == int(model(torch.tensor([context])).logits[0, -1].argmax())
            context.append(token)
    strategy.close()


LORA = {"lora_target": "q_proj,v_proj,down_proj", "lora_rank": 4, "lora_alpha": 8}


def random_adapter(model_dir, seed):
    """LoRA factors (PEFT's names, as an adapter-only sync sends them) for q/v/down_proj of every layer."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, module in AutoModelForCausalLM.from_pretrained(str(model_dir)).named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "v_proj", "down_proj"):
            prefix = f"base_model.model.{name}"
            adapter[f"{prefix}.lora_A.weight"] = torch.randn(4, module.in_features, generator=gen) * 0.3
            adapter[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=gen) * 0.3
    return adapter


def merged_state(model_dir, adapter):
    """The base weights with ``adapter`` merged in (scale lora_alpha / lora_rank = 2)."""
    from transformers import AutoModelForCausalLM

    from rl_engines.strategies.lora import merge

    state = AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict()
    for name in [n for n in adapter if ".lora_A." in n]:
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        state[f"{module}.weight"] = merge(state[f"{module}.weight"], adapter[name],
                                          adapter[name.replace(".lora_A.", ".lora_B.")], 2.0)  # fmt: skip
    return state


def test_adapter_sync_with_sleep_level_2_is_refused_naming_the_key(tiny_model_dir):
    config = worker_config(tiny_model_dir, "actor_infer", model_args=LORA,
                           strategy_args={"strategy_name": "vllm", "strategy_config": {"sleep_level": 2}})  # fmt: skip
    with pytest.raises(ValueError, match=r"actor_infer\.strategy_args\.strategy_config\.sleep_level=2 .* never sends"):
        create_strategy(config, "actor_infer")


@needs_vllm
def test_an_adapter_only_sync_serves_the_adapter_as_its_merged_weights(tiny_model_dir, tmp_path):
    """actor_infer with ROLL's lora_* keys: vLLM keeps its base model and serves the adapters a sync sends (a
    few KB here instead of the model); its scores and greedy tokens are the merged model's, a second adapter
    replaces the first, and closing removes the adapter folder."""
    strategy = make_vllm(tiny_model_dir, temperature=0.0, num_return_sequences=1, model_args=LORA)
    batch = rollout_batch(batch_size=3)
    mask = batch.batch["response_mask"]
    from engine_fixtures import reference_log_probs

    base = strategy.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(base[mask].double(), reference_log_probs(tiny_model_dir, batch)[mask], atol=2e-5,
                               rtol=0)  # fmt: skip
    for seed in (1, 2):
        adapter = random_adapter(tiny_model_dir, seed)
        assert push(strategy, adapter, bucket_bytes=8_000) == len(adapter)
        expected = reference_scores(merged_state(tiny_model_dir, adapter), tiny_model_dir, batch, tmp_path / f"{seed}")
        got = strategy.compute_log_probs(batch).batch["log_probs"]
        torch.testing.assert_close(got[mask].double(), expected[mask], atol=2e-5, rtol=0)
        assert float((got - base)[mask].abs().max()) > 1e-2
    folder = strategy.adapter.folder
    assert folder is not None and folder.exists()
    strategy.close()
    assert not folder.exists()


def trained_moe(folder):
    """A tiny Qwen3-MoE at ``folder`` trained a step on fsdp2_train; its batch and its weights under the model
    folder's per-expert names (what ``Roles.model_updater`` sends vLLM)."""
    from transformers import AutoTokenizer

    from rl_engines.objectives import ActorObjective
    from rl_engines.strategies.model_io import in_checkpoint_names
    from rl_engines.tiny_model import build_tiny_moe_lm, build_tiny_tokenizer

    build_tiny_tokenizer(folder, [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)], vocab_size=256)
    build_tiny_moe_lm(folder, vocab_size=len(AutoTokenizer.from_pretrained(str(folder))))
    train = create_strategy(worker_config(folder, training_args={"learning_rate": 5e-2}), "actor_train")
    train.initialize()
    batch = rollout_batch(batch_size=3)
    batch.batch["old_log_probs"] = train.compute_log_probs(batch).batch["log_probs"]
    train.train_step(batch, ActorObjective())
    state = dict(in_checkpoint_names(train.transformers_model(), train.named_weights()))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in state
    return train, batch, state


@needs_vllm
def test_a_moe_actor_syncs_into_vllm_under_checkpoint_names(tmp_path):
    """The per-expert weights load into vLLM, which then scores as the trained model. On CPU the reloaded expert
    weights are repacked for vLLM's grouped-GEMM kernel (vLLM's own reload leaves them in checkpoint layout)."""
    train, batch, state = trained_moe(tmp_path)
    engine = make_vllm(tmp_path, temperature=0.0, num_return_sequences=1)
    mask = batch.batch["response_mask"]
    before = engine.compute_log_probs(batch).batch["log_probs"].cpu()
    assert push(engine, state, bucket_bytes=20_000) == len(state)
    expected = train.compute_log_probs(batch).batch["log_probs"].cpu()
    got = engine.compute_log_probs(batch).batch["log_probs"].cpu()
    torch.testing.assert_close(got[mask], expected[mask], atol=2e-5, rtol=0)
    assert float((got - before)[mask].abs().max()) > 1e-2
    engine.close()


@needs_vllm
def test_half_synced_layer_is_held_back_and_refused(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    strategy = make_vllm(tiny_model_dir, strategy_config={"load_format": "dummy"})  # weights arrive by sync
    state = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).state_dict()
    layer0 = {k: v for k, v in state.items() if k.startswith("model.layers.0.")}
    first = dict(list(layer0.items())[:3])
    strategy.load_weights(iter(first.items()))
    with pytest.raises(RuntimeError, match=r"weights of model\.layers\.0 arrived without \["):
        strategy.compute_log_probs(rollout_batch(batch_size=2))
    with pytest.raises(RuntimeError, match="cannot export its current weights"):
        strategy.named_weights()
    push(strategy, state, bucket_bytes=10**9)  # the rest: dummy weights replaced by the checkpoint's
    batch = rollout_batch(batch_size=3)
    mask = batch.batch["response_mask"]
    from engine_fixtures import reference_log_probs

    got = strategy.compute_log_probs(batch).batch["log_probs"]
    torch.testing.assert_close(got[mask].double(), reference_log_probs(tiny_model_dir, batch)[mask], atol=2e-5, rtol=0)
    strategy.close()


# ---- a vllm role on Ray, colocated with fsdp2_train -----------------------------------------------------------
CLUSTER = ClusterSpec(num_nodes=1, num_gpus_per_node=2)
TRAIN_ARGS = {"learning_rate": 1e-2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}


def ray_configs(model_dir):
    return {
        "actor_train": worker_config(model_dir, "actor_train", device_mapping=[0, 1], training_args=TRAIN_ARGS,
                                     infer_batch_size=4),
        "actor_infer": worker_config(model_dir, "actor_infer", device_mapping=[0, 1],
                                     strategy_args={"strategy_name": "vllm",
                                                    "strategy_config": {**SMALL_KV, "load_format": "dummy"}},
                                     generating_args={"max_new_tokens": 6, "num_return_sequences": 2, "seed": 0}),
    }  # fmt: skip


def scores(roles, role, batch):
    return roles[role].call("compute_log_probs", batch, dispatch="dp_split").batch["log_probs"]


@needs_vllm
def test_vllm_role_on_ray_generates_trains_syncs_and_generates(tiny_model_dir):
    """Two vllm workers share CPU slots with two fsdp2_train ranks: ROLL's first sync replaces the dummy weights,
    then generate -> score -> train -> sync -> generate, the scores of both roles agreeing at every step."""
    start_ray(num_cpus=2, resources=cpu_device_resources(CLUSTER))
    try:
        with Roles(CLUSTER, ray_configs(tiny_model_dir), rpc_timeout=300) as roles:
            updater = roles.model_updater(bucket_bytes=30_000)  # small buckets: decoder layers arrive split
            assert updater.names == "checkpoint"  # vLLM loads checkpoint names (they differ for MoE experts)
            roles.activate("actor_infer")
            updater.sync()
            prompts = prompt_batch(tiny_model_dir, [QUESTIONS[0], QUESTIONS[1]] * 2)  # rank 0 and 1 get the same
            rollout = roles["actor_infer"].call("generate", prompts, dispatch="dp_split")
            mask = rollout.batch["response_mask"]
            old = scores(roles, "actor_train", rollout)
            torch.testing.assert_close(old[mask], rollout.batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)
            assert not torch.equal(rollout.batch["responses"][:4], rollout.batch["responses"][4:])  # seeds by RANK

            rollout.batch["old_log_probs"] = old
            rollout.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
            roles.activate("actor_train")
            roles["actor_train"].call("train_step", rollout, ActorObjective(), dispatch="dp_split")
            roles.activate("actor_infer")
            assert updater.sync()["model_update/tensors"] == 26  # 27 HF names; the tied lm_head travels once

            new_train, new_infer = scores(roles, "actor_train", rollout), scores(roles, "actor_infer", rollout)
            torch.testing.assert_close(new_infer[mask], new_train[mask], atol=1e-5, rtol=0)
            assert float((new_train - old)[mask].abs().max()) > 1e-2  # the step changed the policy
            again = roles["actor_infer"].call("generate", prompts, dispatch="dp_split")
            again_mask = again.batch["response_mask"]
            torch.testing.assert_close(again.batch["rollout_log_probs"][again_mask],
                                       scores(roles, "actor_train", again)[again_mask], atol=1e-5, rtol=0)  # fmt: skip
    finally:
        stop_ray(remove_temp_dir=True)


@needs_vllm
def test_a_lora_actor_syncs_its_adapters_alone_into_vllm_on_ray(tiny_model_dir):
    """LoRA on both roles (ROLL's rlvr_lora_fsdp2.yaml layout): each sync moves the adapters alone (their bytes,
    not the model's; load_format dummy is overridden, the base comes from the checkpoint), and vLLM's scores
    follow the trained adapters."""
    pytest.importorskip("peft")
    configs = {role: replace(config, model_args=replace(config.model_args, **LORA))
               for role, config in ray_configs(tiny_model_dir).items()}  # fmt: skip
    start_ray(num_cpus=2, resources=cpu_device_resources(CLUSTER))
    try:
        with Roles(CLUSTER, configs, rpc_timeout=300) as roles:
            updater = roles.model_updater(bucket_bytes=8_000)
            assert updater.names == "adapters"
            roles.activate("actor_infer")
            first = updater.sync()
            prompts = prompt_batch(tiny_model_dir, [QUESTIONS[0], QUESTIONS[1]] * 2)
            rollout = roles["actor_infer"].call("generate", prompts, dispatch="dp_split")
            mask = rollout.batch["response_mask"]
            old = scores(roles, "actor_train", rollout)
            torch.testing.assert_close(old[mask], rollout.batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)
            rollout.batch["old_log_probs"] = old
            rollout.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
            roles.activate("actor_train")
            roles["actor_train"].call("train_step", rollout, ActorObjective(), dispatch="dp_split")
            adapters = sum(t.numel() * t.element_size() for t in random_adapter(tiny_model_dir, 0).values())
            roles.activate("actor_infer")
            synced = updater.sync()
            assert synced["model_update/bytes"] == first["model_update/bytes"] == adapters  # 2 layers x 3 modules
            assert synced["model_update/tensors"] == 12
            new_train, new_infer = scores(roles, "actor_train", rollout), scores(roles, "actor_infer", rollout)
            torch.testing.assert_close(new_infer[mask], new_train[mask], atol=1e-5, rtol=0)
            assert float((new_train - old)[mask].abs().max()) > 1e-3  # the step moved the adapters
    finally:
        stop_ray(remove_temp_dir=True)


def test_reloaded_expert_layers_are_repacked_for_the_cpu_kernel_and_unknown_ones_refused():
    """Without vLLM: the layers a reload's expert names touch (vLLM nests the kernel's module under the checkpoint's
    ``...mlp.experts``) get their kernel's after-load step again, the others not; expert names without such a layer
    are refused rather than served in checkpoint layout."""
    from types import SimpleNamespace

    from torch import nn

    from rl_engines.strategies.vllm_weights import repack_reloaded_experts

    class CPUUnquantizedExperts:  # the name vLLM's CPU grouped-GEMM experts carry
        def __init__(self):
            self.repacked = []

        def process_weights_after_loading(self, layer):
            self.repacked.append(layer)

    experts = CPUUnquantizedExperts()

    def moe_layer():
        layer = nn.Module()
        layer.w13_weight = nn.Parameter(torch.zeros(1))
        layer.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts))
        return layer

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    for block in model.layers:
        block.experts = nn.Module()
        block.experts.routed_experts = moe_layer()
    names = ["layers.1.experts.0.gate_proj.weight", "layers.1.experts.3.down_proj.weight", "layers.1.norm.weight"]
    assert repack_reloaded_experts(model, names) == 1 and experts.repacked == [model.layers[1].experts.routed_experts]
    assert repack_reloaded_experts(model, ["layers.0.norm.weight"]) == 0
    assert repack_reloaded_experts(model, ["layers.0.experts.gate_up_proj"]) == 1  # stacked experts' names too
    assert experts.repacked[-1] is model.layers[0].experts.routed_experts
    with pytest.raises(RuntimeError, match=r"expert weights of \['layers\.7\.experts'\] reloaded, but vLLM's CPU MoE"):
        repack_reloaded_experts(model, ["layers.7.experts.0.up_proj.weight"])
    assert repack_reloaded_experts(nn.Linear(2, 2), names) == 0  # no CPU expert kernel: nothing to redo

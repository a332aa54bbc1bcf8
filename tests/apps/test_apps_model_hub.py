"""Model hub ids as ROLL takes them (``pretrain: Qwen/Qwen2.5-7B-Instruct``, ``model_download_type``): downloaded
before pre-flight and replaced by the local folder. Nothing reaches a hub here: a Hugging Face cache is laid out in
a temporary folder and huggingface_hub runs offline (HF_HUB_OFFLINE), taking the cached snapshot as it would after a
download."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from apps.common.model_hub import is_hub_id, model_fields, resolve_config_models, resolve_hub_models
from apps.rlvr.config import RLVRConfig
from rl_engines.config import WorkerConfigError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An offline huggingface_hub whose cache holds ``tiny-org/tiny-qwen`` (the RLVR demo's model) at ``main``."""
    from huggingface_hub import constants

    from apps.rlvr.demo import ROOT
    from apps.rlvr.demo_model import demo_model

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-qwen"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(demo_model(ROOT / ".cache" / "rlvr_demo"), snapshot)  # the demo's, built once per checkout
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def _config(**top):
    return RLVRConfig.from_dict({"rewards": {"math": {"worker_cls": "math_rule"}}, **top})


def test_a_hub_id_is_downloaded_once_and_replaced_by_its_folder(offline_cache):
    config = _config(pretrain="tiny-org/tiny-qwen", model_download_type="HUGGINGFACE_HUB")
    config.actor_infer.model_args.model_name_or_path = "tiny-org/tiny-qwen"  # the same id twice: one download
    lines: list[str] = []
    resolve_hub_models(model_fields(config), config.model_download_type, lines.append)
    assert config.pretrain == str(offline_cache.resolve())
    assert config.actor_infer.model_args.model_name_or_path == config.pretrain
    assert lines == [f"[model] pretrain='tiny-org/tiny-qwen': HUGGINGFACE_HUB copy at {config.pretrain}"]


def test_the_pipeline_resolves_hub_ids_before_preflight_and_loads_the_tokenizer(offline_cache, tmp_path):
    """The RLVR pipeline (built, not started): the roles load the downloaded folder, the tokenizer is read from it."""
    from apps.common.yaml_config import load_config
    from apps.rlvr.demo import CONFIG, write_prompts
    from apps.rlvr.pipeline import RLVRPipeline

    data = write_prompts(tmp_path / "train.jsonl")
    overrides = ["pretrain=tiny-org/tiny-qwen", "+model_download_type=HUGGINGFACE_HUB",
                 f"actor_train.data_args.file_name={data}", f"output_dir={tmp_path / 'out'}"]  # fmt: skip
    pipeline = RLVRPipeline(RLVRConfig.from_dict(load_config(CONFIG, overrides)), log=lambda line: None)
    folder = str(offline_cache.resolve())
    for role in ("actor_train", "actor_infer"):
        assert getattr(pipeline.config, role).model_args.model_name_or_path == folder, role
    assert pipeline.tokenizer.name_or_path == folder


def test_download_failures_name_the_key_the_id_and_the_hub(offline_cache):
    config = _config(pretrain="tiny-org/not-cached", model_download_type="HUGGINGFACE_HUB")
    with pytest.raises(ValueError, match=r"pretrain='tiny-org/not-cached' is not a folder here, and downloading it "
                                         r"with model_download_type=HUGGINGFACE_HUB failed"):  # fmt: skip
        resolve_hub_models(model_fields(config), config.model_download_type)
    assert config.pretrain == "tiny-org/not-cached"


@pytest.mark.skipif(importlib.util.find_spec("modelscope") is not None, reason="modelscope is installed")
def test_unset_the_hub_is_modelscope_as_in_roll_and_its_package_is_named(monkeypatch):
    monkeypatch.delenv("MODEL_DOWNLOAD_TYPE", raising=False)
    config = _config(pretrain="Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(ValueError, match=r"model_download_type=MODELSCOPE \(ROLL's default when unset\) failed: the "
                                         r"modelscope package is not installed \(pip install modelscope\), or set "
                                         r"model_download_type: HUGGINGFACE_HUB"):  # fmt: skip
        resolve_hub_models(model_fields(config), config.model_download_type)


@pytest.mark.parametrize("where", ["system_envs", "environment"])
def test_rolls_model_download_type_variable_picks_the_hub_when_the_key_is_unset(offline_cache, monkeypatch, where):
    """ROLL's downloader reads MODEL_DOWNLOAD_TYPE (its key sets it; system_envs and the shell can too)."""
    monkeypatch.delenv("MODEL_DOWNLOAD_TYPE", raising=False)
    envs = {"system_envs": {"MODEL_DOWNLOAD_TYPE": "HUGGINGFACE_HUB"}} if where == "system_envs" else {}
    if where == "environment":
        monkeypatch.setenv("MODEL_DOWNLOAD_TYPE", "HUGGINGFACE_HUB")
    config = _config(pretrain="tiny-org/tiny-qwen", **envs)
    resolve_config_models(config, log=lambda line: None)
    assert config.pretrain == str(offline_cache.resolve())
    bad = _config(pretrain="tiny-org/tiny-qwen", system_envs={"MODEL_DOWNLOAD_TYPE": "HF"})
    with pytest.raises(ValueError, match=r"system_envs\.MODEL_DOWNLOAD_TYPE='HF' is not a model hub; use one of"):
        resolve_config_models(bad)


def test_an_unknown_hub_is_refused_naming_the_key():
    with pytest.raises(WorkerConfigError, match=r"model_download_type='HF' is not a model hub; use one of "
                                                r"\['HUGGINGFACE_HUB', 'MODELSCOPE'\]"):  # fmt: skip
        _config(model_download_type="HF")


def test_paths_are_not_hub_ids(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-7B-Instruct") and is_hub_id("tiny-org/tiny.qwen-0.5B")
    for path in ("./models/qwen", "/models/qwen", "models/qwen/v1", "~/qwen", "qwen"):
        assert not is_hub_id(path), path
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id(str(tmp_path / "org" / "name"))


def test_the_agentic_pipeline_resolves_hub_ids_too(offline_cache, tmp_path):
    from apps.agentic.config import AgenticConfig
    from apps.agentic.demo import CONFIG
    from apps.agentic.pipeline import AgenticPipeline
    from apps.common.yaml_config import load_config

    overrides = ["pretrain=tiny-org/tiny-qwen", "+model_download_type=HUGGINGFACE_HUB", f"output_dir={tmp_path}"]
    pipeline = AgenticPipeline(AgenticConfig.from_dict(load_config(CONFIG, overrides)), log=lambda line: None)
    assert pipeline.base.actor_train.model_args.model_name_or_path == str(offline_cache.resolve())

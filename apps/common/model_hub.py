"""Model hub ids where ROLL takes them: ``pretrain: Qwen/Qwen2.5-7B-Instruct`` (and ``reward_pretrain``, a role's
``model_args.model_name_or_path``) is downloaded before pre-flight and replaced by its local folder.

``model_download_type`` picks the hub by ROLL's names: ``HUGGINGFACE_HUB`` (huggingface_hub's ``snapshot_download``,
into its cache: ``HF_HOME`` / ``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` takes the cached copy without asking the hub) or
``MODELSCOPE`` (modelscope's ``snapshot_download``; needs the ``modelscope`` package). As in ROLL, where the key
sets the ``MODEL_DOWNLOAD_TYPE`` environment variable its downloader reads, the variable given in ``system_envs`` or
the environment counts when the key is unset; unset everywhere, ROLL downloads from ModelScope, and so does this.
A value that is not an ``org/name`` id (a path) is left to the usual "not a folder" error. The download runs once
per id on the driver's machine (tokenizer, pre-flight and workers then read the same folder): a cluster of several
machines needs that cache on a filesystem they share.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A hub repository id, ``<organisation>/<name>``."""
DEFAULT_SOURCE = "MODELSCOPE"
"""ROLL's hub when ``model_download_type`` is unset."""
SOURCE_VARIABLE = "MODEL_DOWNLOAD_TYPE"
"""The environment variable ROLL's downloader reads (its config's ``model_download_type`` sets it)."""


def _huggingface(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    return str(snapshot_download(repo_id))


def _modelscope(repo_id: str) -> str:
    try:
        from modelscope.hub.snapshot_download import snapshot_download
    except ImportError as err:
        raise ModuleNotFoundError(
            "the modelscope package is not installed (pip install modelscope), or set model_download_type: "
            "HUGGINGFACE_HUB to download from the Hugging Face Hub"
        ) from err
    return str(snapshot_download(repo_id))


SOURCES: dict[str, Callable[[str], str]] = {"HUGGINGFACE_HUB": _huggingface, "MODELSCOPE": _modelscope}
"""``model_download_type`` -> a function downloading a repository id into its cache and returning the folder."""


def check_source(value: str | None) -> None:
    """``model_download_type`` is one of ROLL's names (or unset)."""
    if value is not None and value not in SOURCES:
        raise ValueError(f"model_download_type={value!r} is not a model hub; use one of {sorted(SOURCES)}.")


def is_hub_id(value: str) -> bool:
    """``value`` names a hub repository, not a folder here (an existing path is a folder, whatever its shape)."""
    return HUB_ID.fullmatch(value) is not None and not Path(value).exists()


def model_fields(config: Any, extra: Iterable[tuple[str, Any]] = ()) -> list[tuple[str, Any, str]]:
    """The model keys of a pipeline config (apps.common.config.SharedConfig): ``pretrain``, ``reward_pretrain``,
    each role's ``model_args.model_name_or_path`` and ``extra`` (key prefix, worker config) sections."""
    from apps.common.config import ROLE_KEYS

    fields: list[tuple[str, Any, str]] = [(key, config, key) for key in ("pretrain", "reward_pretrain")]
    sections = [(role, getattr(config, role)) for role in ROLE_KEYS] + list(extra)
    fields += [(f"{name}.model_args.model_name_or_path", section.model_args, "model_name_or_path")
               for name, section in sections if section is not None]  # fmt: skip
    return fields


def download_source(config: Any) -> tuple[str | None, str]:
    """The hub a config downloads from and where that was said: ``model_download_type``, else
    ``system_envs.MODEL_DOWNLOAD_TYPE``, else the environment's ``MODEL_DOWNLOAD_TYPE`` (ROLL's order: its config
    sets the variable, ``system_envs`` go into the environment); (None, ...) when none is set."""
    if config.model_download_type is not None:
        return config.model_download_type, "model_download_type"
    if SOURCE_VARIABLE in config.system_envs:
        return config.system_envs[SOURCE_VARIABLE], f"system_envs.{SOURCE_VARIABLE}"
    if SOURCE_VARIABLE in os.environ:
        return os.environ[SOURCE_VARIABLE], f"the environment's {SOURCE_VARIABLE}"
    return None, "model_download_type"


def resolve_config_models(config: Any, log: Callable[[str], None] = print,
                          extra: Iterable[tuple[str, Any]] = ()) -> None:  # fmt: skip
    """Download the hub ids among a pipeline config's model keys (:func:`model_fields`) from its hub
    (:func:`download_source`) and put the folders in their place."""
    source, where = download_source(config)
    resolve_hub_models(model_fields(config, extra), source, log, where)


def resolve_hub_models(
    fields: Iterable[tuple[str, Any, str]], source: str | None, log: Callable[[str], None] = print,
    where: str = "model_download_type",
) -> None:  # fmt: skip
    """Replace every hub id among ``fields`` (config key, owning object, attribute) by its downloaded folder, each id
    fetched once; errors name the key, the id and the hub (``where``: the setting that named the hub)."""
    if source is not None and source not in SOURCES:
        raise ValueError(f"{where}={source!r} is not a model hub; use one of {sorted(SOURCES)}.")
    hub = source or DEFAULT_SOURCE
    folders: dict[str, str] = {}
    for key, owner, attribute in fields:
        value = getattr(owner, attribute)
        if not value or not is_hub_id(str(value)):
            continue
        if value not in folders:
            folders[value] = _download(str(value), hub, key, where if source is not None else None)
            log(f"[model] {key}={value!r}: {hub} copy at {folders[value]}")
        setattr(owner, attribute, folders[value])


def _download(repo_id: str, hub: str, key: str, where: str | None) -> str:
    how = f"{where}={hub}" if where else f"model_download_type={hub} (ROLL's default when unset)"
    try:
        folder = SOURCES[hub](repo_id)
    except Exception as err:  # the hub library's own errors: no network, unknown id, gated repository, ...
        raise ValueError(
            f"{key}={repo_id!r} is not a folder here, and downloading it with {how} failed: {err}. Give a local "
            "model folder, or fix the download (network, id, token; HF_HUB_OFFLINE=1 takes a cached copy)."
        ) from err
    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"{key}={repo_id!r}: the {hub} copy at {folder} has no config.json; is it a model?")
    return folder

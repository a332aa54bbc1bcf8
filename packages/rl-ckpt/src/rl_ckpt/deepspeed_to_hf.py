"""DeepSpeed ZeRO (stage 0-3) checkpoint -> HuggingFace folder, with the fp32 master weights.

A HF model trained under DeepSpeed keeps its HF parameter names, so the conversion is: reconstruct the full fp32
tensors (ZeRO 1-3: DeepSpeed's own ``zero_to_fp32``, from the optimizer's fp32 partitions; ZeRO-0: the saved
module), check names and shapes against the architecture of the model's config.json (a meta-device model built by
transformers), drop tied copies (``lm_head.weight`` when the embeddings are tied) and a ``module.`` prefix, and
stream the tensors into sharded safetensors. Needs ``deepspeed`` and ``transformers``: ``pip install
'rl-ckpt[deepspeed]'``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_ckpt.deepspeed_io import INSTALL_HINT, DeepSpeedCheckpoint, check_pickle, load_states, open_deepspeed_checkpoint
from rl_ckpt.disk_space import output_folder
from rl_ckpt.errors import CheckpointError
from rl_ckpt.hf_io import ShardedSafetensorsWriter, copy_tokenizer, parse_size, write_generation_config

_PREFIXES = ("module.", "_orig_mod.")
_MODEL_PATH_KEYS = ("model_name_or_path", "model_path", "pretrained_model_name_or_path")


def _require(module: str) -> Any:
    """``importlib.import_module(module)``, or a CheckpointError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CheckpointError(f"DeepSpeed -> HF conversion needs {module.split('.')[0]}: {INSTALL_HINT}") from None


@dataclass(frozen=True)
class HFTarget:
    """The HF model a checkpoint is converted into: its config and the tensors that architecture expects."""

    config_file: Path
    config: dict[str, Any]
    """config.json as a dict (written back with the dtype of the converted weights)."""
    shapes: dict[str, tuple[int, ...]]
    """Tensors to write, in the model's ``state_dict`` order: name -> shape."""
    aliases: dict[str, str]
    """Tied copies not written (HF re-ties them when loading): alias -> written name, e.g. lm_head -> embed."""


def find_hf_config(
    ckpt: DeepSpeedCheckpoint, hf_config_path: Path | str | None, tokenizer_path: Path | str | None
) -> Path:
    """config.json from ``--hf_config_path``, the checkpoint folder (HF Trainer), meta.json's model path, or
    ``--tokenizer_path``; raises saying which flag to pass when none has it."""
    if hf_config_path is not None:
        given = Path(hf_config_path)
        file = given / "config.json" if given.is_dir() else given
        if not file.is_file():
            raise CheckpointError(f"--hf_config_path {given}: no config.json there; pass the original HF model folder")
        return file
    candidates = [ckpt.root, ckpt.tag_dir.parent]
    meta = ckpt.meta or {}
    candidates += [Path(str(meta[key])) for key in _MODEL_PATH_KEYS if meta.get(key)]
    candidates += [Path(tokenizer_path)] if tokenizer_path is not None else []
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder / "config.json"
    raise CheckpointError(
        f"{ckpt.root} does not record the model's HF config; pass --hf_config_path with the HF model folder the "
        "training started from (its config.json and generation_config.json are used)"
    )


def hf_target(config_file: Path) -> HFTarget:
    """Expected tensor names / shapes and tied aliases of the model in ``config_file`` (a meta-device model)."""
    tf = _require("transformers")
    config = dict(json.loads(config_file.read_text(encoding="utf-8")))
    model_type = config.get("model_type")
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    if model_type not in tf.CONFIG_MAPPING:
        raise CheckpointError(
            f"unknown model_type {model_type!r} in {config_file}: transformers {tf.__version__} does not know it; "
            "pass the config.json of the model that was trained (--hf_config_path) or upgrade transformers"
        )
    try:
        hf_config = tf.AutoConfig.for_model(str(model_type), **kwargs)
    except Exception as err:  # transformers' config validators raise several unrelated types
        raise CheckpointError(f"{config_file} is not a valid {model_type} config: {err}") from None
    try:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(hf_config)
    except ValueError:
        raise CheckpointError(
            f"{config_file}: model_type {model_type!r} has no causal-LM class in transformers; only "
            "AutoModelForCausalLM models are converted"
        ) from None
    shapes: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        kept = first_name.setdefault(id(value), name)
        if kept == name:
            shapes[name] = tuple(value.shape)
        else:
            aliases[name] = kept
    return HFTarget(config_file, config, shapes, aliases)


def _strip_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """Drop a ``module.`` (DDP / engine wrapper) or ``_orig_mod.`` (torch.compile) prefix every name carries."""
    out = dict(state)
    for prefix in _PREFIXES:
        while out and all(name.startswith(prefix) for name in out):
            out = {name[len(prefix) :]: value for name, value in out.items()}
    return out


def fp32_state(ckpt: DeepSpeedCheckpoint) -> dict[str, Any]:
    """name -> full tensor (lazily gathered under ZeRO-3: ``.contiguous()`` materializes one), prefix removed.

    ZeRO 1-3: fp32 masters from the optimizer partitions via ``deepspeed.utils.zero_to_fp32``; ZeRO-0: the module as
    saved. Every rank file is vetted by :func:`~rl_ckpt.deepspeed_io.check_pickle` first.
    """
    zero_to_fp32 = _require("deepspeed.utils.zero_to_fp32")
    for file in ckpt.rank_files:
        check_pickle(file, ckpt.trust_checkpoint)
    if ckpt.zero_stage == 0:
        module = load_states(ckpt.rank_files[0], ckpt.trust_checkpoint).get("module")
        if not isinstance(module, Mapping):
            raise CheckpointError(f"{ckpt.rank_files[0]} has no 'module' state dict")
        return _strip_prefixes(module)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's progress lines; stdout stays rl-ckpt's
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                str(ckpt.tag_dir.parent), tag=ckpt.tag_dir.name, lazy_mode=True
            )
    except (ValueError, FileNotFoundError, KeyError, RuntimeError, NotImplementedError) as err:
        raise CheckpointError(f"DeepSpeed could not merge the ZeRO partitions in {ckpt.tag_dir}: {err}") from None
    return _strip_prefixes(state)


def _materialize(value: Any) -> torch.Tensor:
    """A standalone tensor: gathers a ZeRO-3 lazy tensor, copies a view into a merged ZeRO-1/2 flat buffer."""
    tensor: torch.Tensor = value.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # safetensors refuses tensors that share a storage
    return tensor


def _check_names(state: Mapping[str, Any], target: HFTarget, where: Path) -> None:
    """Raise naming the tensors the checkpoint lacks, has extra, or holds in another shape than config.json says."""
    known = set(target.shapes) | set(target.aliases)
    unexpected = sorted(set(state) - known)
    missing = sorted(n for n in target.shapes if n not in state and not _alias_of(n, state, target))
    hint = f"is {target.config_file} the config of the model that was trained? (--hf_config_path)"
    if unexpected or missing:
        raise CheckpointError(
            f"{where} does not match {target.config.get('model_type')} from {target.config_file}: missing "
            f"{missing[:5] or 'none'}, unexpected {unexpected[:5] or 'none'}; {hint}"
        )
    for name, shape in target.shapes.items():
        got = tuple(state[name].shape) if name in state else None
        if got is not None and got != shape:
            raise CheckpointError(f"tensor {name} in {where} has shape {got} but {target.config_file} implies {shape}")


def _alias_of(name: str, state: Mapping[str, Any], target: HFTarget) -> str | None:
    """A tied alias of ``name`` that the checkpoint holds instead of ``name`` itself."""
    return next((alias for alias, kept in target.aliases.items() if kept == name and alias in state), None)


def _check_tied(state: Mapping[str, Any], target: HFTarget, where: Path) -> None:
    """A tied copy in the checkpoint must equal the written tensor (else the config's tying is wrong)."""
    for alias, kept in target.aliases.items():
        if alias not in state or kept not in state or state[alias] is state[kept]:
            continue
        if not torch.equal(_materialize(state[alias]), _materialize(state[kept])):
            raise CheckpointError(
                f"{target.config_file} ties {alias} to {kept}, but {where} holds different values for them: the "
                "model was trained untied; pass a config.json with tie_word_embeddings=false (--hf_config_path)"
            )


def checked_state(ckpt: DeepSpeedCheckpoint, target: HFTarget) -> dict[str, Any]:
    """:func:`fp32_state`, after checking its names, shapes and tied copies against ``target``."""
    state = fp32_state(ckpt)
    _check_names(state, target, ckpt.tag_dir)
    _check_tied(state, target, ckpt.tag_dir)
    return state


def iter_deepspeed_hf_tensors(
    ckpt: DeepSpeedCheckpoint, target: HFTarget, state: Mapping[str, Any] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) in the model's order, one materialized tensor at a time.

    ``state``: what :func:`checked_state` returned (read here when not given).
    """
    state = checked_state(ckpt, target) if state is None else state
    for name in target.shapes:
        source = name if name in state else _alias_of(name, state, target)
        yield name, _materialize(state[str(source)])


@dataclass(frozen=True)
class DeepSpeedConversion:
    """What :func:`convert_deepspeed_to_hf` read and wrote."""

    checkpoint: DeepSpeedCheckpoint
    target: HFTarget
    weight_map: dict[str, str]
    """The index's tensor name -> shard file."""


def _written_config(config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """config.json with the dtype of the written weights (``dtype`` in transformers >= 5, else ``torch_dtype``)."""
    out = dict(config)
    name = str(dtype).removeprefix("torch.")
    for key in [k for k in ("dtype", "torch_dtype") if k in out] or ["torch_dtype"]:
        out[key] = name
    return out


def convert_deepspeed_to_hf(
    checkpoint_path: Path | str,
    out_path: Path | str,
    *,
    hf_config_path: Path | str | None = None,
    tokenizer_path: Path | str | None = None,
    max_shard_size: str | int = "5GB",
    trust_checkpoint: bool = False,
    tag: str | None = None,
) -> DeepSpeedConversion:
    """Write a HF folder: sharded safetensors + index, config.json, generation_config.json, tokenizer files.

    Peak memory: the reconstruction's (ZeRO-3: one gathered tensor at a time; ZeRO-1/2: DeepSpeed merges each
    parameter group's flat fp32 partitions) plus one output shard.
    """
    _require("deepspeed.utils.zero_to_fp32")  # fail on a missing extra before anything else
    ckpt = open_deepspeed_checkpoint(checkpoint_path, tag=tag, trust_checkpoint=trust_checkpoint)
    if (ckpt.meta or {}).get("adapters_only"):
        raise CheckpointError(
            f"{ckpt.root} holds LoRA adapters only (meta.json: adapters_only), not a model: use the run's exported "
            "actor_hf/ folder (merged), or merge its actor_hf/adapter/ into the base model with `rl-ckpt merge-lora "
            "--base_model_path BASE --adapter_path .../actor_hf/adapter --output_path OUT`"
        )
    target = hf_target(find_hf_config(ckpt, hf_config_path, tokenizer_path))
    state = checked_state(ckpt, target)  # every check passes before the output folder is created
    out = Path(out_path)
    with output_folder(out):  # a failed conversion leaves no partial output
        writer = ShardedSafetensorsWriter(out, parse_size(max_shard_size))
        dtype = torch.float32
        for name, tensor in iter_deepspeed_hf_tensors(ckpt, target, state):
            dtype = tensor.dtype if tensor.is_floating_point() else dtype
            writer.add(name, tensor)
            del tensor
        weight_map = writer.close()
        text = json.dumps(_written_config(target.config, dtype), indent=2) + "\n"
        (out / "config.json").write_text(text, encoding="utf-8")
        generation_file = target.config_file.parent / "generation_config.json"
        generation = json.loads(generation_file.read_text(encoding="utf-8")) if generation_file.is_file() else None
        tok = Path(tokenizer_path) if tokenizer_path is not None else None
        write_generation_config(out, generation, tok)
        if tok is not None:
            copy_tokenizer(tok, out)
    return DeepSpeedConversion(ckpt, target, weight_map)


def verify_deepspeed_to_hf(conversion: DeepSpeedConversion, hf_path: Path | str) -> float:
    """max |logits| difference: a HF model built from the reconstructed fp32 tensors vs the written folder."""
    from rl_ckpt.verify import logits_max_abs_diff, model_from_folder, model_from_tensors

    target = conversion.target
    tensors = dict(iter_deepspeed_hf_tensors(conversion.checkpoint, target))
    source = model_from_tensors(target.config, tensors)
    return logits_max_abs_diff(source, model_from_folder(Path(hf_path)), int(source.config.vocab_size))

"""fsdp2_train's ``wrap_policy`` (ROLL's keys): which modules FSDP2 shards as units of their own."""

from __future__ import annotations

from typing import Any

from rl_engines.strategies.base import reject_unknown_keys

WRAP_POLICY_KEYS: dict[str, tuple[type, ...]] = {
    "transformer_layer_cls_to_wrap": (list, str),
    "wrap_embeddings": (bool,),
    "wrap_lm_output": (bool,),
    "moe_experts": (list, str),
}
"""ROLL's ``wrap_policy`` keys: the layer classes sharded as units, the embeddings / output head as units of their
own, and expert classes (ROLL wraps those apart only with its expert patch or ``ep_size`` > 1: without ``ep_size``
the experts are sharded with their layer, as in ROLL; with it the stacked experts are units on the expert mesh,
:mod:`rl_engines.strategies.fsdp2_experts`)."""


def check_options(options: dict[str, Any], keys: dict[str, tuple[type, ...]], prefix: str) -> None:
    """Unknown keys and values of the wrong type are refused naming ``<prefix>.<key>``."""
    reject_unknown_keys(options, set(keys), prefix)
    for key, value in options.items():
        types = keys[key]
        if value is not None and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            wanted = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{prefix}.{key} must be {wanted}, got {type(value).__name__} {value!r}.")


def class_names(value: str | list[str] | None) -> list[str]:
    """A class-name option as a list (ROLL takes one name as a string too)."""
    return [value] if isinstance(value, str) else list(value or [])


def wrap_units(model: Any, wrap: dict[str, Any], prefix: str) -> list[Any]:
    """Units sharded on their own, in order: the input embeddings (``wrap_embeddings``), wrap_policy's layer
    classes (else the model's ``_no_split_modules``), the output head (``wrap_lm_output``). Tied embeddings share
    one parameter, so either flag makes the embeddings and the head one unit."""
    names = set(class_names(wrap.get("transformer_layer_cls_to_wrap")) or getattr(model, "_no_split_modules", None)
                or [])  # fmt: skip
    found: list[Any] = [m for m in model.modules() if type(m).__name__ in names]
    if wrap.get("transformer_layer_cls_to_wrap") and not found:
        native = sorted(getattr(model, "_no_split_modules", None) or [])
        raise ValueError(
            f"{prefix}.wrap_policy.transformer_layer_cls_to_wrap names "
            f"{sorted(names)}, but {type(model).__name__} has no such modules; its layer classes are {native}."
        )
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is embed.weight:
        return [[embed, head], *found] if wrap.get("wrap_embeddings") or wrap.get("wrap_lm_output") else found
    first = [embed] if wrap.get("wrap_embeddings") else []
    return first + found + ([head] if wrap.get("wrap_lm_output") and head is not None else [])

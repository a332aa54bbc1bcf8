"""The HF weight names and shapes an inference engine expects, for checking weight syncs into engines.

External engines (vLLM, SGLang) keep weights fused and repacked under their own names, and their loaders either
fail far from the cause or silently skip what they do not know. The adapters therefore check every incoming
``(name, tensor)`` against the HF checkpoint layout first, with the same errors as ``hf_infer``: an unknown name
is a ``KeyError`` naming the weight, a shape mismatch a ``ValueError`` naming both shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rl_engines.strategies.model_io import in_checkpoint_names


@dataclass(frozen=True)
class WeightTable:
    """HF state-dict names -> shapes of one model, and which names share one tensor (tied embeddings)."""

    architecture: str
    """HF class name, for error messages (``Qwen2ForCausalLM``)."""
    shapes: dict[str, tuple[int, ...]]
    """Every HF state-dict name -> its shape; tied names appear under each of their names."""
    tied: dict[str, tuple[str, ...]]
    """Name -> the other names of the same tensor (``lm_head.weight`` <-> ``model.embed_tokens.weight``)."""

    @classmethod
    def from_model_dir(cls, path: str) -> WeightTable:
        """Read ``config.json`` at ``path`` and build the model on the meta device (no memory, no weights read);
        names as the folder stores them (a MoE layer's experts one by one, not transformers' fused tensors)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        state = dict(in_checkpoint_names(model, iter(model.state_dict(keep_vars=True).items())))
        return cls.from_state_dict(type(model).__name__, state)

    @classmethod
    def from_state_dict(cls, architecture: str, state: dict[str, torch.Tensor]) -> WeightTable:
        """Table of a (meta or real) state dict; names bound to one tensor object are tied."""
        names_of: dict[int, list[str]] = {}
        for name, tensor in state.items():
            names_of.setdefault(id(tensor), []).append(name)
        tied = {
            name: tuple(other for other in names if other != name)
            for names in names_of.values()
            if len(names) > 1
            for name in names
        }
        shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
        return cls(architecture, shapes, tied)

    def check(self, name: str, tensor: torch.Tensor, role: str) -> None:
        """Raise ``KeyError`` for a name the model lacks, ``ValueError`` for a wrong shape (both name the weight)."""
        if name not in self.shapes:
            raise KeyError(
                f"{role}: weight {name!r} from the train strategy has no counterpart in the inference model "
                f"({self.architecture}); are actor_train and {role} the same architecture?"
            )
        expected = self.shapes[name]
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{role}: weight {name!r} has shape {tuple(tensor.shape)} in the train strategy but {expected} "
                "here; the two roles must load the same model."
            )

    def with_aliases(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` and the same tensor under every name tied to it (engines repack each separately)."""
        yield name, tensor
        for alias in self.tied.get(name, ()):
            yield alias, tensor


def checkpoint_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF checkpoint at ``path`` under its own names (tied weights under each name), loaded on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    yield from in_checkpoint_names(model, iter(model.state_dict().items()))

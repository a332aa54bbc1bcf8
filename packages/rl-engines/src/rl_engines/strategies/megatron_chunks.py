"""A stage's model chunks under Megatron's virtual pipeline, seen as one module.

With ``virtual_pipeline_model_parallel_size`` v > 1 a pipeline stage builds v ``GPTModel`` chunks (Megatron's
``vp_stage`` 0..v-1), each with its own block of decoder layers; the first chunk of the first stage holds the
embedding, the last chunk of the last stage the final norm and output layer. :class:`ModelChunks` registers those
parts under the names one ``GPTModel`` holding all of the stage's layers would give them (``embedding.*``,
``decoder.layers.<n>`` numbered on from chunk to chunk, ``decoder.final_layernorm.*``, ``output_layer.*``), so
weight mapping, optimizer, checkpoints and LoRA see one stage as without chunks; the chunks themselves run the
forward passes (:attr:`ModelChunks.chunks`). No parameter is held twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn


class ModelChunks(nn.Module):
    """``chunks`` (a stage's GPTModels in virtual-stage order) under one stage's parameter names."""

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        super().__init__()
        self._chunks = tuple(chunks)  # a tuple is not registered: each parameter has the one name below
        first, last = chunks[0], chunks[-1]
        if getattr(first, "pre_process", False):
            self.embedding = first.embedding
        if getattr(first, "vision_model", None) is not None:  # a VL model's vision tower (megatron_vision)
            self.vision_model = first.vision_model
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(layer for chunk in chunks for layer in chunk.decoder.layers)  # type: ignore[union-attr]
        if getattr(last, "post_process", False):
            self.decoder.final_layernorm = last.decoder.final_layernorm  # type: ignore[union-attr]
            self.output_layer = last.output_layer

    @property
    def chunks(self) -> tuple[nn.Module, ...]:
        """The GPTModel chunks, chunk 0 first."""
        return self._chunks

    def train(self, mode: bool = True) -> ModelChunks:
        """Train / eval mode on the chunks too (their own flags, e.g. the decoder's recompute switch)."""
        for chunk in self._chunks:
            chunk.train(mode)
        return super().train(mode)

    def _apply(self, fn: Any, recurse: bool = True) -> ModelChunks:
        """``to`` / ``float`` / ... through the chunks, so their own tensors (RoPE's) move with the parameters."""
        for chunk in self._chunks:
            chunk._apply(fn, recurse)  # type: ignore[no-untyped-call]
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ModelChunks runs chunk by chunk: call model.chunks[c] (MegatronModel.run does)")

"""Megatron-core dist_checkpointing (``--ckpt-format torch_dist``) folders, read without megatron, one layer at a time.

Layout (``dist_checkpointing.save`` of Megatron-LM's state dict)::

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000010/metadata.json         {"sharded_backend": "torch_dist", ...}
    <root>/iter_0000010/common.pt             the non-sharded entries: args, iteration, checkpoint_version, ...
    <root>/iter_0000010/.metadata             torch.distributed.checkpoint metadata (see ``dcp_reader``)
    <root>/iter_0000010/__<rank>_<n>.distcp   the chunks

Tensors are global, whatever TP x PP (or virtual pipeline) saved them, under megatron's sharded keys: the decoder
layers of all stages are stacked on a leading layer dimension (``decoder.layers.self_attention.linear_qkv.weight``
[L, g*(r+2)*d, H]), the layer norms carry the Transformer-Engine fused names
(``decoder.layers.self_attention.linear_qkv.layer_norm_weight``, ``decoder.layers.mlp.linear_fc1.layer_norm_weight``)
even with the local spec, ``linear_fc1`` is [L, 2F, H] with all gate rows before all up rows (megatron's swiglu
sharded factory), the vocabulary is padded, and a tied output layer is saved once, as the embedding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rl_ckpt.dcp_reader import DcpFolder
from rl_ckpt.errors import CheckpointError
from rl_ckpt.mcore_io import local_norm_name
from rl_ckpt.mcore_merge import EMBEDDING, FINAL_NORM, OUTPUT, StageShards, check_moe_layout, checkpoint_spec
from rl_ckpt.safe_load import load_torch_file
from rl_ckpt.spec import ModelSpec, arg

COMMON_FILE = "common.pt"
LAYERS_PREFIX = "decoder.layers."
EXPERTS = "mlp.experts.experts."
"""SequentialMLP's experts in a torch_dist checkpoint: one global tensor per weight, [layers, experts, ...]."""
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
"""Keys of GPTModel's tensors; the rest (``optimizer.*`` of a training run, ...) is not the model and is ignored."""


@dataclass(frozen=True)
class DistCheckpoint:
    """An opened torch_dist checkpoint: its tensors (read on demand), args, and the model it holds."""

    folder: DcpFolder
    args: object
    spec: ModelSpec

    @property
    def iteration_dir(self) -> Path:
        """The ``iter_NNNNNNN`` folder."""
        return self.folder.path

    def layer_keys(self) -> list[str]:
        """The stacked per-layer tensors (leading dimension = layer)."""
        return sorted(k for k in self.folder.tensors if k.startswith(LAYERS_PREFIX))

    def num_layers(self) -> int:
        """Length of the stacked layer dimension (the same for every per-layer tensor)."""
        lengths = {self.folder.entry(k).shape[0] for k in self.layer_keys()}
        if len(lengths) != 1:
            raise CheckpointError(f"{self.iteration_dir}: stacked layer tensors disagree on the layer count {lengths}")
        return lengths.pop()

    def _piece(self, keys: dict[str, tuple[str, tuple[int, ...] | None]], label: str, **where: bool) -> StageShards:
        """A one-"rank" piece: {local key: (checkpoint key, the entry of its leading dimensions read, or all)}."""
        state = {local: self.folder.view(key, index) for local, (key, index) in keys.items()}
        return StageShards([state], [self.iteration_dir / label if label else self.iteration_dir], **where)

    def _layer_keys(self, layer: int) -> dict[str, tuple[str, tuple[int, ...] | None]]:
        """Layer ``layer``'s tensors under local names (layer 0); a MoE layer's stacked experts
        (``mlp.experts.experts.linear_fc1.weight [L, E, 2I, H]``) one per expert, as SequentialMLP names them."""
        out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
        for key in self.layer_keys():
            local = local_norm_name(key[len(LAYERS_PREFIX) :])
            if local.startswith(EXPERTS) and self.spec.moe:
                fc = local.removeprefix(EXPERTS)
                for expert in range(self.spec.num_experts):
                    out[f"decoder.layers.0.mlp.experts.local_experts.{expert}.{fc}"] = (key, (layer, expert))
            else:
                out[f"decoder.layers.0.{local}"] = (key, (layer,))
        return out

    def tail_keys(self) -> list[str]:
        """The last piece's tensors: the final norm, and the output layer unless tied."""
        return [FINAL_NORM] + ([OUTPUT] if OUTPUT in self.folder.tensors else [])

    def check_known(self) -> None:
        """Raise naming model tensors outside embedding, layers and tail (e.g. MTP layers, position embeddings)."""
        model = {k for k in self.folder.tensors if k.startswith(MODEL_PREFIXES)}
        extra = model - set(self.layer_keys()) - {EMBEDDING, *self.tail_keys()}
        if extra:
            raise CheckpointError(f"{self.iteration_dir} holds tensors rl-ckpt does not convert: {sorted(extra)}")

    def stages(self) -> Iterator[StageShards]:
        """The embedding, then one layer at a time (its stacked tensors at that index), then the tail: views of
        the chunks on disk, read when written (see ``DcpFolder.view``)."""
        yield self._piece({EMBEDDING: (EMBEDDING, None)}, "", first=True)
        for layer in range(self.num_layers()):
            yield self._piece(self._layer_keys(layer), f"layer {layer}")
        yield self._piece({k: (k, None) for k in self.tail_keys()}, "", last=True)


def read_common(iteration_dir: Path, trust_checkpoint: bool) -> dict[str, object]:
    """``common.pt``: Megatron's non-sharded entries (``args``, ``iteration``, ...), unpickled safely."""
    path = iteration_dir / COMMON_FILE
    if not path.is_file():
        raise CheckpointError(f"{iteration_dir} has no {COMMON_FILE}: the dist checkpoint is incomplete")
    common = load_torch_file(path, trust=trust_checkpoint, mmap=False)
    if not isinstance(common, dict):
        raise CheckpointError(f"{path} holds a {type(common).__name__}, not megatron's common state dict")
    return common


def open_dist_checkpoint(
    iteration_dir: Path,
    *,
    vocab_size: int | None = None,
    model_type: str | None = None,
    tokenizer_path: Path | str | None = None,
    trust_checkpoint: bool = False,
) -> DistCheckpoint:
    """Read the metadata and ``args`` of a torch_dist iteration folder and detect the model (as for rank files)."""
    folder = DcpFolder(iteration_dir)
    args = read_common(iteration_dir, trust_checkpoint).get("args")
    if args is None:
        raise CheckpointError(
            f"{iteration_dir / COMMON_FILE} has no 'args' (was it saved by dist_checkpointing.save of the model "
            "alone?); rl-ckpt needs Megatron's args for the head counts"
        )
    spec = checkpoint_spec(args, vocab_size=vocab_size, model_type=model_type, tokenizer_path=tokenizer_path)
    check_moe_layout(spec, int(arg(args, "tensor_model_parallel_size", 1) or 1), 1, str(iteration_dir))
    ckpt = DistCheckpoint(folder, args, spec)
    ckpt.check_known()
    if ckpt.num_layers() != spec.num_layers:
        raise CheckpointError(
            f"{iteration_dir}: the stacked layer tensors hold {ckpt.num_layers()} layers but the args say "
            f"num_layers={spec.num_layers}; the checkpoint is inconsistent"
        )
    return ckpt

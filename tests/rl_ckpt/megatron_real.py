"""Real megatron-core checkpoints for the rl_ckpt tests, written the way Megatron-LM's training loop writes them.

Two gloo processes (``torch.multiprocessing.spawn``) build a megatron-core ``GPTModel`` (local layer spec, CPU; a MoE
model's experts split over the two ranks under expert parallelism) for each :class:`Case`, load it from the
per-rank files rl-ckpt wrote for a tiny HF model, run a forward pass, and save:

- ``legacy/``: Megatron-LM's ``--ckpt-format torch`` layout: ``latest_checkpointed_iteration.txt`` ("10", no
  newline) and ``iter_0000010/mp_rank_XX[_YYY]/model_optim_rng.pt`` = ``generate_state_dict``'s dict: ``args`` (an
  ``argparse.Namespace`` with Megatron-LM's names: no vocabulary size, no HF model type, enums, dtypes),
  ``checkpoint_version`` 3.0, ``iteration``, ``model`` (``state_dict_for_save_checkpoint()``), ``optimizer``,
  ``opt_param_scheduler``, ``rng_state`` (python / numpy / torch RNG states) and
  ``num_floating_point_operations_so_far``; written by DP rank 0.
- ``dist/``: ``--ckpt-format torch_dist``: ``dist_checkpointing.save`` of the same dict with the model's
  ``sharded_state_dict()`` and the RNG state as a ``ShardedObject`` (common.pt + .metadata + __R_0.distcp files).
- ``megatron_logits.pt``: the Megatron model's logits [1, S, V] on :data:`INPUT_IDS` (TP shards gathered, PP stages
  chained with send / recv).

The test-harness shims of ENGINES-ON-CPU.md (``tests/rl_engines/megatron_shims.py``) make megatron-core run on CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

ITERATION = 10
INPUT_IDS = [[1, 5, 17, 42, 99, 200, 249, 3, 64, 128, 7, 0]]
WORLD = 2
SHIMS = Path(__file__).resolve().parent.parent / "rl_engines" / "megatron_shims.py"


@dataclass(frozen=True)
class Case:
    """One real checkpoint: the HF folder it starts from and the parallel layout megatron-core saves it with."""

    name: str
    hf_dir: Path
    tp: int
    pp: int
    hf_dir_in_args: bool = True
    ep: int = 1
    """Expert-parallel size (a MoE model: its experts split over the ranks, which are its data-parallel ranks)."""
    formats: tuple[str, ...] = ("torch", "torch_dist")
    """The formats megatron saves this case in."""
    vp: int = 1
    """Model chunks per pipeline stage (Megatron-LM's virtual_pipeline_model_parallel_size; 1: none)."""
    grouped: bool = False
    """A MoE case also saved with megatron-core's legacy grouped-GEMM experts (``legacy_grouped/``,
    ``dist_grouped/``)."""
    """Whether the args' ``tokenizer_model`` names ``hf_dir`` (else a folder of the training cluster, absent here)."""

    def root(self, out: Path) -> Path:
        """Folder of this case's outputs (``rl_ckpt``, ``legacy``, ``dist``, ``megatron_logits.pt``)."""
        return out / self.name


def _apply_shims() -> None:
    spec = importlib.util.spec_from_file_location("megatron_shims", SHIMS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.apply()


def megatron_lm_args(
    spec: Any, tp: int, pp: int, padded_vocab: int, ckpt_format: str, tokenizer_model: str, ep: int = 1, vp: int = 1,
    grouped: bool = False,
) -> Any:  # fmt: skip
    """The ``args`` Megatron-LM's ``parse_args`` + ``validate_args`` store (the fields a converter may read, plus a
    few typical non-primitive ones: an enum, torch dtypes). Megatron-LM records neither the unpadded vocabulary
    size (``vocab_size`` is None without ``--vocab-size``) nor the HF model type."""
    from megatron.core.transformer.enums import AttnBackend

    moe = dict(num_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
               moe_router_topk=spec.moe_topk, moe_router_pre_softmax=not spec.moe_norm_topk_prob,
               moe_shared_expert_intermediate_size=spec.moe_shared_expert_ffn_hidden_size or None,
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.001, moe_grouped_gemm=grouped,
               moe_use_legacy_grouped_gemm=grouped,
               moe_token_dispatcher_type="allgather") if spec.moe else {"num_experts": None}  # fmt: skip
    return argparse.Namespace(
        **moe,
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, kv_channels=spec.head_dim,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, max_position_embeddings=spec.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(spec.rotary_base), rotary_percent=1.0,
        normalization="RMSNorm", norm_epsilon=spec.norm_epsilon, swiglu=True,
        untie_embeddings_and_output_weights=not spec.tied_embeddings, add_qkv_bias=spec.qkv_bias,
        add_bias_linear=False, qk_layernorm=spec.qk_norm, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        expert_model_parallel_size=ep,
        make_vocab_size_divisible_by=128, padded_vocab_size=padded_vocab, vocab_size=None,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_model, ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format != "torch", transformer_impl="local", attention_backend=AttnBackend.auto,
        params_dtype=torch.float32, bf16=False, fp16=False, seed=1234, iteration=ITERATION, save=None,
    )  # fmt: skip


def _transformer_config(spec: Any, tp: int, pp: int, ep: int = 1, vp: int = 1, grouped: bool = False) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    moe = dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
               moe_router_topk=spec.moe_topk, moe_router_pre_softmax=not spec.moe_norm_topk_prob,
               moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
               moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=grouped, expert_model_parallel_size=ep,
               moe_shared_expert_intermediate_size=spec.moe_shared_expert_ffn_hidden_size or None,
               moe_shared_expert_gate=spec.moe_shared_expert_ffn_hidden_size > 0) if spec.moe else {}  # fmt: skip
    return TransformerConfig(
        **moe,
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_epsilon, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True,
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )  # fmt: skip


def build_gpt(
    spec: Any, tp: int, pp: int, padded_vocab: int, ep: int = 1, vp: int = 1, chunk: int = 0, grouped: bool = False
) -> Any:
    """This rank's GPTModel stage, or its model chunk ``chunk`` of ``vp`` (megatron-core, local spec, fp32, CPU).

    One more CPU shim, for construction only: with tied embeddings and PP > 1, ``setup_embeddings_and_output_layer``
    moves the shared weight to ``.cuda()`` before all-reducing it between the first and last stage.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    real_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        experts = {"num_experts": spec.num_experts, "moe_grouped_gemm": grouped,
                   "moe_use_legacy_grouped_gemm": grouped} if spec.moe else {}  # fmt: skip
        vp_stage = chunk if vp > 1 else None
        return GPTModel(
            _transformer_config(spec, tp, pp, ep, vp, grouped),
            get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm, **experts),
            vocab_size=padded_vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=spec.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rotary_base),
            vp_stage=vp_stage,
        )
    finally:
        torch.Tensor.cuda = real_cuda  # type: ignore[method-assign]


def load_rl_ckpt_rank(model: Any, rank_file: Path, chunk: int | None = None) -> None:
    """Load rl-ckpt's rank file (its ``model<chunk>`` with a virtual pipeline) strictly: the keys must be
    megatron-core's own, apart from ``_extra_state``."""
    from rl_ckpt.mcore_io import load_rank

    _, state = load_rank(rank_file, chunk=chunk)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, f"rl-ckpt wrote keys megatron-core does not have: {unexpected}"
    assert all(k.endswith("_extra_state") for k in missing), f"rl-ckpt lacks megatron-core keys: {missing}"


def megatron_logits(chunks: list[Any], spec: Any, vocab: int) -> torch.Tensor | None:
    """Logits [1, S, V] on the last stage's TP rank 0 (None elsewhere): TP shards all-gathered, PP by send / recv
    (with a virtual pipeline through every chunk in turn: chunk c of the last stage feeds chunk c + 1 of the first)."""
    from megatron.core import parallel_state as ps

    ids = torch.tensor(INPUT_IDS)
    seq = ids.shape[1]
    positions = torch.arange(seq).unsqueeze(0)
    mask = ~torch.ones(seq, seq, dtype=torch.bool).tril().view(1, 1, seq, seq)  # True = masked
    first, last = ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_pipeline_last_stage(ignore_virtual=True)
    for index, model in enumerate(chunks):
        if not (first and index == 0):
            hidden = torch.empty(seq, 1, spec.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        with torch.no_grad():
            out = model.eval()(ids, positions, mask)
        if not (last and index == len(chunks) - 1):
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    if not last:
        return None
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :vocab] if ps.get_tensor_model_parallel_rank() == 0 else None


def rng_state() -> dict[str, Any]:
    """Megatron-LM's ``get_rng_state`` entry (the CUDA state replaced by the CPU one)."""
    from megatron.core import tensor_parallel

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),  # noqa: NPY002 (what Megatron-LM saves)
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def optimizer_state(model: Any) -> dict[str, Any]:
    """An Adam state after one step, as megatron's FP32Optimizer.state_dict() returns it."""
    params = [p for p in model.parameters() if p.requires_grad]
    adam = torch.optim.Adam(params, lr=1e-6)
    for p in params:
        p.grad = torch.zeros_like(p)
    adam.step()  # zero gradients: the weights stay bitwise as loaded
    return adam.state_dict()


def save_legacy(root: Path, chunks: list[Any], args: Any) -> None:
    """``save_checkpoint`` with ``--ckpt-format torch``: one file per (TP, PP[, EP]) rank, written by the rank's
    first data-parallel replica (Megatron-LM: expert-data-parallel rank 0; ``_<EP rank>`` appended under EP)."""
    from megatron.core import parallel_state as ps

    ep = args.expert_model_parallel_size
    if (ps.get_expert_data_parallel_rank() if ep > 1 else ps.get_data_parallel_rank()) == 0:
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        name = (
            f"mp_rank_{tp_rank:02d}"
            if args.pipeline_model_parallel_size == 1
            else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        )
        name += f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""
        path = root / f"iter_{ITERATION:07d}" / name / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        models = {"model": chunks[0].state_dict_for_save_checkpoint()} if len(chunks) == 1 else {
            f"model{c}": chunk.state_dict_for_save_checkpoint() for c, chunk in enumerate(chunks)}  # fmt: skip
        state = {
            "args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
            **models, "optimizer": optimizer_state(chunks[0]),
            "opt_param_scheduler": {"max_lr": 1e-6, "num_steps": ITERATION, "decay_style": "cosine"},
            "rng_state": [rng_state()], "num_floating_point_operations_so_far": 0,
        }  # fmt: skip
        torch.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def save_dist(root: Path, chunks: list[Any], args: Any) -> None:
    """``save_checkpoint`` with ``--ckpt-format torch_dist``: ``dist_checkpointing.save`` of the whole state dict."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    iter_dir = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    where = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    rng = ShardedObject("rng_state", [rng_state()], (pp, tp), where, replica_id=ps.get_data_parallel_rank())
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": chunks[0].sharded_state_dict(),
             "rng_state": rng, "num_floating_point_operations_so_far": 0}  # fmt: skip
    dist_checkpointing.save(state, str(iter_dir))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def run_case(case: Case, out: Path) -> None:
    """Build, load, run and save one case in this rank (collective over the WORLD processes)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from rl_ckpt.hf_io import HFCheckpoint
    from rl_ckpt.layout import padded_vocab_size
    from rl_ckpt.mcore_io import rank_dir_name
    from rl_ckpt.spec import spec_from_hf_config

    ps.initialize_model_parallel(tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
                                 virtual_pipeline_model_parallel_size=case.vp if case.vp > 1 else None,
                                 expert_model_parallel_size=case.ep)  # fmt: skip
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = spec_from_hf_config(HFCheckpoint(case.hf_dir).config)
    padded = padded_vocab_size(spec.vocab_size, 128, case.tp)
    chunks = [build_gpt(spec, case.tp, case.pp, padded, case.ep, case.vp, c) for c in range(case.vp)]
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = rank_dir_name(tp_rank, pp_rank, case.pp, ps.get_expert_model_parallel_rank(), case.ep)
    for c, chunk in enumerate(chunks):
        rank_file = case.root(out) / "rl_ckpt" / f"iter_{1:07d}" / rank_dir / "model_optim_rng.pt"
        load_rl_ckpt_rank(chunk, rank_file, c if case.vp > 1 else None)
    logits = megatron_logits(chunks, spec, spec.vocab_size)
    if logits is not None and ps.get_data_parallel_rank() == 0:
        torch.save(logits, case.root(out) / "megatron_logits.pt")
    tokenizer_model = str(case.hf_dir) if case.hf_dir_in_args else "/cluster/models/tiny"
    for fmt, save in (("torch", save_legacy), ("torch_dist", save_dist)):
        if fmt not in case.formats:
            continue
        args = megatron_lm_args(spec, case.tp, case.pp, padded, fmt, tokenizer_model, case.ep, case.vp)
        save(case.root(out) / ("legacy" if fmt == "torch" else "dist"), chunks, args)
    dist.barrier()
    if case.grouped:
        save_grouped(case, out, spec, padded, tokenizer_model)
    ps.destroy_model_parallel()


def save_grouped(case: Case, out: Path, spec: Any, padded: int, tokenizer_model: str) -> None:
    """The case's weights in megatron-core's legacy grouped-GEMM experts (GroupedMLP: each rank's experts in two
    matrices), loaded from its torch_dist save (megatron-core maps GroupedMLP's experts onto SequentialMLP's global
    tensors), then saved in both formats to ``legacy_grouped/`` and ``dist_grouped/``. One more shim, for
    construction only: GroupedMLP asserts the grouped_gemm package, which only its forward (not run here) uses."""
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    model = build_gpt(spec, case.tp, case.pp, padded, case.ep, grouped=True)
    saved = case.root(out) / "dist" / f"iter_{ITERATION:07d}"
    with torch.serialization.safe_globals([argparse.Namespace, AttnBackend]):  # the args in common.pt
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(saved))
    model.load_state_dict(loaded["model"])
    for fmt, save in (("torch", save_legacy), ("torch_dist", save_dist)):
        args = megatron_lm_args(spec, case.tp, case.pp, padded, fmt, tokenizer_model, case.ep, grouped=True)
        save(case.root(out) / ("legacy_grouped" if fmt == "torch" else "dist_grouped"), [model], args)
    dist.barrier()


def _worker(rank: int, port: int, cases: list[Case], out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _apply_shims()
        for case in cases:
            run_case(case, out)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_real_checkpoints(cases: list[Case], out: Path) -> None:
    """rl-ckpt's HF -> Megatron files for every case (what megatron-core loads), then the two spawned ranks."""
    import torch.multiprocessing as mp

    from rl_ckpt import convert_hf_to_mcore

    for case in cases:
        convert_hf_to_mcore(case.hf_dir, case.root(out) / "rl_ckpt", case.tp, case.pp, ep=case.ep, vp=case.vp)
    mp.spawn(_worker, args=(free_port(), cases, out), nprocs=WORLD, join=True)

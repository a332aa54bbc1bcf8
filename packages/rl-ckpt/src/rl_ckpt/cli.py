"""`rl-ckpt convert`: Megatron-core <-> HuggingFace checkpoints (ROLL-compatible flag names); `rl-ckpt merge-lora`:
a LoRA adapter merged into its HuggingFace base model."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rl_ckpt.__about__ import __version__
from rl_ckpt.deepspeed_io import is_deepspeed_checkpoint
from rl_ckpt.deepspeed_to_hf import convert_deepspeed_to_hf, verify_deepspeed_to_hf
from rl_ckpt.errors import CheckpointError
from rl_ckpt.hf_to_mcore import convert_hf_to_mcore
from rl_ckpt.mcore_to_hf import convert_mcore_to_hf, open_mcore_checkpoint

EXIT_OK, EXIT_VERIFY_FAILED, EXIT_ERROR = 0, 1, 2

EPILOG = """\
examples:
  rl-ckpt convert --checkpoint_path ./output/checkpoint-100/actor_train --output_path ./hf_model
      Megatron (per-rank files at any TP x PP, or torch_dist; detected) -> HuggingFace
  rl-ckpt convert --checkpoint_path Qwen2.5-0.5B --output_path ./mcore --tp 2 --pp 2 --verify
      HuggingFace -> Megatron at TP=2 x PP=2, then prove it by comparing logits
  rl-ckpt convert --checkpoint_path ./ckpt/actor_train --output_path ./hf_model --hf_config_path Qwen2.5-0.5B
      DeepSpeed ZeRO 0-3 (detected from its rank files) -> HuggingFace, fp32 master weights
  rl-ckpt merge-lora --base_model_path Qwen2.5-7B --adapter_path ./output/checkpoint-100/actor_hf/adapter \
      --output_path ./merged
      a LoRA adapter (PEFT's folder: adapter_config.json + adapter_model.safetensors) merged into its base model

exit status: 0 = converted (and verified), 1 = --verify found a logits difference over --verify_atol,
2 = bad arguments or an unreadable / inconsistent checkpoint (the message names the file and the fix).
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `rl-ckpt`."""
    parser = argparse.ArgumentParser(
        prog="rl-ckpt", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__
    )
    parser.add_argument("--version", action="version", version=f"rl-ckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("convert", help="convert a checkpoint", epilog=EPILOG, formatter_class=parser.formatter_class)
    p.add_argument("--checkpoint_path", required=True, type=Path, help="input: Megatron, DeepSpeed or HF folder")
    p.add_argument("--output_path", required=True, type=Path, help="output folder (created)")
    p.add_argument(
        "--direction",
        choices=["mcore2hf", "hf2mcore", "ds2hf"],
        help="default: ds2hf for a DeepSpeed checkpoint, hf2mcore if input has config.json, else mcore2hf",
    )
    p.add_argument("--hf_config_path", type=Path, help="ds2hf: HF model folder (or config.json) that was trained")
    p.add_argument("--tp", type=int, default=1, help="hf2mcore: tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="hf2mcore: pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="hf2mcore: expert-parallel size (MoE models)")
    p.add_argument("--vp", type=int, default=1, help="hf2mcore: virtual pipeline chunks per stage (model0, ...)")
    p.add_argument("--make_vocab_size_divisible_by", type=int, default=128, help="hf2mcore: megatron's padding")
    p.add_argument("--tokenizer_path", type=Path, help="mcore2hf, ds2hf: copy the tokenizer files from here")
    p.add_argument("--vocab_size", type=int, help="mcore2hf: unpadded vocabulary size when the args lack it")
    p.add_argument("--model_type", help="mcore2hf: HF model_type (qwen2, qwen3, llama, mistral) when args lack it")
    p.add_argument("--max_shard_size", default="5GB", help="HF output: safetensors shard size, e.g. 5GB, 500MB")
    p.add_argument("--trust_checkpoint", action="store_true", help="unpickle rank files holding arbitrary objects")
    p.add_argument("--verify", action="store_true", help="compare logits of source and result (needs transformers)")
    p.add_argument("--verify_atol", type=float, default=1e-5, help="largest logits difference --verify accepts")
    m = sub.add_parser("merge-lora", help="merge a LoRA adapter into its HF base model", epilog=EPILOG,
                       formatter_class=parser.formatter_class)  # fmt: skip
    m.add_argument("--base_model_path", required=True, type=Path, help="the HF model folder the adapter was trained on")
    m.add_argument("--adapter_path", required=True, type=Path,
                   help="PEFT LoRA adapter folder, or a megatron_train LoRA checkpoint folder")  # fmt: skip
    m.add_argument("--output_path", required=True, type=Path, help="output folder (created)")
    m.add_argument("--max_shard_size", default="5GB", help="safetensors shard size, e.g. 5GB, 500MB")
    return parser


def _convert(ns: argparse.Namespace) -> int:
    src, out = ns.checkpoint_path, ns.output_path
    if not src.exists():
        raise CheckpointError(f"--checkpoint_path {src} does not exist")
    direction = ns.direction or ("hf2mcore" if (src / "config.json").is_file() else "mcore2hf")
    if ns.direction is None and is_deepspeed_checkpoint(src):
        direction = "ds2hf"  # tested first: HF Trainer's checkpoint-N holds config.json next to the ZeRO files
    if direction == "ds2hf":
        return _convert_deepspeed(ns)
    if direction == "hf2mcore":
        layout = convert_hf_to_mcore(
            src, out, ns.tp, ns.pp, ep=ns.ep, vp=ns.vp, make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by
        )
        sizes = f"TP={layout.tp} x PP={layout.pp}" + (f" x EP={layout.ep}" if layout.ep > 1 else "")
        sizes += f" (virtual pipeline: {ns.vp} chunks per stage)" if ns.vp > 1 else ""
        print(f"[rl-ckpt] wrote Megatron checkpoint {sizes} to {layout.iteration_dir}")
        ckpt = open_mcore_checkpoint(out)
    else:
        ckpt = open_mcore_checkpoint(
            src, vocab_size=ns.vocab_size, model_type=ns.model_type, tokenizer_path=ns.tokenizer_path,
            trust_checkpoint=ns.trust_checkpoint,
        )  # fmt: skip
        weight_map = convert_mcore_to_hf(ckpt, out, tokenizer_path=ns.tokenizer_path, max_shard_size=ns.max_shard_size)
        files = len(set(weight_map.values()))
        print(f"[rl-ckpt] wrote {ckpt.spec.model_type} HF model ({len(weight_map)} tensors, {files} shards) to {out}")
    if not ns.verify:
        return EXIT_OK
    from rl_ckpt.verify import verify_hf_to_mcore, verify_mcore_to_hf

    diff = verify_hf_to_mcore(src, ckpt) if direction == "hf2mcore" else verify_mcore_to_hf(ckpt, out)
    ok = diff <= ns.verify_atol
    verdict = "OK" if ok else "FAILED"
    print(f"[rl-ckpt] verify: max abs logits difference {diff:.3e} (tolerance {ns.verify_atol:g}): {verdict}")
    return EXIT_OK if ok else EXIT_VERIFY_FAILED


def _convert_deepspeed(ns: argparse.Namespace) -> int:
    """DeepSpeed ZeRO checkpoint -> HF folder (fp32 masters), then ``--verify`` against the reconstructed tensors."""
    done = convert_deepspeed_to_hf(
        ns.checkpoint_path, ns.output_path, hf_config_path=ns.hf_config_path, tokenizer_path=ns.tokenizer_path,
        max_shard_size=ns.max_shard_size, trust_checkpoint=ns.trust_checkpoint,
    )  # fmt: skip
    ckpt, files = done.checkpoint, len(set(done.weight_map.values()))
    source = f"DeepSpeed ZeRO-{ckpt.zero_stage} x {ckpt.dp_world_size} ranks"
    wrote = f"{done.target.config.get('model_type')} HF model ({len(done.weight_map)} tensors, {files} shards)"
    print(f"[rl-ckpt] wrote {wrote} from {source} to {ns.output_path}")
    if not ns.verify:
        return EXIT_OK
    diff = verify_deepspeed_to_hf(done, ns.output_path)
    ok = diff <= ns.verify_atol
    print(f"[rl-ckpt] verify: max abs logits difference {diff:.3e} (tolerance {ns.verify_atol:g}): "
          f"{'OK' if ok else 'FAILED'}")  # fmt: skip
    return EXIT_OK if ok else EXIT_VERIFY_FAILED


def _merge_lora(ns: argparse.Namespace) -> int:
    from rl_ckpt.lora_merge import merge_lora

    weight_map = merge_lora(ns.base_model_path, ns.adapter_path, ns.output_path, max_shard_size=ns.max_shard_size)
    print(f"[rl-ckpt] wrote {ns.base_model_path} with {ns.adapter_path} merged ({len(weight_map)} tensors) to "
          f"{ns.output_path}")  # fmt: skip
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `rl-ckpt`; returns the exit status."""
    ns = build_parser().parse_args(argv)
    try:
        return _merge_lora(ns) if ns.command == "merge-lora" else _convert(ns)
    except CheckpointError as err:
        print(f"rl-ckpt: error: {err}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())

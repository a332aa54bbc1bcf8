"""The streamed writers write the very bytes of the writers they replace, and file-backed sources read right.

References, each independent of the code under test: ``torch.save`` of the tensors built as rl-ckpt built them
before streaming (copies cut from the HF tensors, fused with ``torch.cat``), the former safetensors writer
(header + each tensor's bytes, written here in a few lines), and plain tensor indexing of tensors in memory.
"""

import errno
import json
import os
import struct

import pytest
import torch
from ckpt_models import load_state

from rl_ckpt import convert_hf_to_mcore, convert_mcore_to_hf, iter_hf_tensors, open_mcore_checkpoint
from rl_ckpt.hf_io import HFCheckpoint, safetensors_header, write_safetensors
from rl_ckpt.layout import fuse_qkv, padded_vocab_size
from rl_ckpt.sources import Concat, materialize, on_disk
from rl_ckpt.spec import spec_from_hf_config
from rl_ckpt.staged_file import StagedFile, StagingBuffers
from rl_ckpt.stream_io import FileReader, Prefetcher
from rl_ckpt.torch_zip import locate_storages, save_streamed

TINY = StagingBuffers(count=3, size=8192)  # many buffer boundaries: patches and rows cut across them


def old_rank_model(hf, spec, tp, rank, layers, first, last, padded):
    """A rank's model state dict built as rl-ckpt did before streaming: compact copies, ``torch.cat`` fusions."""
    h, g = spec.hidden_size, spec.num_query_groups

    def block(name, dim):
        return torch.chunk(hf[name], tp, dim=dim)[rank].clone()

    def vocab(name):
        out = torch.zeros((padded // tp, h), dtype=hf[name].dtype)
        rows = hf[name][rank * (padded // tp) : (rank + 1) * (padded // tp)]
        out[: rows.shape[0]] = rows
        return out

    state = {"embedding.word_embeddings.weight": vocab("model.embed_tokens.weight")} if first else {}
    for local, layer in enumerate(layers):
        p, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for kind in ("weight", "bias"):
            q, k, v = (block(f"{p}self_attn.{n}_proj.{kind}", 0) for n in "qkv")
            state[f"{m}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, g // tp)
        state[f"{m}self_attention.linear_proj.weight"] = block(f"{p}self_attn.o_proj.weight", 1)
        gate, up = block(f"{p}mlp.gate_proj.weight", 0), block(f"{p}mlp.up_proj.weight", 0)
        state[f"{m}mlp.linear_fc1.weight"] = torch.cat([gate, up])
        state[f"{m}mlp.linear_fc2.weight"] = block(f"{p}mlp.down_proj.weight", 1)
        state[f"{m}input_layernorm.weight"] = hf[f"{p}input_layernorm.weight"].clone()
        state[f"{m}pre_mlp_layernorm.weight"] = hf[f"{p}post_attention_layernorm.weight"].clone()
    if last:
        state["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        state["output_layer.weight"] = vocab("lm_head.weight")
    return state


def test_ckpt_rank_files_are_the_bytes_torch_save_wrote(tiny_hf, tmp_path):
    src = tiny_hf("qwen2", False)
    convert_hf_to_mcore(src, tmp_path / "mc", tp=2, pp=2)
    hf, spec = load_state(src), spec_from_hf_config(HFCheckpoint(src).config)
    padded = padded_vocab_size(spec.vocab_size, 128, 2)
    for stage, layers in ((0, [0, 1]), (1, [2, 3])):
        for rank in range(2):
            name = f"mp_rank_{rank:02d}_{stage:03d}"
            ours = tmp_path / "mc" / "iter_0000001" / name / "model_optim_rng.pt"
            state = torch.load(ours, weights_only=True)
            state["model"] = old_rank_model(hf, spec, 2, rank, layers, stage == 0, stage == 1, padded)
            ref = tmp_path / "ref" / name / "model_optim_rng.pt"  # the same file name: torch names records after it
            ref.parent.mkdir(parents=True)
            torch.save(state, ref)
            assert ours.read_bytes() == ref.read_bytes(), name


def old_write_safetensors(path, tensors):
    """The former writer: 8-byte length, JSON header (padded to 8 bytes), then each tensor's bytes."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16"}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ckpt_hf_shards_are_the_bytes_of_the_former_writer(tiny_hf, tmp_path, dtype):
    src = tiny_hf("qwen2", True)
    if dtype != torch.float32:
        from ckpt_models import save_tiny_model

        src = save_tiny_model(tmp_path / "src", "qwen2", tied=True, dtype=dtype)
    convert_hf_to_mcore(src, tmp_path / "mc", tp=2, pp=2)
    ckpt = open_mcore_checkpoint(tmp_path / "mc")
    weight_map = convert_mcore_to_hf(ckpt, tmp_path / "hf", max_shard_size="60KB")
    expected = dict(iter_hf_tensors(ckpt))
    for shard in sorted(set(weight_map.values())):
        header, _ = safetensors_header(tmp_path / "hf" / shard)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        assert all(weight_map[k] == shard for k in names)
        old_write_safetensors(tmp_path / "ref.safetensors", {k: expected[k] for k in names})
        assert (tmp_path / "hf" / shard).read_bytes() == (tmp_path / "ref.safetensors").read_bytes(), shard
    assert sorted(expected) == sorted(weight_map) == sorted(load_state(src))


@pytest.fixture
def on_disk_tensors(tmp_path):
    """Tensors saved by safetensors, and the same tensors opened as file-backed meta tensors."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {
        "m": torch.randn(37, 50).to(torch.bfloat16),
        "v": torch.randn(101),
        "s": torch.tensor(2.5),
        "c": torch.randn(4, 6, 10),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    header, start = safetensors_header(path)
    lazy = {}
    for name, t in tensors.items():
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        lazy[name] = on_disk(meta, path, start + header[name]["data_offsets"][0])
    return tensors, lazy


VIEWS = {
    "whole": lambda t: t["m"],
    "rows": lambda t: t["m"][5:30],
    "columns": lambda t: t["m"][:, 7:31],
    "one column": lambda t: t["m"][:, 3:4],
    "transposed": lambda t: t["m"].t(),
    "strided vector": lambda t: t["v"][3::4],
    "scalar": lambda t: t["s"],
    "3-d slice": lambda t: t["c"][1:3, :, 2:9],
    "concat rows": lambda t: Concat([t["m"][30:], t["m"][:4], t["m"][10:11]], 0),
    "concat columns": lambda t: Concat([t["m"][:, 40:], t["m"][:, :5]], 1),
    "concat dim 2": lambda t: Concat([t["c"][:, :, 8:], t["c"][:, :, :3]], 2),
    "concat of concats": lambda t: Concat([Concat([t["m"][:, :3], t["m"][:, 9:12]], 1), t["m"][:, 20:26]], 0),
}


def reference(view):
    return torch.cat([reference(p) for p in view.parts], view.dim) if isinstance(view, Concat) else view


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_ckpt_file_backed_views_read_as_in_memory(on_disk_tensors, name):
    tensors, lazy = on_disk_tensors
    got, want = materialize(VIEWS[name](lazy)), reference(VIEWS[name](tensors))
    assert got.device.type == "cpu" and got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("direct", [True, False])
def test_ckpt_streamed_safetensors_equal_across_buffers(on_disk_tensors, tmp_path, direct):
    tensors, lazy = on_disk_tensors
    picks = {name: VIEWS[name] for name in ("rows", "columns", "concat columns", "scalar", "3-d slice")}
    with FileReader() as reader:
        write_safetensors(
            tmp_path / "a.safetensors",
            {k: v(lazy) for k, v in picks.items()},
            {"format": "pt"},
            buffers=TINY,
            reader=reader,
            direct=direct,
        )
    old_write_safetensors(tmp_path / "b.safetensors", {k: reference(v(tensors)) for k, v in picks.items()})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.parametrize("chunks", [1, 2], ids=["model", "model0_model1"])
@pytest.mark.parametrize("direct", [True, False])
def test_ckpt_save_streamed_equals_torch_save(on_disk_tensors, tmp_path, direct, chunks):
    """The bytes torch.save writes, for one model entry and for a virtual pipeline's chunks (model0, model1)."""
    _, lazy = on_disk_tensors
    model = {
        "cols": VIEWS["columns"](lazy),
        "empty": torch.empty(0, 3),
        "scalar": lazy["s"],
        "fused": VIEWS["concat rows"](lazy),
        "ints": torch.arange(11),
    }
    models = {"model": model} if chunks == 1 else {"model0": model, "model1": {"rows": VIEWS["concat rows"](lazy)}}
    state = {"args": {"num_layers": 2, "name": "x"}, "checkpoint_version": 3.0, "iteration": 7}
    (tmp_path / "ours").mkdir()
    (tmp_path / "ref").mkdir()
    with FileReader() as reader:
        save_streamed(tmp_path / "ours" / "m.pt", state, models, buffers=TINY, reader=reader, direct=direct)
    whole = {key: {k: materialize(v).clone() for k, v in entry.items()} for key, entry in models.items()}
    torch.save({**state, **whole}, tmp_path / "ref" / "m.pt")
    assert (tmp_path / "ours" / "m.pt").read_bytes() == (tmp_path / "ref" / "m.pt").read_bytes()


def test_ckpt_locate_storages_checks_offsets(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"a": torch.arange(5.0), "b": torch.ones(3)}, path)
    state = torch.load(path, map_location="meta", weights_only=True)
    with path.open("rb") as f:
        assert locate_storages(state.values(), path, 0, f)
    assert torch.equal(materialize(state["a"]), torch.arange(5.0))
    state = torch.load(path, map_location="meta", weights_only=True)
    state["b"].untyped_storage()._checkpoint_offset += 4  # no record starts there: refused, nothing marked
    with path.open("rb") as f:
        assert not locate_storages(state.values(), path, 0, f)


def test_ckpt_staged_file_falls_back_when_o_direct_is_refused(tmp_path, monkeypatch):
    real_open, real_write = os.open, os.write
    refused = {"open": 0, "write": 0}

    def no_direct_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0) and refused["open"] == 0:
            refused["open"] += 1
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct_open)
    data = os.urandom(20000)
    with StagedFile(tmp_path / "a", TINY) as f:
        f.write(data)
        assert not f.direct
    assert (tmp_path / "a").read_bytes() == data

    def no_direct_write(fd, view):  # accepted at open, refused on the first write
        if refused["write"] == 0:
            refused["write"] += 1
            raise OSError(errno.EINVAL, "unaligned")
        return real_write(fd, view)

    monkeypatch.setattr(os, "write", no_direct_write)
    with StagedFile(tmp_path / "b", TINY) as f:
        f.write(data)
    assert (tmp_path / "b").read_bytes() == data and refused == {"open": 1, "write": 1}


def test_ckpt_prefetcher_keeps_a_window_ahead():
    asked = []

    class Reader:
        def prefetch(self, sources):
            asked.append([s.shape[0] for s in sources])

    sizes = [4, 1, 2, 8, 1, 1]  # MB each (float32 rows of 1 MB / 4 bytes)
    sources = [torch.empty((n, 2**18), device="meta") for n in sizes]
    prefetch = Prefetcher(Reader(), sources, window=5 * 2**20)
    for i in range(len(sources)):
        prefetch.before(i)
    # before 0: 4, then 1 (5 MB ahead); before 1: 1 MB ahead, so 2 and 8; before 2 and 3: 10 and 8 MB ahead, none;
    # before 4: 0 MB ahead, the last two
    assert asked == [[4, 1], [2, 8], [1, 1]]


def test_ckpt_planned_splits_equal_the_eager_ones():
    from rl_ckpt.layout import fc1_parts, fuse_qkv_parts, qkv_parts, split_fc1, split_qkv

    torch.manual_seed(1)
    groups, d, r, h = 2, 4, 3, 8
    fused = torch.randn(groups * (r + 2) * d, h)
    shards = list(torch.chunk(fused, 2))  # TP=2: one group per shard
    for got, want in zip(qkv_parts(Concat(shards, 0), groups, d), split_qkv(fused, groups, d)):
        assert torch.equal(materialize(got), want)
    q, k, v = split_qkv(fused, groups, d)
    assert torch.equal(materialize(fuse_qkv_parts(q, k, v, groups)), fused)
    fc1 = [torch.randn(6, h), torch.randn(6, h)]
    for got, want in zip(fc1_parts(fc1), split_fc1(fc1)):
        assert torch.equal(materialize(got), want)

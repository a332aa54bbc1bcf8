"""Weight-sync building blocks without Ray: bucketing, tied weights, byte round trips, shared-memory slots, and
the broadcast group between two real processes."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from rl_engines.weight_sync import (
    SHM_DIR,
    BroadcastGroup,
    SharedStaging,
    SharedStagingReader,
    TensorMeta,
    _pack_into_slot,
    expand_aliases,
    iter_buckets,
    pack_for_store,
    receive_by_broadcast,
    send_by_broadcast,
    shared_memory_available,
    unpack_from_store,
)


def weights() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(50, 8, generator=gen)
    return [
        ("model.embed_tokens.weight", embed),
        ("lm_head.weight", embed),  # tied: same storage, yielded right after
        ("model.norm.weight", torch.randn(8, generator=gen).bfloat16()),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(300, 8, generator=gen)),  # larger than a bucket
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
    ]


def loaded(buckets) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in buckets for name, tensor in expand_aliases(bucket)}


def test_buckets_respect_the_size_limit_and_send_tied_weights_once():
    buckets = list(iter_buckets(weights(), bucket_bytes=2000))
    sizes = [sum(meta.nbytes for meta, _ in bucket) for bucket in buckets]
    assert all(size <= 2000 or len(bucket) == 1 for size, bucket in zip(sizes, buckets))
    assert any(size > 2000 for size in sizes)  # the 9.6 kB tensor travels alone
    metas = [meta for bucket in buckets for meta, _ in bucket]
    assert [m.name for m in metas].count("lm_head.weight") == 0
    assert metas[0].aliases == ("lm_head.weight",)
    assert sum(size for size in sizes) == 50 * 8 * 4 + 8 * 2 + 300 * 8 * 4 + 8 + 3


def test_object_store_payload_round_trips_every_dtype_exactly():
    expected = dict(weights())
    got = loaded(unpack_from_store(pack_for_store(b)) for b in iter_buckets(weights(), bucket_bytes=1 << 20))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_dtype_casts_only_floating_tensors():
    metas = {m.name: m for b in iter_buckets(weights(), 1 << 20, dtype=torch.bfloat16) for m, _ in b}
    assert metas["model.embed_tokens.weight"].dtype == "torch.bfloat16"
    assert metas["step"].dtype == "torch.int64" and metas["mask"].dtype == "torch.bool"


@pytest.mark.skipif(not shared_memory_available(), reason="needs POSIX shared memory (/dev/shm)")
def test_shared_memory_slots_round_trip_grow_and_unlink():
    staging = SharedStaging(slot_bytes=2000)
    reader = SharedStagingReader()
    expected = dict(weights())
    got = {}
    names = set()
    for index, bucket in enumerate(iter_buckets(weights(), bucket_bytes=2000)):
        name = _pack_into_slot(staging, index % len(staging), bucket)
        names.add(name)
        got.update(loaded([reader.read(name, [meta for meta, _ in bucket])]))
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert len(names) == 2  # slot 0 twice; slot 1 re-created larger (under a new name) for the 9.6 kB tensor
    assert max(len(reader.view(name)) for name in names) >= 9600
    staging.close()
    assert not any((SHM_DIR / name).exists() for name in names)


def _receiver(port: int, queue: multiprocessing.Queue) -> None:
    group = BroadcastGroup("127.0.0.1", port, rank=1, world_size=2, timeout_s=60, backend="gloo")
    received = {
        name: tensor.clone() for bucket in receive_by_broadcast(group) for name, tensor in expand_aliases(bucket)
    }
    queue.put({name: (str(t.dtype), t.tolist()) for name, t in received.items()})


def test_broadcast_group_delivers_every_bucket_to_another_process():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_receiver, args=(port, queue))
    child.start()
    try:
        group = BroadcastGroup("127.0.0.1", port, rank=0, world_size=2, timeout_s=60, backend="gloo")
        stats = send_by_broadcast(weights(), group, bucket_bytes=2000)
        received = queue.get(timeout=60)
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    assert stats.tensors == 5 and stats.buckets == 3  # the tied lm_head travels inside the embedding's entry
    for name, tensor in weights():
        dtype, values = received[name]
        assert dtype == str(tensor.dtype) and values == tensor.tolist(), name


def test_tensor_meta_counts_bytes():
    assert TensorMeta("w", (3, 4), "torch.bfloat16").nbytes == 24
    assert TensorMeta("s", (), "torch.int64").nbytes == 8

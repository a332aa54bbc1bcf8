import numpy as np
import pytest
import torch

from rl_core.batch import BatchSizeError, DataProto, RolloutBatch


def make(n=4):
    return RolloutBatch.from_dict(
        {"input_ids": torch.arange(n * 3).view(n, 3), "scores": torch.arange(n, dtype=torch.float32)},
        {"prompt": [f"p{i}" for i in range(n)], "info": [{"i": i} for i in range(n)]},
        {"step": 7},
    )


def test_alias_and_len():
    assert DataProto is RolloutBatch
    assert len(make()) == 4
    assert len(RolloutBatch()) == 0


def test_mismatched_batch_dimension_named():
    with pytest.raises(ValueError, match="non_tensor_batch\\['prompt'\\]=2"):
        RolloutBatch.from_dict({"x": torch.zeros(3, 1)}, {"prompt": ["a", "b"]})


def test_select_slice_index_reorder():
    b = make()
    assert set(b.select(["scores"], []).batch) == {"scores"}
    assert b.slice(1, 3)["scores"].tolist() == [1.0, 2.0]
    r = b.reorder([3, 2, 1, 0])
    assert r["scores"].tolist() == [3.0, 2.0, 1.0, 0.0]
    assert list(r["prompt"]) == ["p3", "p2", "p1", "p0"]
    assert r.meta_info == {"step": 7}
    picked = b.index(torch.tensor([True, False, True, False]))
    assert list(picked["prompt"]) == ["p0", "p2"]
    with pytest.raises(ValueError, match="permutation"):
        b.reorder([0, 0, 1, 2])
    with pytest.raises(KeyError, match="scores"):
        b.select(["score"])


def test_chunk_concat_round_trip():
    b = make(6)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    back = RolloutBatch.concat(parts)
    assert torch.equal(back["input_ids"], b["input_ids"])
    assert list(back["info"]) == list(b["info"])


def test_chunk_too_small_explains_fix():
    with pytest.raises(BatchSizeError, match=r"batch_size 4 < chunks 8.*rollout_batch_size"):
        make(4).chunk(8)
    with pytest.raises(BatchSizeError, match="not divisible"):
        make(5).chunk(2)


def test_split_into_micro_batches():
    assert [len(p) for p in make(5).split(2)] == [2, 2, 1]


def test_repeat_interleave_and_tile():
    b = make(2)
    assert b.repeat(2)["scores"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert b.repeat(2, interleave=False)["scores"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert list(b.repeat(3)["prompt"]) == ["p0"] * 3 + ["p1"] * 3


def test_union_and_conflict():
    b = make()
    extra = RolloutBatch.from_dict({"adv": torch.ones(4)})
    assert set(b.union(extra).batch) == {"input_ids", "scores", "adv"}
    clash = RolloutBatch.from_dict({"scores": torch.zeros(4)})
    with pytest.raises(ValueError, match="scores"):
        b.union(clash)


def test_to_device_keeps_non_tensors():
    moved = make().to("cpu")
    assert isinstance(moved["prompt"], np.ndarray)
    assert moved["input_ids"].device.type == "cpu"


def test_concat_key_mismatch():
    with pytest.raises(ValueError, match="part 1"):
        RolloutBatch.concat([make(2), make(2).select(["scores"])])


def test_pickle_round_trip_keeps_dtypes_values_and_is_out_of_band():
    import pickle

    batch = RolloutBatch(
        {
            "logp": torch.randn(4, 3),
            "half": torch.randn(4, 3).bfloat16(),
            "ids": torch.arange(12).view(3, 4).t(),  # non-contiguous
            "mask": torch.tensor([[True, False]] * 4),
        },
        {"tag": ["a", "b", "c", "d"]},
        {"step": 3},
    )
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 4  # every tensor's bytes travel outside the pickle stream
    read_only = [memoryview(bytes(b.raw())) for b in buffers]  # like Ray's shared-memory object store
    restored = pickle.loads(payload, buffers=read_only)
    for key, value in batch.batch.items():
        assert restored.batch[key].dtype == value.dtype
        assert torch.equal(restored.batch[key], value)
    restored.batch["logp"].add_(1.0)  # writable: read-only buffers were copied, not aliased
    assert list(restored.non_tensor_batch["tag"]) == ["a", "b", "c", "d"]
    assert restored.meta_info == {"step": 3}

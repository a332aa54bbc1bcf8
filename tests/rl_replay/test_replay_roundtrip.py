"""Exact round trip: dtype, shape and bits of every array / tensor, equal non-tensor values, same types."""

import math
import pathlib
import sys

import numpy as np
import pytest
import torch
from replay_fakes import FakeDataProto, FakeTensorDict, PositionalOnlyBatch
from safetensors import safe_open
from safetensors.numpy import load_file as st_numpy_load
from safetensors.torch import load_file as st_torch_load

from rl_replay import (
    DumpFormatError,
    GenericBatch,
    GenericTensorDict,
    RolloutReplay,
    UnsupportedValueError,
    batch_size_of,
)


def round_trip(tmp_path: pathlib.Path, batch, **load_kwargs):
    RolloutReplay(tmp_path / "d", "dump", durable=False).dump(0, batch)
    return RolloutReplay(tmp_path / "d", "mock").load(0, **load_kwargs)


def assert_same_array(got: np.ndarray, want: np.ndarray) -> None:
    assert type(got) is np.ndarray
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind == "O":
        assert [type(x) for x in got.flat] == [type(x) for x in want.flat]
        assert got.tolist() == want.tolist()
    else:
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def assert_same_tensor(got, want) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype and got.shape == want.shape and got.device.type == "cpu"
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    g, w = got.contiguous(), want.detach().contiguous()
    if got.dtype in bits:
        g, w = g.view(bits[got.dtype]), w.view(bits[got.dtype])
    assert torch.equal(g, w)


NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
NUMPY_DTYPES += ["float16", "float32", "float64", ">f4", ">i8", "<U7", "S5"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_dtypes_round_trip_bit_exact(tmp_path, dtype):
    rng = np.random.default_rng(1)
    if np.dtype(dtype).kind in "US":
        text = (
            [["ab", "çd", ""], ["x", "yz", "w"]]
            if dtype.startswith("<U")
            else [[b"ab", b"\xffd", b""], [b"x", b"y", b"w"]]
        )
        arr = np.array(text).astype(dtype)
    else:
        arr = (rng.standard_normal((3, 5)) * 100).astype(dtype)
        if arr.dtype.kind == "f":
            arr.flat[0], arr.flat[1], arr.flat[2], arr.flat[3] = np.nan, np.inf, -0.0, -np.inf
    got = round_trip(
        tmp_path, {"x": arr, "empty": np.zeros((0, 4), dtype=dtype), "scalar": arr.reshape(-1)[:1].reshape(())}
    )
    assert_same_array(got["x"], arr)
    assert_same_array(got["empty"], np.zeros((0, 4), dtype=dtype))
    assert_same_array(got["scalar"], arr.reshape(-1)[:1].reshape(()))


def test_non_contiguous_and_fortran_arrays_keep_values(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    got = round_trip(tmp_path, {"t": base.T, "s": base[:, ::2], "f": np.asfortranarray(base)})
    for key, want in (("t", base.T), ("s", base[:, ::2]), ("f", base)):
        assert_same_array(got[key], np.ascontiguousarray(want))
    assert got["t"].flags.writeable  # loaded arrays are ordinary, writable arrays


TORCH_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.bool, torch.int64, torch.int32]
TORCH_DTYPES += [torch.uint8, torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_dtypes_round_trip_bit_exact(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 7, generator=gen) * 50).to(dtype)
    batch = {"t": t, "empty": torch.zeros(0, 3, dtype=dtype), "view": t[:, 1::3], "grad": t.float().requires_grad_()}
    got = round_trip(tmp_path, batch)
    assert_same_tensor(got["t"], t)
    assert_same_tensor(got["empty"], batch["empty"])
    assert_same_tensor(got["view"], t[:, 1::3])
    assert_same_tensor(got["grad"], batch["grad"])
    assert not got["grad"].requires_grad
    got["t"].zero_()  # writable, no warning


def test_python_values_round_trip_with_their_types(tmp_path):
    meta = {
        "global_step": 7,
        "temperature": 0.7,
        "flags": [True, False, None],
        "pair": (1, "a", (2.5, b"\x00\xff")),
        "nan": float("nan"),
        "inf": float("-inf"),
        "big": 2**80,
        3: "int key",
        (1, 2): "tuple key",
        "__t": "a user key that looks like a tag",
        "np_scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.str_("s")],
        "nested": {"a": {"b": [np.arange(3), {"c": torch.ones(2)}]}},
        "surrogate": "bad \udc80 utf8",
    }
    got = round_trip(tmp_path, {"meta_info": meta})["meta_info"]
    assert set(got) == set(meta)
    for key in ("global_step", "temperature", "flags", "pair", "inf", "big", 3, (1, 2), "__t", "surrogate"):
        assert got[key] == meta[key] and type(got[key]) is type(meta[key])
    assert math.isnan(got["nan"])
    assert [type(x) for x in got["np_scalars"]] == [np.float32, np.int64, np.bool_, np.str_]
    assert got["np_scalars"] == meta["np_scalars"]
    assert_same_array(got["nested"]["a"]["b"][0], np.arange(3))
    assert_same_tensor(got["nested"]["a"]["b"][1]["c"], torch.ones(2))


def test_object_arrays_round_trip(tmp_path):
    strings = np.array(["héllo", "", "多语言 text", "x" * 10_000], dtype=object)
    mixed = np.empty(5, dtype=object)
    mixed[:] = [{"role": "user", "content": "hi"}, [1, 2], None, np.arange(4, dtype=np.int16), 3.5]
    grid = np.array([["a", "b"], ["c", "d"]], dtype=object)
    got = round_trip(tmp_path, {"s": strings, "m": mixed, "g": grid, "e": np.empty((0,), dtype=object)})
    assert_same_array(got["s"], strings)
    assert_same_array(got["g"], grid)
    assert got["e"].dtype == object and got["e"].shape == (0,)
    assert got["m"][0] == mixed[0] and got["m"][1] == [1, 2] and got["m"][2] is None and got["m"][4] == 3.5
    assert_same_array(got["m"][3], mixed[3])


def test_vision_language_inputs_round_trip_bit_exact(tmp_path):
    """A vision-language rollout's per-sample visual inputs (verl's ``multi_modal_inputs``: an object column of dicts
    of tensors, ``{}`` for a sample without images, the same dict repeated for each response of a prompt) come back
    as the same tensors bit for bit, without pickle."""
    g = torch.Generator().manual_seed(0)
    one = {"pixel_values": torch.randn(24, 1176, generator=g), "image_grid_thw": torch.tensor([[1, 4, 6]])}
    two = {"pixel_values": torch.randn(8, 1176, generator=g).bfloat16(),
           "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}  # fmt: skip
    column = np.empty(4, dtype=object)
    column[:] = [one, one, two, {}]
    proto = FakeDataProto(
        batch=FakeTensorDict({"input_ids": torch.arange(12).reshape(4, 3)}, batch_size=[4]),
        non_tensor_batch={"multi_modal_inputs": column},
        meta_info={},
    )
    got = round_trip(tmp_path, proto).non_tensor_batch["multi_modal_inputs"]
    assert got.dtype == object and got.shape == (4,) and got[3] == {}
    for index, want in enumerate(column[:3]):
        assert list(got[index]) == list(want)
        for key, tensor in want.items():
            assert_same_tensor(got[index][key], tensor)


def test_dataproto_like_comes_back_as_its_class(tmp_path):
    td = FakeTensorDict(
        {"input_ids": torch.arange(12).reshape(3, 4), "logp": torch.randn(3, 4).bfloat16()}, batch_size=[3]
    )
    proto = FakeDataProto(
        batch=td,
        non_tensor_batch={"uid": np.array(["u0", "u1", "u2"], dtype=object)},
        meta_info={"global_step": 3, "eos_token_id": [1, 2]},
    )
    got = round_trip(tmp_path, proto)
    assert type(got) is FakeDataProto and type(got.batch) is FakeTensorDict
    assert got.batch.batch_size == [3] and list(got.batch.keys()) == ["input_ids", "logp"]
    assert_same_tensor(got.batch["logp"], td["logp"])
    assert_same_array(got.non_tensor_batch["uid"], proto.non_tensor_batch["uid"])
    assert got.meta_info == proto.meta_info
    assert batch_size_of(got) == 3


def test_nested_tensordict_and_dataproto_without_batch(tmp_path):
    inner = FakeTensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3])
    outer = FakeTensorDict({"inner": inner, "y": torch.ones(2)}, batch_size=[2])
    got = round_trip(tmp_path, {"td": outer, "dp": FakeDataProto(batch=None, non_tensor_batch={"a": np.array([1, 2])})})
    assert type(got["td"]["inner"]) is FakeTensorDict and got["td"]["inner"].batch_size == [2, 3]
    assert got["dp"].batch is None and batch_size_of(got["dp"]) == 2


def test_generic_container_with_dict_batch(tmp_path):
    # the shape of our own rl_core batch container: batch (dict of tensors), non_tensor_batch, meta_info
    obj = PositionalOnlyBatch({"advantages": torch.randn(5, 2)})
    obj.non_tensor_batch = {"tag": np.array(["a"] * 5, dtype=object)}
    obj.meta_info = {"k": 1}
    got = round_trip(tmp_path, obj)
    assert type(got) is PositionalOnlyBatch
    assert_same_tensor(got.batch["advantages"], obj.batch["advantages"])
    assert got.meta_info == {"k": 1} and batch_size_of(got) == 5


def test_generic_stand_ins_dump_again_as_the_original_classes(tmp_path):
    proto = FakeDataProto(batch=FakeTensorDict({"x": torch.ones(2)}, batch_size=[2]), meta_info={"a": 1})
    generic = round_trip(tmp_path / "one", proto, generic=True)
    again = round_trip(tmp_path / "two", generic)
    assert type(again) is FakeDataProto and type(again.batch) is FakeTensorDict and again.batch.batch_size == [2]


def test_generic_load_needs_no_class_and_no_torch(tmp_path):
    proto = FakeDataProto(batch=FakeTensorDict({"b": torch.tensor([1.5, -2.0]).bfloat16()}, batch_size=[2]))
    got = round_trip(tmp_path, proto, generic=True)
    assert type(got) is GenericBatch and got.class_name.endswith(":FakeDataProto")
    assert type(got.batch) is GenericTensorDict and got.batch.batch_size == [2]
    assert_same_array(got.batch["b"], np.array([1.5, -2.0], dtype=np.float32))  # bfloat16 widened exactly


def test_class_not_imported_is_an_error_not_an_import(tmp_path, monkeypatch):
    d = tmp_path / "d"
    path = RolloutReplay(d, "dump").dump(0, FakeDataProto(meta_info={"a": 1}))
    assert b"replay_fakes:FakeDataProto" in pathlib.Path(path).read_bytes()
    reader = RolloutReplay(d, "mock")
    monkeypatch.delitem(sys.modules, "replay_fakes")
    with pytest.raises(DumpFormatError, match=r"replay_fakes:FakeDataProto, which is not imported"):
        reader.load(0)
    assert "replay_fakes" not in sys.modules  # rl_replay did not import it


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"a": {"b": {1, 2}}}, "a/b of type builtins.set"),
        ({"c": np.array([1 + 2j])}, "c: numpy dtype complex128"),
        ({"o": [object()]}, "o/0 of type builtins.object"),
        ({"t": torch.tensor([1 + 1j])}, "t: torch tensor with dtype torch.complex64"),
    ],
)
def test_unsupported_values_are_refused_naming_where(tmp_path, value, where):
    with pytest.raises(UnsupportedValueError, match=where):
        RolloutReplay(tmp_path / "d", "dump").dump(0, value)
    assert not (tmp_path / "d" / "train" / "step_000000.safetensors").exists()


def test_files_open_with_the_reference_safetensors_library(tmp_path):
    batch = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.ones((2, 2), dtype=np.float16)}
    path = RolloutReplay(tmp_path / "d", "dump").dump(0, batch)
    loaded = st_numpy_load(path)
    assert_same_array(loaded["a"], batch["a"])
    assert_same_array(loaded["b"], batch["b"])
    with safe_open(path, framework="numpy") as f:
        assert "rl_replay" in f.metadata()
    tpath = RolloutReplay(tmp_path / "t", "dump").dump(
        0, {"x": torch.randn(3, 2).bfloat16(), "m": torch.ones(4).bool()}
    )
    ref = st_torch_load(tpath)
    assert ref["x"].dtype == torch.bfloat16 and ref["m"].dtype == torch.bool and ref["m"].all()


def test_samples_is_the_batch_dimension():
    assert batch_size_of({"x": np.zeros((128, 7))}) == 128
    assert batch_size_of({"meta": {}, "x": torch.zeros(5, 2)}) == 5
    assert batch_size_of(FakeTensorDict({}, batch_size=[9])) == 9
    assert batch_size_of(FakeDataProto(non_tensor_batch={"p": np.array(["a", "b"], dtype=object)})) == 2
    assert batch_size_of({}) == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_numeric_arrays_round_trip(tmp_path, seed):
    # a seeded sweep of dtypes and shapes (incl. 0-d and empty); raw random bytes cover NaN payloads too
    rng = np.random.default_rng(seed)
    batch = {}
    for i, dtype in enumerate(("bool", "int8", "uint16", "int64", "float16", "float32", "float64", ">f8")):
        shape = tuple(int(d) for d in rng.integers(0, 5, size=rng.integers(0, 4)))
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
        arr = raw.view(dtype).reshape(shape) if dtype != "bool" else (raw > 127).reshape(shape)
        batch[f"a{i}"] = arr
    got = round_trip(tmp_path, batch)
    for key, arr in batch.items():
        assert_same_array(got[key], arr)


def test_real_tensordict_if_installed(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    inner = tensordict.TensorDict({"a": torch.ones(3, 2)}, batch_size=[3])
    td = tensordict.TensorDict(
        {"input_ids": torch.arange(12).reshape(3, 4), "logp": torch.randn(3, 4).bfloat16(), "nested": inner},
        batch_size=[3],
    )
    got = round_trip(tmp_path, FakeDataProto(batch=td, meta_info={"step": 1}))
    assert type(got.batch) is tensordict.TensorDict and got.batch.batch_size == torch.Size([3])
    assert type(got.batch["nested"]) is tensordict.TensorDict
    assert_same_tensor(got.batch["logp"], td["logp"])
    assert batch_size_of(got) == 3

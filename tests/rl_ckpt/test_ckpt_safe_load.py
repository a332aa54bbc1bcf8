"""Checkpoint pickles are read without running code from them (safe_load): unknown classes become inert
placeholders, references to os / sys / builtins are refused, ``--trust_checkpoint`` unpickles for real."""

import argparse
import enum
import os
import pickle

import pytest
import torch

from rl_ckpt import CheckpointError
from rl_ckpt.mcore_io import load_rank
from rl_ckpt.safe_load import Opaque, load_restricted_pickle, load_torch_file

TOUCHED = "touched"


class Backend(enum.Enum):
    """Stands for megatron's AttnBackend: an enum inside the args."""

    auto = 5


class Touch:
    """Creates a file when built: proves whether unpickling ran it."""

    def __init__(self, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(TOUCHED)

    def __reduce__(self):
        return (Touch, (self.path,))


def touch_object(path):
    obj = Touch.__new__(Touch)
    obj.path = str(path)
    return obj


def rank_state(tmp_path, **extra):
    args = argparse.Namespace(num_layers=2, attention_backend=Backend.auto, params_dtype=torch.bfloat16)
    return {"args": args, "model": {"w": torch.arange(3.0), "w._extra_state": None}, **extra}


def test_ckpt_unknown_classes_become_placeholders_and_never_run(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "model_optim_rng.pt"
    torch.save(rank_state(tmp_path, hook=touch_object(marker)), path)
    args, model = load_rank(path)
    assert not marker.exists()  # Touch.__init__ did not run
    assert args.num_layers == 2 and args.params_dtype is torch.bfloat16
    assert isinstance(args.attention_backend, Opaque) and args.attention_backend.pickled_args == (5,)
    assert list(model) == ["w"] and torch.equal(model["w"], torch.arange(3.0))
    state = load_torch_file(path, trust=True)  # --trust_checkpoint: real objects, and the code runs
    assert isinstance(state["hook"], Touch) and marker.read_text(encoding="utf-8") == TOUCHED


class System:
    def __reduce__(self):
        return (os.system, ("true",))


def test_ckpt_os_references_are_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save(rank_state(tmp_path, hook=System()), path)
    with pytest.raises(CheckpointError, match="--trust_checkpoint") as err:
        load_rank(path)
    assert str(path) in str(err.value)


def test_ckpt_restricted_unpickler(tmp_path):
    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps({"size": torch.Size([2, 3]), "hook": touch_object(tmp_path / "m")}))
    data = load_restricted_pickle(path, {("torch", "Size"): torch.Size})
    assert data["size"] == torch.Size([2, 3]) and isinstance(data["hook"], Opaque)
    assert not (tmp_path / "m").exists()
    path.write_bytes(pickle.dumps(System()))
    with pytest.raises(CheckpointError, match=str(path)):
        load_restricted_pickle(path, {})
    path.write_bytes(b"cbuiltins\neval\n(S'1+1'\ntR.")  # eval("1+1") in protocol 0
    with pytest.raises(CheckpointError):
        load_restricted_pickle(path, {})

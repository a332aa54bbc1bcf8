"""Saves that run out of space: the classifier of rl_engines.disk_space, and a two-rank save (two processes, gloo)
in which only rank 1's disk is full (a file-size limit there), so that rank 0 has to abandon its finished part."""

from __future__ import annotations

import errno
import multiprocessing
import pickle
import traceback
from pathlib import Path

import torch
from engine_fixtures import file_size_limit, leftovers
from torch.distributed.checkpoint.api import CheckpointException

from rl_engines.disk_space import OutOfSpaceError, format_bytes, out_of_space_cause


def _raised(exc: BaseException, context: BaseException, *, cut: bool = False) -> BaseException:
    """``exc`` as Python leaves it when raised while handling ``context`` (``raise exc from None`` when ``cut``)."""
    try:
        try:
            raise context
        except BaseException:
            if cut:
                raise exc from None
            raise exc  # noqa: B904  (the implicit context is what is tested)
    except BaseException as caught:
        return caught


def test_out_of_space_is_told_apart_from_other_errors():
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        assert isinstance(out_of_space_cause(OSError(code, "full")), OSError)
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert out_of_space_cause(short) is short  # torch's zip writer: no errno
    safetensors = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert out_of_space_cause(safetensors) is safetensors
    nested = OSError(errno.ENOSPC, "No space left on device", "/ckpt/dcp/__1_0.distcp")
    dcp = CheckpointException("write", {0: (short, traceback.StackSummary()), 1: (nested, traceback.StackSummary())})
    assert out_of_space_cause(dcp) is nested  # the errno beats the text
    wrapped = ValueError("wrapped")
    wrapped.__cause__ = nested
    assert out_of_space_cause(wrapped) is nested
    for other in (OSError(errno.ENOENT, "missing"), ValueError("bad"), PermissionError(errno.EACCES, "denied")):
        assert out_of_space_cause(other) is None
    assert out_of_space_cause(_raised(ValueError("bad"), nested)) is nested  # a context counts ...
    assert out_of_space_cause(_raised(ValueError("bad"), nested, cut=True)) is None  # ... unless `from None` cut it
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 << 20, 3 << 40)] == [
        "0 B", "1023 B", "1.50 KiB", "5.00 MiB", "3.00 TiB"]  # fmt: skip


def test_the_error_crosses_process_boundaries_intact():
    error = OutOfSpaceError(errno.ENOSPC, "actor_train: rank 1 could not save checkpoint /c: out of disk space", "/c")
    copy = pickle.loads(pickle.dumps(error))  # as Ray sends it to the driver
    assert (type(copy), copy.errno, copy.filename, str(copy)) == (OutOfSpaceError, errno.ENOSPC, "/c", str(error))


def _two_rank_save(rank: int, root: str, results: multiprocessing.Queue) -> None:
    """One rank: save a complete checkpoint, then (rank 1 under a 16 KiB file-size limit) a second one."""
    import torch.distributed as dist

    from rl_engines.strategies.checkpointing import PeerRankError, write_checkpoint_atomically

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
    path = f"{root}/ckpt"

    def write(tmp: Path, rank: int) -> None:
        torch.save(torch.zeros(32 << 10), tmp / f"rank{rank}.pt")  # 128 KiB per rank

    write_checkpoint_atomically(path, 1, write, role="actor_train", rank_bytes=128 << 10)
    try:
        if rank == 1:
            with file_size_limit(16 << 10):
                write_checkpoint_atomically(path, 2, write, role="actor_train", rank_bytes=128 << 10)
        else:
            write_checkpoint_atomically(path, 2, write, role="actor_train", rank_bytes=128 << 10)
        results.put((rank, "saved", ""))
    except (OutOfSpaceError, PeerRankError) as exc:
        results.put((rank, type(exc).__name__, str(exc)))
    dist.barrier()  # nobody is left waiting in a collective: both ranks got here
    write_checkpoint_atomically(path, 3, write, role="actor_train", rank_bytes=128 << 10)  # space is back
    dist.destroy_process_group()
    results.put((rank, "then saved", ""))


def test_only_rank_1_runs_out_of_space_and_every_rank_abandons_the_save(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_two_rank_save, args=(r, str(tmp_path), results)) for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=180)
    assert [process.exitcode for process in ranks] == [0, 0]
    got = sorted(results.get(timeout=5) for _ in range(4))
    (_, kind0, text0), (_, then0, _), (_, kind1, text1), (_, then1, _) = got
    ckpt = tmp_path / "ckpt"
    assert kind0 == "PeerRankError" and text0.startswith(f"actor_train: rank(s) [1] failed to save checkpoint {ckpt}")
    assert kind1 == "OutOfSpaceError", text1
    assert text1.startswith(f"actor_train: rank 1 could not save checkpoint {ckpt}: out of disk space ("), text1
    assert "It needs about 256.00 KiB; " in text1 and "at most 16.00 KiB (ulimit -f)" in text1, text1
    assert f"The temporary folder {ckpt}.tmp-2 was removed; earlier checkpoints are untouched." in text1
    assert (then0, then1) == ("then saved", "then saved")
    assert leftovers(tmp_path) == [] and sorted(p.name for p in ckpt.iterdir()) == ["COMPLETE", "rank0.pt", "rank1.pt"]

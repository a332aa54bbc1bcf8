"""RolloutReplay: dump every step's rollout batch, or replay it instead of generating.

It sits at the scheduler layer (the function that returns the batch for step N); the pipeline after it
does not know whether the batch was generated or loaded.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any, overload

from rl_replay import determinism
from rl_replay.atomic import atomic_write, is_temp_name
from rl_replay.codec import Decoder, Encoder, batch_size_of
from rl_replay.config import SPLITS, RolloutMockConfig
from rl_replay.errors import (
    ConfigError,
    DumpExistsError,
    DumpFormatError,
    DumpNotFoundError,
    MockFileNotFoundError,
    ReplayError,
    SplitNotDumpedError,
    StepsExceededError,
    missing_step_message,
)
from rl_replay.manifest import (
    confined_path,
    library_versions,
    now_iso,
    read_manifest,
    split_steps,
    update_manifest,
)
from rl_replay.stfile import parse_safetensors, read_verified, write_safetensors
from rl_replay.wrapping import SplitSpec, StepSpec, make_wrapper

logger = logging.getLogger("rl_replay")

FILE_SUFFIX = ".safetensors"
FILE_FORMAT = 1
METADATA_KEY = "rl_replay"
_STEP_FILE = re.compile(r"^step_(\d{6,})\.(safetensors|pkl)$")


def step_filename(step: int) -> str:
    """`step_NNNNNN.safetensors` (6-digit zero padded, as in the guide)."""
    return f"step_{step:06d}{FILE_SUFFIX}"


def step_file_path(dump_dir: str, split: str, step: int, record: Mapping[str, Any]) -> str:
    """`dump_dir/split/step_NNNNNN.safetensors`, after checking that no path of this step leads out of `dump_dir`.

    The layout fixes the file; the manifest's `file` entry records it for people and other tools, so it must
    not name a file outside the dump either. Every reader (load, verify, diff, ls, show) goes through here:
    an absolute `file`, one with '..', or a step file that resolves through a symlink to outside the dump
    raises DumpPathError.
    """
    entry = f"splits.{split}.steps.{step}.file"
    if "file" in record:
        confined_path(dump_dir, record["file"], entry)
    return confined_path(dump_dir, f"{split}/{step_filename(step)}", entry)


def _check_step_split(step: object, split: object) -> None:
    if type(step) is not int or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    if split not in SPLITS:
        raise ConfigError(f"split (the scheduler mode) must be one of {list(SPLITS)}, got {split!r}")


class RolloutReplay:
    """Dump (`mode="dump"`) or replay (`mode="mock"`) the rollout batch of every step.

    Example::

        replay = RolloutReplay("./output/rollout_dumps/baseline_v1", "dump")
        get_batch = replay.wrap(get_batch)   # get_batch(step) -> batch, now dumped / replayed
    """

    def __init__(self, dump_dir: str | os.PathLike[str], mode: str, *, overwrite: bool = False, durable: bool = True):
        """`overwrite` lets dump mode replace another run's steps; `durable=False` skips fsync."""
        config = RolloutMockConfig(enable=True, mode=mode, dump_dir=os.fspath(dump_dir), overwrite=overwrite)
        self.dump_dir = config.dump_dir
        self.mode = config.mode
        self.overwrite = overwrite
        self.durable = durable
        self.run_id = uuid.uuid4().hex
        self._started: set[str] = set()
        self._checked: set[str] = set()
        self._manifest: dict[str, Any] | None = None
        if self.mode == "dump":
            os.makedirs(self.dump_dir, exist_ok=True)
        else:
            self._manifest = self._require_dump()
        logger.info("[Rollout Mock] Rollout Mock enabled: mode=%s, dir=%s", self.mode, self.dump_dir)

    @classmethod
    def from_config(cls, config: RolloutMockConfig | Mapping[str, Any] | None) -> RolloutReplay | None:
        """A RolloutReplay for a `rollout_mock` section (dataclass or mapping); None when not enabled."""
        if not isinstance(config, RolloutMockConfig):
            config = RolloutMockConfig.from_dict(config)
        if not config.enable:
            return None
        return cls(config.dump_dir, config.mode, overwrite=config.overwrite)

    def step_path(self, step: int, split: str = "train") -> str:
        """`dump_dir/split/step_NNNNNN.safetensors`."""
        return os.path.join(self.dump_dir, split, step_filename(step))

    def steps(self, split: str = "train") -> list[int]:
        """Steps of `split` recorded in the manifest, sorted."""
        return sorted(split_steps(read_manifest(self.dump_dir), split))

    @overload
    def wrap(self, fn: Callable[..., Any], *, split: SplitSpec = ..., step: StepSpec = ...) -> Callable[..., Any]: ...

    @overload
    def wrap(
        self, fn: None = None, *, split: SplitSpec = ..., step: StepSpec = ...
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...

    def wrap(self, fn: Callable[..., Any] | None = None, *, split: SplitSpec = "train", step: StepSpec = None) -> Any:
        """Wrap a get-batch function (or use as a decorator): dump its result, or replay without calling it.

        `step` names the argument holding the step (default: `step` or `global_step`) or is a callable
        taking the same arguments and returning it (e.g. `lambda data: data.meta_info["global_step"]`).
        `split` is "train" / "val" or such a callable. Works for sync and async functions.
        """
        if fn is None:
            return lambda f: make_wrapper(self, f, split, step)
        return make_wrapper(self, fn, split, step)

    # ----------------------------------------------------------------------------------------- dump
    def dump(self, step: int, batch: Any, split: str = "train") -> str:
        """Save `batch` as step `step` of `split`; returns the file path. Atomic; logs the guide's line."""
        _check_step_split(step, split)
        if self.mode != "dump":
            raise ReplayError(f"[Rollout Mock] dump() needs mode='dump'; this RolloutReplay is in {self.mode} mode")
        if split not in self._started:
            self._start_split(split)
            self._started.add(split)
        encoder = Encoder()
        tree = encoder.encode(batch, "")
        meta = {"format": FILE_FORMAT, "step": step, "split": split, "tree": tree}
        metadata = {METADATA_KEY: json.dumps(meta, separators=(",", ":"), ensure_ascii=False)}
        path = self.step_path(step, split)
        samples = batch_size_of(batch)
        try:
            size, crc = atomic_write(path, lambda fd: write_safetensors(fd, encoder.entries, metadata), self.durable)
        except OSError as exc:
            raise _dump_error(exc, step, path, sum(e.data.nbytes for e in encoder.entries)) from exc
        record = {"file": f"{split}/{step_filename(step)}", "size": size, "crc32": f"{crc:08x}", "samples": samples}
        record["created_at"] = now_iso()
        try:
            update_manifest(
                self.dump_dir, lambda m: m["splits"][split]["steps"].update({str(step): record}), self.durable
            )
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)  # a step the manifest does not vouch for must not stay behind
            raise _dump_error(exc, step, path, size) from exc
        logger.info("[Rollout Mock] Dumped step %d: %s (samples=%d, size=%.2fMB)", step, path, samples, size / 2**20)
        return path

    def _start_split(self, split: str) -> None:
        split_dir = os.path.join(self.dump_dir, split)
        os.makedirs(split_dir, exist_ok=True)

        def change(manifest: dict[str, Any]) -> None:
            old = manifest["splits"].get(split) or {}
            on_disk = _step_files(split_dir)
            if (old.get("steps") or on_disk) and old.get("run_id") != self.run_id:
                if not self.overwrite:
                    raise DumpExistsError(_exists_message(self.dump_dir, split, old, on_disk))
                for name in on_disk:
                    os.unlink(os.path.join(split_dir, name))
            for name in os.listdir(split_dir):
                if is_temp_name(name):  # left by a killed dump
                    os.unlink(os.path.join(split_dir, name))
            manifest["splits"][split] = {
                "run_id": self.run_id,
                "created_at": now_iso(),
                "versions": library_versions(),
                "deterministic": determinism.deterministic_settings(),
                "steps": {},
            }

        update_manifest(self.dump_dir, change, self.durable)

    # ----------------------------------------------------------------------------------------- load
    def load(self, step: int, split: str = "train", *, generic: bool = False) -> Any:
        """Load step `step` of `split`, verifying size and CRC-32; logs the guide's `Loaded step` line.

        Batches come back as the type they were dumped as (see the package README). `generic=True`
        returns stand-ins instead of importing classes or torch (what the CLI uses).
        """
        _check_step_split(step, split)
        record = self._record(step, split)
        path = step_file_path(self.dump_dir, split, step, record)
        try:
            batch = load_file(path, record, step, split, generic=generic)
        except FileNotFoundError as exc:
            if isinstance(exc, ReplayError):
                raise
            base = missing_step_message(path, self.dump_dir, split, step)
            raise MockFileNotFoundError(
                f"{base}\nThe manifest records step {step}, but its file is gone (deleted or moved)."
            ) from None
        if self.mode == "mock" and split not in self._checked:
            self._checked.add(split)
            self._warn_if_not_deterministic(split)
        logger.info("[Rollout Mock] Loaded step %d: %s (samples=%d)", step, path, batch_size_of(batch))
        return batch

    def check_max_steps(self, max_steps: int, split: str = "train") -> None:
        """Raise StepsExceededError unless steps 0 .. max_steps-1 of `split` were all dumped."""
        for step in range(max_steps):
            self._record(step, split)

    def _require_dump(self) -> dict[str, Any]:
        manifest = read_manifest(self.dump_dir)
        if manifest is not None:
            return manifest
        pickles = glob.glob(os.path.join(glob.escape(self.dump_dir), "*", "step_*.pkl"))
        hint = (
            " It holds ROLL pickle dumps (step_*.pkl): rl_replay never loads pickle, since unpickling runs code;"
            " re-run dump mode with rl_replay."
            if pickles
            else " Check rollout_mock.dump_dir (it must be the same path as in dump mode) and run dump mode first."
        )
        raise DumpNotFoundError(f"[Rollout Mock] no rl_replay dump (manifest.json) in {self.dump_dir}.{hint}")

    def _record(self, step: int, split: str) -> dict[str, Any]:
        steps = split_steps(self._manifest, split)
        if step not in steps:  # the dump may have moved on since we last looked
            self._manifest = read_manifest(self.dump_dir)
            steps = split_steps(self._manifest, split)
        if step in steps:
            return steps[step]
        path = self.step_path(step, split)
        base = missing_step_message(path, self.dump_dir, split, step)
        if not steps:
            dumped = sorted(s for s in (self._manifest or {}).get("splits", {}) if split_steps(self._manifest, s))
            raise SplitNotDumpedError(
                f"{base}\nSplit {split!r} was never dumped in {self.dump_dir} (dumped splits: {dumped}). "
                "The scheduler mode (train/val) in mock mode must match the one used in dump mode."
            )
        last = max(steps)
        if step > last:
            raise StepsExceededError(
                f"{base}\nThe dump of split {split!r} holds {len(steps)} steps (last: step {last}); step {step} "
                "is beyond it. Mock mode's max_steps must not exceed the dump run's max_steps."
            )
        extra = (
            " The file exists but the manifest does not record it: its dump was interrupted."
            if os.path.exists(path)
            else ""
        )
        raise MockFileNotFoundError(f"{base}\nStep {step} is missing from the dump.{extra}")

    def _warn_if_not_deterministic(self, split: str) -> None:
        info = (self._manifest or {}).get("splits", {}).get(split) or {}
        diffs = determinism.settings_differences(info.get("deterministic") or {}, determinism.deterministic_settings())
        if diffs:
            logger.warning(
                "[Rollout Mock] Deterministic settings differ from the dump (%s, split %s): %s. Keep system_envs "
                "identical in dump and mock mode, or results will not align numerically.",
                self.dump_dir,
                split,
                "; ".join(diffs),
            )


def load_file(path: str, record: Mapping[str, Any], step: int, split: str, *, generic: bool = False) -> Any:
    """Read, verify and decode one step file against its manifest record."""
    try:
        expected_crc = int(record["crc32"], 16)
    except (KeyError, TypeError, ValueError):
        raise DumpFormatError(f"[Rollout Mock] manifest record of {path} has no valid crc32") from None
    buf = read_verified(path, int(record["size"]), expected_crc)
    tensors, metadata = parse_safetensors(buf, path)
    try:
        meta = json.loads(metadata[METADATA_KEY])
    except (KeyError, ValueError):
        raise DumpFormatError(f"[Rollout Mock] {path} is a safetensors file but not an rl_replay step") from None
    if not isinstance(meta, dict) or meta.get("format") != FILE_FORMAT:
        raise DumpFormatError(f"[Rollout Mock] {path} has an unsupported rl_replay file format")
    if (meta.get("step"), meta.get("split")) != (step, split):
        raise DumpFormatError(
            f"[Rollout Mock] {path} holds step {meta.get('step')} of {meta.get('split')}, not step {step} of {split}"
        )
    return Decoder(tensors, path, generic=generic).decode(meta["tree"])


def _step_files(split_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(split_dir) if _STEP_FILE.match(n))


def _exists_message(dump_dir: str, split: str, old: Mapping[str, Any], on_disk: list[str]) -> str:
    count = len(old.get("steps") or {}) or len(on_disk)
    since = f", dumped at {old['created_at']}" if old.get("created_at") else ""
    return (
        f"[Rollout Mock] dump_dir {dump_dir} already holds {count} step(s) of split {split!r} from another dump run"
        f"{since}. Refusing to mix runs. Use a new rollout_mock.dump_dir, delete {os.path.join(dump_dir, split)}, "
        "or allow replacing them with rollout_mock.overwrite: true (RolloutReplay(..., overwrite=True))."
    )


def _dump_error(exc: OSError, step: int, path: str, nbytes: int) -> OSError:
    message = f"[Rollout Mock] could not dump step {step} to {path}: {exc.strerror or exc}. No partial file was left."
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        message += (
            f" One step of this batch takes about {nbytes / 2**20:.2f}MB (total = that x max_steps) and "
            f"{_free_bytes(path) / 2**20:.2f}MB are free there: free disk space, reduce max_steps, or point "
            "rollout_mock.dump_dir at larger (e.g. network) storage."
        )
    return OSError(exc.errno, message, path)


def _free_bytes(path: str) -> int:
    """Free bytes on the file system of `path`'s folder (0 when it cannot be read)."""
    try:
        return shutil.disk_usage(os.path.dirname(path) or ".").free
    except OSError:
        return 0

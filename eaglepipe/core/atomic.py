"""Atomic file writes: nothing half-written ever looks complete.

Every output is written to a temporary name in the same directory, flushed and fsynced, then
renamed over the target. `write_if_changed` keeps the target (and its mtime) when the content
is identical, so re-running a step with the same inputs leaves downstream targets up to date.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from .space import disk_full_error, is_disk_full


def fsync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Linux's sync_file_range flag: start writing the range's dirty pages, do not wait for them.
_SYNC_FILE_RANGE_WRITE = 2
WRITEBACK_STEP = 64 << 20


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_sync_file_range = _load_sync_file_range()


class Writeback:
    """Starts the device writes of a large file while it is still being written.

    Without it the kernel keeps a GiB-sized file's pages dirty until the dirty-memory threshold
    (10 % of RAM by default) or the final fsync: the disk idles while the file is filled, then
    the fsync waits for all of it. Every `step` bytes the range just written is handed to
    `sync_file_range` (Linux; elsewhere the final fsync does it all), which returns at once.
    Its errors are not raised here: the caller's fsync reports any failed write. A `step` of 0
    leaves the timing to the kernel (`extract.chunk_writeback_mb: 0`)."""

    def __init__(self, fd: int, *, step: int | None = None):
        self.fd = fd
        self.step = WRITEBACK_STEP if step is None else step
        self.started_to = 0  # bytes [0, started_to) are already handed to the device

    def advance(self, written: int) -> None:
        if _sync_file_range is None or self.step <= 0 or written - self.started_to < self.step:
            return
        _sync_file_range(
            self.fd, self.started_to, written - self.started_to, _SYNC_FILE_RANGE_WRITE
        )
        self.started_to = written


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Write via a temp file and rename; `durable=False` skips the fsyncs (for derivable files).

    A full filesystem ends in one PipelineError naming the file, the temp file removed and the
    target as it was."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(path) from None
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        # mkstemp creates 0600; outputs get the usual permissions of a created file.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full_error(path) from None
        raise
    if durable:
        fsync_dir(path.parent)


def write_if_changed(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> bool:
    """Atomically write `data` unless the file already holds exactly it. Returns True if written."""
    path = Path(path)
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    atomic_write_bytes(path, data, durable=durable)
    return True


def dumps_json(obj: Any) -> bytes:
    """Canonical JSON (sorted keys, fixed indent) so equal content gives equal bytes."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def atomic_write_json(path: str | os.PathLike, obj: Any, *, durable: bool = True) -> None:
    atomic_write_bytes(path, dumps_json(obj), durable=durable)


def write_json_if_changed(path: str | os.PathLike, obj: Any, *, durable: bool = True) -> bool:
    return write_if_changed(path, dumps_json(obj), durable=durable)

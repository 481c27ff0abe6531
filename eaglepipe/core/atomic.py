"""Atomic file writes: nothing half-written ever looks complete.

Every output is written to a temporary name in the same directory, flushed and fsynced, then
renamed over the target. `write_if_changed` keeps the target (and its mtime) when the content
is identical, so re-running a step with the same inputs leaves downstream targets up to date.
"""

from __future__ import annotations

import json
import os
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


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, dumps_json(obj))


def write_json_if_changed(path: str | os.PathLike, obj: Any, *, durable: bool = True) -> bool:
    return write_if_changed(path, dumps_json(obj), durable=durable)

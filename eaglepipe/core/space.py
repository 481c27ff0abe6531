"""Disk space: free bytes on the filesystem that will hold a path, a clear refusal before a write
that cannot fit, and human-readable sizes (a whole run's plan: `ops/disk_plan.py`)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from .errors import PipelineError


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def existing_ancestor(path: str | os.PathLike) -> Path:
    """`path`, or its nearest ancestor that exists (where a directory not yet made would be)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def free_bytes(directory: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds `directory` (or would hold it once created)."""
    return shutil.disk_usage(existing_ancestor(Path(directory))).free


def check_free_space(needed_bytes: int, directory: str | os.PathLike, what: str) -> None:
    """Raise PipelineError when `needed_bytes` cannot fit on the filesystem of `directory`."""
    free = free_bytes(directory)
    if needed_bytes > free:
        raise PipelineError(
            f"{what} needs {format_bytes(needed_bytes)} but only {format_bytes(free)} is free "
            f"on the filesystem of {existing_ancestor(Path(directory))}: free space or point "
            "the output elsewhere"
        )


def is_disk_full(exc: BaseException) -> bool:
    """An OSError saying the filesystem (or the user's quota) has no room left."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_error(path: str | os.PathLike) -> PipelineError:
    """The one line a write that ran out of space ends in, naming the file."""
    path = Path(path)
    return PipelineError(
        f"no space left on the filesystem of {path.parent} while writing {path.name}: free "
        "space, then rerun (what was finished is kept; nothing half-written is left)"
    )

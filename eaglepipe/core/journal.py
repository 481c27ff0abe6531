"""A shard's journal line: one JSON object per finished piece of work (a hidden-state chunk, a
regenerated row), appended and fsynced before the call returns, so a killed job loses nothing
it finished. A line torn by a kill mid-append is what the readers skip."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .space import disk_full_error, is_disk_full


def journal_line(entry: dict) -> bytes:
    return (json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n").encode()


def append_journal_line(path: str | os.PathLike, entry: dict) -> None:
    """Append `entry` to the journal at `path`; durable before returning. A full disk ends in
    one line naming the journal (the line may be torn: the next run drops it)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            data = journal_line(entry)
            while data:  # a short write leaves a torn line, which the next run drops
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(path) from None
        raise

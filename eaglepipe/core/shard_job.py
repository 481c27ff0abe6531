"""What every per-shard job does alike: the shard's writer lock (one process writes a shard; it
names its PID and host) and the record of why its last attempt failed (`failed.json`, what
`eaglepipe status` shows)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

from .atomic import atomic_write_json
from .errors import PipelineError

# Why the shard's last extraction attempt failed (read by `eaglepipe status`); removed when an
# attempt starts, and with the shard directory.
FAILURE_NAME = "failed.json"
LOCK_NAME = "writer.lock"


# ---------------------------------------------------------------------------------------------
# One writer per shard


class ShardLock:
    """An exclusive flock on `<shard>/writer.lock`, recording the holder's PID, host and start.

    flock is released by the kernel when the holder dies (kill -9 included), so a stale lock
    file never blocks a rerun; a live holder makes a second writer fail naming its PID.
    """

    def __init__(self, shard_dir: str | os.PathLike):
        self.path = Path(shard_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> ShardLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder(fd)
            os.close(fd)
            raise PipelineError(
                f"shard {self.path.parent} is being written by another process "
                f"(PID {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
                f"since {holder.get('started_at', '?')}): stop it or wait for it to finish"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    @staticmethod
    def _read_holder(fd: int) -> dict:
        # The holder writes its details right after locking; give it a moment if it just did.
        for _ in range(20):
            raw = os.pread(fd, 4096, 0)
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                time.sleep(0.05)
        return {}

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ShardLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def record_failure(shard_dir: str | os.PathLike, message: str) -> None:
    """Record why this attempt at the shard failed (its first line; the log has the rest)."""
    atomic_write_json(
        Path(shard_dir) / FAILURE_NAME,
        {"error": (message.splitlines() or [""])[0], "failed_at": datetime.now(UTC).isoformat()},
    )


def read_failure(shard_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(shard_dir) / FAILURE_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None

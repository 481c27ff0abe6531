"""What every per-shard job does alike: the shard's writer lock (one process writes a shard; it
names its PID and host), the record of why its last attempt failed (`failed.json`, what
`eaglepipe status` shows), and the job's attempts (`run_shard_job`)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from .atomic import atomic_write_json
from .errors import PipelineError, ServerLost

# Attempts per shard job when the server is lost mid-shard (the next lease starts a fresh one).
# Nothing else is retried: every other error would fail the same way again.
SERVER_ATTEMPTS = 2
# Why the shard's last attempt failed (read by `eaglepipe status`); removed when an
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
    """Record why this attempt at the shard failed (its first line; the log has the rest).

    Best effort: on a full disk there is no room for the record either, and the error being
    recorded (the job's log has it) must not be replaced by that one."""
    try:
        atomic_write_json(
            Path(shard_dir) / FAILURE_NAME,
            {
                "error": (message.splitlines() or [""])[0],
                "failed_at": datetime.now(UTC).isoformat(),
            },
        )
    except (PipelineError, OSError):
        pass


def read_failure(shard_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(shard_dir) / FAILURE_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None


def process_age_s() -> float | None:
    """Seconds since this process started, at the kernel's tick (10 ms); None off Linux.

    What a job's manifest records as `first_request_s`: its start-up, interpreter included."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(after_name[19])  # field 22, starttime, in ticks since boot
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        return round(now - start_ticks / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


T = TypeVar("T")


def run_shard_job(
    shard_dir: str | os.PathLike,
    job: str,
    attempt: Callable[[], T],
    *,
    log: Callable[[str], None],
    kept: str = "",
) -> T:
    """A shard job: `attempt()`, once more with a fresh server if the server was lost.

    A failure is recorded in the shard directory (`failed.json`, what `eaglepipe status` shows)
    until the next attempt starts or the directory is removed. `job` names the job in the log
    ("extraction"); `kept` says what a second attempt keeps ("finished chunks are kept").
    """
    shard_dir = Path(shard_dir)
    (shard_dir / FAILURE_NAME).unlink(missing_ok=True)
    # Logs are appended to: this line separates the attempts of separate runs.
    started = datetime.now(UTC).isoformat(timespec="seconds")
    log(f"=== {shard_dir.name}: {job} job started {started}")
    number = 1
    while True:
        try:
            return attempt()
        except ServerLost as exc:
            if number == SERVER_ATTEMPTS:
                record_failure(shard_dir, str(exc))
                raise
            log(f"error (attempt {number}/{SERVER_ATTEMPTS}): {exc}")
            number += 1
            note = f"; {kept}" if kept else ""
            log(f"{shard_dir.name}: attempt {number}/{SERVER_ATTEMPTS} with a fresh server{note}")
        except Exception as exc:
            record_failure(shard_dir, str(exc) or type(exc).__name__)
            raise

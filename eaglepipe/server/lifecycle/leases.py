"""Node-local server bookkeeping: the state directory, leases, and the exclusive-use gate.

Everything lives under `.eaglepipe/server/<hostname>/`, so a working directory on a shared
filesystem gives every cluster node its own lock, state, leases and port:

- `lock`: held (flock) while a process decides to start, reuse or stop the server.
- `state.json`: the running server (supervisor pid and process group, port, fingerprint, ...).
- `history.jsonl`: one line per start, stop and exit, for people and tests to count starts.
- `leases/<host>-<pid>-<n>.lease`: one per user of the server; a daemon thread touches it
  every `lease_ttl_s / 4`, so the mtime is a heartbeat. A lease is live while its mtime is
  younger than `lease_ttl_s` and (on this host) its process still exists.
- `answered`: the instance id of the server whose /health last answered a job's watchdog; its
  mtime is when. A job that joins a server answering other jobs right now takes its lease on
  that (`answered_recently`) instead of a `/server_info` round trip, which on a busy SGLang
  waits for the scheduler's current batch.
- `pinned`: the server was started by hand (`eaglepipe server start`) and does not idle-stop.
- `gate.turnstile`, `gate.room`, `exclusive.json`: the readers-writer gate that gives a
  validation spot check the server to itself (see `RequestGate`).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ...core.atomic import atomic_write_bytes, atomic_write_json
from ...core.config import STATE_DIR

SERVER_STATE_ROOT = STATE_DIR / "server"
_lease_numbers = itertools.count()


def hostname() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclass(frozen=True)
class ServerPaths:
    root: Path

    @classmethod
    def for_this_host(cls, base: Path = SERVER_STATE_ROOT) -> ServerPaths:
        return cls(Path(base) / hostname())

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def history(self) -> Path:
        return self.root / "history.jsonl"

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    @property
    def answered(self) -> Path:
        return self.root / "answered"

    @property
    def pinned(self) -> Path:
        return self.root / "pinned"

    @property
    def turnstile(self) -> Path:
        return self.root / "gate.turnstile"

    @property
    def room(self) -> Path:
        return self.root / "gate.room"

    @property
    def exclusive_marker(self) -> Path:
        return self.root / "exclusive.json"

    def make(self) -> None:
        self.leases.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class ProcessRef:
    """A process named by pid and start time, so a reused pid is never mistaken for it."""

    pid: int
    create_time: float

    @classmethod
    def current(cls) -> ProcessRef:
        return cls.of(os.getpid())

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid, psutil.Process(pid).create_time())

    def process(self) -> psutil.Process | None:
        """The live process, or None if it exited (zombies count as exited)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.05:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return None
        except psutil.AccessDenied:
            return psutil.Process(self.pid)

    def alive(self) -> bool:
        return self.process() is not None


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def note_answer(note: Path, instance_id: str) -> None:
    """Record that the server `instance_id` answered its health check just now."""
    with contextlib.suppress(FileNotFoundError):
        if note.read_text() == instance_id:
            os.utime(note)  # the same instance: its mtime is the news
            return
    atomic_write_bytes(note, instance_id.encode(), durable=False)


def answered_recently(note: Path, instance_id: str, within_s: float) -> bool:
    """True when the server `instance_id` answered a job's health check within `within_s`."""
    try:
        return note.read_text() == instance_id and time.time() - note.stat().st_mtime <= within_s
    except FileNotFoundError:
        return False


def append_history(paths: ServerPaths, event: str, **fields) -> None:
    """One JSON line per lifecycle event; O_APPEND keeps concurrent small lines whole."""
    paths.root.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"event": event, "at": now_iso(), "host": hostname(), **fields})
    with open(paths.history, "a") as f:
        f.write(line + "\n")


def read_history(paths: ServerPaths) -> list[dict]:
    try:
        return [json.loads(line) for line in paths.history.read_text().splitlines() if line]
    except FileNotFoundError:
        return []


class Lease:
    """A heartbeat file that keeps the server from idle-stopping while this process uses it."""

    def __init__(
        self,
        paths: ServerPaths,
        *,
        ttl_s: float,
        run_token: str | None,
        kind: str,
        wants: str | None = None,
    ):
        self.paths = paths
        self.ttl_s = ttl_s
        me = ProcessRef.current()
        self.path = paths.leases / f"{hostname()}-{me.pid}-{next(_lease_numbers)}.lease"
        self.content = {
            "host": hostname(),
            "pid": me.pid,
            "create_time": me.create_time,
            "run_token": run_token,
            "kind": kind,
            # The fingerprint of the server this job needs: a job still waiting for another
            # server than the running one is not one of its users.
            "wants": wants,
            "since": now_iso(),
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        self.paths.make()
        self._write()
        self._thread = threading.Thread(target=self._heartbeat, name="eaglepipe-lease", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        interval = max(self.ttl_s / 4, 0.05)
        while not self._stop.wait(interval):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self._write()
            reap_started_children()

    def _write(self) -> None:
        # Not fsynced: a lease means a live process, and a crash ends the process and the lease
        # together. An fsync here waits for the chunks other jobs queue on the same disk: 0.22 s
        # median, 0.64 s at worst beside two chunk writers (BENCHMARKS.md, "job start").
        atomic_write_json(self.path, self.content, durable=False)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)


# Supervisors this process started: polled so they never linger as zombies of a long job.
STARTED_CHILDREN: dict[int, object] = {}


def reap_started_children() -> None:
    for pid, popen in list(STARTED_CHILDREN.items()):
        if popen.poll() is not None:
            STARTED_CHILDREN.pop(pid, None)


def lease_is_live(content: dict, mtime: float, ttl_s: float) -> bool:
    if time.time() - mtime > ttl_s:
        return False
    if content.get("host") != hostname():
        return True
    return ProcessRef(int(content["pid"]), float(content["create_time"])).alive()


def live_leases(paths: ServerPaths, ttl_s: float, *, exclude: Path | None = None) -> list[dict]:
    """The live leases, each with its file name under `file`."""
    found = []
    for path in sorted(paths.leases.glob("*.lease")):
        if exclude is not None and path == exclude:
            continue
        content = read_json(path)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if content and lease_is_live(content, mtime, ttl_s):
            found.append({**content, "file": path.name})
    return found


def remove_dead_leases(paths: ServerPaths, ttl_s: float) -> None:
    """Delete lease files of exited processes on this host and very old ones from anywhere."""
    for path in paths.leases.glob("*.lease"):
        content = read_json(path)
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            continue
        stale = age > max(10 * ttl_s, 600)
        if content and content.get("host") == hostname():
            stale = stale or not ProcessRef(content["pid"], content["create_time"]).alive()
        if stale:
            path.unlink(missing_ok=True)


def pinned_instance(paths: ServerPaths) -> str | None:
    try:
        return paths.pinned.read_text().strip() or None
    except FileNotFoundError:
        return None


class RequestGate:
    """A readers-writer gate over the server, built from two flock files.

    Shared users (extract jobs) hold `room` shared for their whole lease, entering through
    `turnstile`. An exclusive user (a validation spot check) takes `turnstile` exclusively, so
    no new shared user gets in, then waits for `room` exclusively, which it gets once every
    shared user has left: from then on it is the only client with requests in flight. flock
    locks die with their process, so a killed holder never blocks the gate.

    Shared users that poll `exclusive_waiting()` between requests and call `yield_to_exclusive`
    (with nothing in flight) let a spot check in without waiting for their whole job to end.
    """

    def __init__(self, paths: ServerPaths):
        self.paths = paths
        self._room_fd: int | None = None
        self._turnstile_fd: int | None = None

    def _open(self, path: Path) -> int:
        self.paths.root.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    @staticmethod
    def _lock(fd: int, mode: int, waiting_message: str) -> None:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        started = time.monotonic()
        last_print = -1e9
        while True:
            waited = time.monotonic() - started
            if waited - last_print >= 10:
                print(f"{waiting_message} ({waited:.0f}s)", file=sys.stderr, flush=True)
                last_print = waited
            time.sleep(0.1)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                continue

    def enter_shared(self) -> None:
        turnstile = self._open(self.paths.turnstile)
        try:
            self._lock(turnstile, fcntl.LOCK_SH, "waiting for an exclusive spot check to finish")
            self._room_fd = self._open(self.paths.room)
            fcntl.flock(self._room_fd, fcntl.LOCK_SH)
        finally:
            os.close(turnstile)

    def leave_shared(self) -> None:
        if self._room_fd is not None:
            os.close(self._room_fd)
            self._room_fd = None

    def acquire_exclusive(self) -> None:
        self._turnstile_fd = self._open(self.paths.turnstile)
        self._lock(
            self._turnstile_fd, fcntl.LOCK_EX, "waiting for another exclusive user of the server"
        )
        me = ProcessRef.current()
        atomic_write_json(
            self.paths.exclusive_marker, {"pid": me.pid, "create_time": me.create_time}
        )
        self._room_fd = self._open(self.paths.room)
        self._lock(
            self._room_fd,
            fcntl.LOCK_EX,
            "waiting for the other jobs using the server to finish their requests",
        )

    def release_exclusive(self) -> None:
        self.leave_shared()
        if self._turnstile_fd is not None:
            self.paths.exclusive_marker.unlink(missing_ok=True)
            os.close(self._turnstile_fd)
            self._turnstile_fd = None

    def exclusive_waiting(self) -> bool:
        """True while another process holds or waits for exclusive use."""
        marker = read_json(self.paths.exclusive_marker)
        if not marker or marker.get("pid") == os.getpid():
            return False
        return ProcessRef(marker["pid"], marker["create_time"]).alive()

    def yield_to_exclusive(self) -> bool:
        """Step out and back in if a spot check waits; call only with no request in flight."""
        if self._room_fd is None or not self.exclusive_waiting():
            return False
        self.leave_shared()
        self.enter_shared()
        return True

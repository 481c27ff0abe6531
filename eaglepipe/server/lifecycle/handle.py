"""The client's view of a running server: its handle, and liveness checks that never hang.

`server_lease` yields a `ServerHandle`. Its watchdog thread notices within about a second
when the server process is gone and within `unresponsive_after_s` when /health goes silent,
so a client fails with an error naming the supervisor PID and the log instead of hanging on
a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ...core.errors import PipelineError, ServerLost
from .leases import ProcessRef, RequestGate, note_answer

SUPERVISOR_MODULE = "eaglepipe.server.lifecycle.supervise"
PROBE_TIMEOUT_S = 5.0
# After a request fails, how long to watch for the server process to be gone before blaming it.
DEATH_CONFIRM_S = 3.0
LOG_TAIL_LINES = 20

# Health probes go straight to the server, never through an http_proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """GET `url` straight to the server: (status, body). An answer that is not HTTP (another
    program on the port, or this very socket connected to itself: a port with no listener yet
    can do that on Linux, and reads back its own request line) is a URLError, like a refused
    connection."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except http.client.HTTPException as exc:
        raise urllib.error.URLError(exc) from None


def http_get_json(url: str, timeout_s: float) -> dict:
    _status, body = _http_get(url, timeout_s)
    return json.loads(body) if body.strip() else {}


def probe_health(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None if GET /health answers 200 in time, else why not."""
    try:
        status, _body = _http_get(f"{url}/health", timeout_s)
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
    return None if status == 200 else f"HTTP {status}"


def log_tail(path: str | os.PathLike, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def supervisor_process(state: dict) -> psutil.Process | None:
    """The state's supervisor if it is alive and really ours (pid, start time and command line)."""
    proc = ProcessRef(state["pid"], state["create_time"]).process()
    if proc is None:
        return None
    try:
        return proc if SUPERVISOR_MODULE in " ".join(proc.cmdline()) else None
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def describe_server(state: dict) -> str:
    return f"{state['engine']} server (supervisor PID {state['pid']}, port {state['port']})"


@dataclass
class ServerHandle:
    """A running server as a client sees it, plus the helpers that keep a client from hanging."""

    url: str
    dump_dir: Path
    info: dict
    state: dict
    gate: RequestGate | None = None
    # Where the watchdog records each answer of /health (leases.note_answer), for jobs to come.
    answered_note: Path | None = None
    # How the lease had `info` (lifecycle.JOINED_*): a job's start-up, read in its manifest.
    joined_via: str = ""
    _watchdog: Watchdog | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.state["pid"]

    @property
    def log_path(self) -> Path:
        return Path(self.state["log"])

    def _dead_error(self) -> ServerLost:
        return ServerLost(
            f"{describe_server(self.state)} exited while in use; log: {self.log_path}; "
            f"last lines:\n{log_tail(self.log_path)}"
        )

    def _unresponsive_error(self, seconds: float, why: str) -> ServerLost:
        return ServerLost(
            f"{describe_server(self.state)} stopped answering {self.url}/health for {seconds:.0f}s "
            f"({why}); log: {self.log_path}; last lines:\n{log_tail(self.log_path)}"
        )

    def raise_if_dead(self, probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        """Raise PipelineError at once if the server process is gone or /health does not answer."""
        if supervisor_process(self.state) is None:
            raise self._dead_error()
        why = probe_health(self.url, probe_timeout_s)
        if why is not None:
            if supervisor_process(self.state) is None:
                raise self._dead_error()
            raise self._unresponsive_error(probe_timeout_s, why)

    def start_watchdog(self, *, unresponsive_after_s: float = 20.0) -> None:
        if self._watchdog is None:
            self._watchdog = Watchdog(self, unresponsive_after_s)
            self._watchdog.start()

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    @property
    def failure(self) -> PipelineError | None:
        """Set by the watchdog (within about a second of a death) and never cleared."""
        return self._watchdog.failure if self._watchdog is not None else None

    def check(self) -> None:
        """Cheap: raise the watchdog's error if the server died or stopped answering."""
        if self.failure is not None:
            raise self.failure

    async def guard(self, awaitable, *, poll_s: float = 0.25):
        """Await `awaitable`, but fail with the watchdog's error as soon as the server dies."""
        self.start_watchdog()
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    break
                self.check()
        finally:
            if not task.done():
                task.cancel()
        error = task.exception()
        if error is not None and not isinstance(error, PipelineError):
            # A dropped connection is usually the server dying: name the death, not the socket.
            await asyncio.to_thread(self._raise_if_gone_soon, DEATH_CONFIRM_S)
        return task.result()

    def _raise_if_gone_soon(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if supervisor_process(self.state) is None:
                raise self._dead_error()
            time.sleep(0.1)

    def exclusive_waiting(self) -> bool:
        """True while a spot check waits for exclusive use: stop sending, drain, then yield."""
        return self.gate is not None and self.gate.exclusive_waiting()

    def yield_to_exclusive(self) -> bool:
        """With no request in flight: let a waiting spot check run, return when it is done."""
        return self.gate is not None and self.gate.yield_to_exclusive()


def server_alive(handle: ServerHandle) -> bool:
    """True while the handle's server process lives; raises the detailed error once it is gone.

    The extraction client calls this every second from its watchdog; raising (rather than
    returning False) lets its failure name the supervisor PID and the log with its last lines.
    """
    if supervisor_process(handle.state) is None:
        raise handle._dead_error()
    return True


class Watchdog(threading.Thread):
    """Checks the supervisor every second and /health continuously; records the first failure."""

    def __init__(self, handle: ServerHandle, unresponsive_after_s: float):
        super().__init__(name="eaglepipe-server-watchdog", daemon=True)
        self.handle = handle
        self.unresponsive_after_s = unresponsive_after_s
        self.failure: PipelineError | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        last_answer = time.monotonic()
        probe_timeout = min(PROBE_TIMEOUT_S, self.unresponsive_after_s / 2)
        while not self._stop_event.is_set():
            if supervisor_process(self.handle.state) is None:
                self.failure = self.handle._dead_error()
                return
            why = probe_health(self.handle.url, probe_timeout)
            if why is None:
                last_answer = time.monotonic()
                self._note_answer()
            elif time.monotonic() - last_answer > self.unresponsive_after_s:
                if supervisor_process(self.handle.state) is None:
                    self.failure = self.handle._dead_error()
                else:
                    silent = time.monotonic() - last_answer
                    self.failure = self.handle._unresponsive_error(silent, why)
                return
            self._stop_event.wait(1.0)

    def _note_answer(self) -> None:
        note = self.handle.answered_note
        if note is None:
            return
        # A courtesy to jobs to come: a full or read-only state directory must not end the watch.
        with contextlib.suppress(OSError, PipelineError):
            note_answer(note, self.handle.state["instance_id"])

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

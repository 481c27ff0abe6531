"""What every client of the hidden-state server runs beside its requests: a watchdog that fails
the job within seconds when the server dies or stops answering, and the retry backoff."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from ...core.errors import ServerLost

# How often the watchdog asks whether the server is alive, and how many consecutive failed
# health probes (on top of the lifecycle's process check) count as "stopped answering".
LIVENESS_INTERVAL_S = 1.0
HEALTH_PROBE_TIMEOUT_S = 4.0
HEALTH_FAILURES_FATAL = 3
BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 8.0


class TransientError(Exception):
    """A failure worth retrying with a new attempt number (reset, timeout, 5xx)."""


async def watch_server(
    url: str, is_alive: Callable[[], bool] | None, gate=None, what: str = "extraction"
) -> None:
    """Raise ServerLost as soon as the server process dies or stops answering health probes
    (runs beside a client's requests until cancelled).

    Probes use their own session: the request session's connections can all be busy with
    long requests, and a probe queued behind them would read as a dead server.
    """
    failures = 0
    probe_timeout = aiohttp.ClientTimeout(total=HEALTH_PROBE_TIMEOUT_S)
    async with aiohttp.ClientSession() as session:
        while True:
            await asyncio.sleep(LIVENESS_INTERVAL_S)
            if is_alive is not None and not await asyncio.to_thread(is_alive):
                raise ServerLost(f"the server at {url} died during {what}")
            if gate is not None and hasattr(gate, "check"):
                gate.check()  # the lifecycle's own watchdog verdict, if it has one
            try:
                async with session.get(f"{url}/health", timeout=probe_timeout) as resp:
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            failures = 0 if ok else failures + 1
            if failures >= HEALTH_FAILURES_FATAL:
                raise ServerLost(
                    f"the server at {url} stopped answering /health "
                    f"({failures} probes in a row failed)" + _log_tail_of(gate)
                )


def liveness_check(handle) -> Callable[[], bool] | None:
    """The lifecycle's process check for a server handle (raises naming the PID and log)."""
    if not getattr(handle, "state", None):
        return None
    import psutil

    from .shared_server import server_alive

    engine_pid = handle.state.get("engine_pid")

    def alive() -> bool:
        server_alive(handle)
        # The engine can die a moment before its supervisor notices and exits.
        if engine_pid is not None:
            try:
                gone = psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                raise ServerLost(
                    f"the server engine (PID {engine_pid}) at {handle.url} exited during "
                    f"extraction" + _log_tail_of(handle)
                )
        return True

    return alive


def _log_tail_of(handle) -> str:
    """`; log: PATH; last lines: ...` for a lifecycle handle, else nothing."""
    log = getattr(handle, "log_path", None)
    if not log:
        return ""
    from .handle import log_tail

    return f"; log: {log}; last lines:\n{log_tail(log)}"

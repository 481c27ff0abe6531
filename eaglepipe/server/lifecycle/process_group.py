"""A server's process group: starting it under the supervisor, waiting for it to answer,
finding its members safely and stopping them all. Every server the pipeline starts (the shared
hidden-state server and the live-acceptance servers) goes through these."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psutil

from ...core.errors import PipelineError
from .handle import SUPERVISOR_MODULE, log_tail
from .leases import STARTED_CHILDREN, reap_started_children
from .ports import wait_port_free

# Every process of a server carries its instance id in this variable: how a stop recognises them.
INSTANCE_ENV = "EAGLEPIPE_SERVER_INSTANCE"
PROGRESS_EVERY_S = 5.0
# SIGKILL follows SIGTERM after this long; the supervisor escalates sooner (ENGINE_STOP_GRACE_S).
STOP_GRACE_S = 20.0
PORT_RELEASE_TIMEOUT_S = 15.0
T = TypeVar("T")


def start_supervised(
    engine_argv: list[str],
    *,
    state_dir: Path,
    instance_id: str,
    idle_timeout_s: float,
    lease_ttl_s: float,
    log_path: Path,
    extra_env: dict[str, str],
    dump_dir: Path | None = None,
) -> tuple[subprocess.Popen, list[str]]:
    """Start `engine_argv` under the supervisor, in a session (a process group) of its own, with
    stdin closed, unbuffered output appended to `log_path`, and every process marked with the
    instance id. Returns the supervisor process and its argv.

    The supervisor stops the group after `idle_timeout_s` without a live lease under
    `state_dir` (leases count as live for `lease_ttl_s`), and removes `dump_dir` on its way out.
    """
    argv = [
        sys.executable,
        "-u",
        "-m",
        SUPERVISOR_MODULE,
        "--state-dir",
        str(state_dir),
        "--idle-timeout",
        str(idle_timeout_s),
        "--lease-ttl",
        str(lease_ttl_s),
    ]
    if dump_dir is not None:
        argv += ["--dump-dir", str(dump_dir)]
    argv += ["--instance-id", instance_id, "--", *engine_argv]
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1", INSTANCE_ENV: instance_id}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    STARTED_CHILDREN[proc.pid] = proc
    return proc, argv


def wait_healthy(
    proc: subprocess.Popen,
    ready: Callable[[], T | None],
    *,
    what: str,
    timeout_s: float,
    log_path: str | os.PathLike,
    before_failing: Callable[[str], None] | None = None,
) -> T:
    """Poll `ready()` until it returns something (the server answers), with progress lines.

    A server that exits first, or is not ready within `timeout_s` (server.health_timeout_s),
    is one error naming it (`what`) with its log tail; `before_failing(reason)` runs first
    (stopping what is left of the group).
    """

    def fail(reason: str):
        if before_failing is not None:
            before_failing(reason)
        raise PipelineError(f"{what} {reason}; last lines of {log_path}:\n{log_tail(log_path)}")

    started = time.monotonic()
    last_print = 0.0
    while True:
        code = proc.poll()
        if code is not None:
            fail(f"exited with code {code} before becoming healthy")
        answer = ready()
        if answer is not None:
            elapsed = time.monotonic() - started
            print(f"{what} is healthy after {elapsed:.0f}s", file=sys.stderr, flush=True)
            return answer
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            fail(f"was not healthy within {timeout_s:g}s (server.health_timeout_s)")
        if elapsed - last_print >= PROGRESS_EVERY_S:
            print(
                f"waiting for {what}: {elapsed:.0f}s / {timeout_s:g}s, log: {log_path}",
                file=sys.stderr,
                flush=True,
            )
            last_print = elapsed
        time.sleep(0.5)


def group_members(
    pgid: int, started_after: float, instance_id: str | None = None
) -> list[psutil.Process]:
    """Live processes of a server's process group.

    A member must be younger than the supervisor and, given `instance_id`, carry the instance
    marker in its environment: a recycled pid or process group is never taken for ours.
    """
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) != pgid or proc.create_time() < started_after - 1:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if instance_id is not None and proc.environ().get(INSTANCE_ENV) != instance_id:
                continue
            members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied:
            continue
    return members


def stop_members(pgid: int, started_after: float, instance_id: str, grace_s: float) -> None:
    """SIGTERM every process of the server's group, SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        members = group_members(pgid, started_after, instance_id)
        if not members:
            return
        for proc in members:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                continue
        deadline = time.monotonic() + wait_s
        while group_members(pgid, started_after, instance_id) and time.monotonic() < deadline:
            reap_started_children()
            time.sleep(0.2)


def stop_group(pgid: int, started_after: float, instance_id: str, *, host: str, port: int) -> bool:
    """Stop the server's whole process group, reap what this process started, and wait until
    its port is free again. Returns whether it is."""
    stop_members(pgid, started_after, instance_id, STOP_GRACE_S)
    reap_started_children()
    return wait_port_free(host, port, PORT_RELEASE_TIMEOUT_S)


class TermSignal:
    """Whether `sigterm_raises` turned a SIGTERM into the SystemExit being raised."""

    received = False


@contextmanager
def sigterm_raises() -> Iterator[TermSignal]:
    """Turn SIGTERM into SystemExit inside the block, so a cancelled job (Snakemake sends
    SIGTERM) unwinds like on Ctrl-C and stops the servers it holds.

    Only where nobody else handles SIGTERM, and only in the main thread (Python's rule).
    """
    flag = TermSignal()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield flag
        return

    def on_term(signum, frame):
        flag.received = True
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

"""Server lifecycle: one shared server per run and node, started on demand, never left behind.

    with server_lease(run) as handle:      # starts the server if none fits, else reuses it
        ...  requests to handle.url; handle.check() / await handle.guard(request) ...

- The first job that needs the server starts it under the node-local lock (`leases.py` has the
  layout of `.eaglepipe/server/<hostname>/`); every job holds a lease while it uses it.
- A healthy server with the same fingerprint (engine, model, layer ids, launch settings) is
  reused across jobs and runs; one with another fingerprint is stopped and replaced, unless
  other jobs still hold leases on it.
- The server runs under `eaglepipe.server.lifecycle.supervise` in its own process group, with the
  project's Python, unbuffered, logging to `logs/server/`. Stopping it stops the whole group
  (SIGTERM, SIGKILL after a grace period) and waits until the port is free.
- The server listens on `server.port`, or with null (the default) on a port drawn for this
  working directory (`ports.working_directory_port`), recorded in the state.
- A port held by a process this pipeline did not start is an error naming that process.
- `stop_if_started_by(run_token)` is what the Snakefile's onsuccess/onerror call; a job
  interrupted by SIGINT/SIGTERM stops the server its run started if no other job uses it; an
  idle supervisor stops itself (the last resort after a killed workflow).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock
import psutil

from ...core import config as cfg
from ...core.atomic import atomic_write_json
from ...core.errors import PipelineError
from ...core.run import RunSpec
from .handle import (
    PROBE_TIMEOUT_S,
    ServerHandle,
    describe_server,
    http_get_json,
    probe_health,
    server_alive,
    supervisor_process,
)
from .identity import CAPTURE, server_purpose
from .launch import engine_command, launch_settings, server_fingerprint
from .leases import (
    Lease,
    ProcessRef,
    RequestGate,
    ServerPaths,
    answered_recently,
    append_history,
    hostname,
    live_leases,
    now_iso,
    pinned_instance,
    read_history,
    read_json,
    remove_dead_leases,
)
from .ports import (
    describe_port_holders,
    exposure_warning,
    port_holders,
    port_is_free,
    working_directory_port,
)
from .process_group import (
    STOP_GRACE_S,
    group_members,
    sigterm_raises,
    start_supervised,
    stop_group,
    wait_healthy,
)
from .supervise import owner_file

__all__ = [
    "RUN_TOKEN_ENV",
    "ServerHandle",
    "current_run_token",
    "engine_command",
    "new_run_token",
    "server_alive",
    "server_fingerprint",
    "server_lease",
    "server_status",
    "start_server",
    "stop_if_started_by",
    "stop_server",
]

RUN_TOKEN_ENV = "EAGLEPIPE_RUN_TOKEN"
SERVER_LOG_DIR = cfg.LOG_DIR / "server"
# In the command line of every process of a pipeline server: its supervisor and engine.
SERVER_PACKAGE = "eaglepipe.server."
# How long a running server that does not answer /health gets before it is replaced.
REUSE_PATIENCE_S = 30.0
# A server that answered another job's health check this recently is taken as answering. The
# watchdogs probe about every 1-2 s (SGLang's /health answers a second after its probe at the
# earliest), so a server in use keeps the note younger than this.
ANSWERED_FRESH_S = 5.0
# How a lease had the server's info (ServerHandle.joined_via; extraction manifests record it).
JOINED_STARTED = "started"
JOINED_ANSWERED_NOTE = "answered note"
JOINED_ASKED = "server_info"


def new_run_token() -> str:
    """A token naming one workflow run; the Snakefile exports it as EAGLEPIPE_RUN_TOKEN."""
    return f"run-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(4)}"


def current_run_token() -> str:
    """The run's token, or one naming this process when it runs outside a workflow."""
    token = os.environ.get(RUN_TOKEN_ENV)
    if token:
        return token
    me = ProcessRef.current()
    return f"process-{hostname()}-{me.pid}-{int(me.create_time)}"


# ---------------------------------------------------------------- lock, start, stop


@contextmanager
def _locked(paths: ServerPaths, wait_s: float | None = None) -> Iterator[None]:
    """The node-local decision lock; progress lines while another job starts the server."""
    paths.make()
    lock = filelock.FileLock(paths.lock)
    started = time.monotonic()
    while True:
        try:
            lock.acquire(timeout=10)
            break
        except filelock.Timeout:
            waited = time.monotonic() - started
            if wait_s is not None and waited > wait_s:
                raise PipelineError(
                    f"gave up after {waited:.0f}s waiting for the server lock {paths.lock}"
                ) from None
            print(
                f"waiting for the server lock {paths.lock} "
                f"(another job is starting or stopping the server): {waited:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    try:
        yield
    finally:
        lock.release()


def _lock_wait_s(run: RunSpec) -> float:
    return run.server.health_timeout_s + 2 * STOP_GRACE_S + 60


def _remove_stale_dumps(dump_root: Path) -> None:
    """Remove dump dirs of this host's instances whose supervisor is gone (a dead run's dumps)."""
    for owner in dump_root.glob("*.owner.json"):
        content = read_json(owner)
        if not content or content.get("host") != hostname():
            continue
        if ProcessRef(content["pid"], content["create_time"]).alive():
            continue
        instance_dir = dump_root / owner.name.removesuffix(".owner.json")
        shutil.rmtree(instance_dir, ignore_errors=True)
        owner.unlink(missing_ok=True)


def _stop_group(state: dict, paths: ServerPaths, reason: str) -> None:
    """Stop the server's whole process group, wait for its port, and remove its traces."""
    group = state["pgid"], state["create_time"], state["instance_id"]
    if group_members(*group):
        print(f"stopping {describe_server(state)}: {reason}", file=sys.stderr, flush=True)
    port_free = stop_group(*group, host=state["host"], port=state["port"])
    shutil.rmtree(state["dump_dir"], ignore_errors=True)
    owner_file(Path(state["dump_dir"])).unlink(missing_ok=True)
    current = read_json(paths.state)
    if current and current.get("instance_id") == state["instance_id"]:
        paths.state.unlink(missing_ok=True)
    if pinned_instance(paths) == state["instance_id"]:
        paths.pinned.unlink(missing_ok=True)
    append_history(
        paths,
        "stop",
        pid=state["pid"],
        instance_id=state["instance_id"],
        reason=reason,
        port_free=port_free,
    )


def _server_info_if_healthy(state: dict, *, health_probe: bool = True) -> dict | None:
    """/server_info of the state's server if it answers as that very instance (and, with
    `health_probe`, its /health first: the readiness check while a server starts)."""
    if health_probe and probe_health(state["url"]) is not None:
        return None
    try:
        info = http_get_json(f"{state['url']}/server_info", PROBE_TIMEOUT_S)
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return None
    if state.get("engine") == "sglang":
        from ..sglang.recipe import pipeline_server_info

        info = pipeline_server_info(info)
    if info.get("instance_id", state["instance_id"]) != state["instance_id"]:
        return None
    return info


def _server_info_when_answering(state: dict, patience_s: float) -> dict | None:
    """Like `_server_info_if_healthy`, but a busy server gets `patience_s` to answer before it
    counts as hung (and is replaced): other jobs may be keeping it busy."""
    deadline = time.monotonic() + patience_s
    # A running SGLang's /server_info asks its scheduler (get_internal_state), so an answer
    # proves the server answers; its /health runs a one-token generation and answers no sooner
    # than a second later, a second every job's lease paid before its first request.
    health_probe = state.get("engine") != "sglang"
    while True:
        info = _server_info_if_healthy(state, health_probe=health_probe)
        if info is not None or time.monotonic() > deadline or supervisor_process(state) is None:
            return info
        print(
            f"{describe_server(state)} does not answer its health check yet; retrying",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(1.0)


def _info_if_answering_others(state: dict, paths: ServerPaths) -> dict | None:
    """The server's info as its start recorded it, when the server answered another job's
    watchdog within the last few seconds (its supervisor alive, checked by the caller): no
    round trip then. A running SGLang's /server_info waits for the scheduler's current batch,
    0.3-0.5 s of every job's start at full load (BENCHMARKS.md, "A job's whole start-up")."""
    if not answered_recently(paths.answered, state["instance_id"], ANSWERED_FRESH_S):
        return None
    return state.get("info")


def _adopt(state: dict, paths: ServerPaths, run_token: str, ttl_s: float) -> None:
    """A run that reuses a server whose starting run is over becomes the run that stops it."""
    owner = state.get("owner_run")
    if state.get("pinned") or owner == run_token:
        return
    if any(other.get("run_token") == owner for other in live_leases(paths, ttl_s)):
        return
    state["owner_run"] = run_token
    atomic_write_json(paths.state, state)


def _ensure_server(
    run: RunSpec, paths: ServerPaths, run_token: str, lease: Lease, purpose: str = CAPTURE
) -> tuple[dict, dict, str]:
    """Under the lock: reuse, replace or start the server. Returns (state, server_info, how the
    info was had: JOINED_STARTED, JOINED_ANSWERED_NOTE or JOINED_ASKED)."""
    server = run.server
    ttl_s = server.lease_ttl_s
    purpose = server_purpose(run, purpose)
    fingerprint = server_fingerprint(run, purpose)
    remove_dead_leases(paths, ttl_s)
    state = read_json(paths.state)
    if state is not None:
        if supervisor_process(state) is None:
            _stop_group(state, paths, "stale state: its supervisor is gone")
        elif state["fingerprint"] == fingerprint:
            info = _info_if_answering_others(state, paths)
            joined_via = JOINED_ASKED if info is None else JOINED_ANSWERED_NOTE
            if info is None:
                info = _server_info_when_answering(state, max(ttl_s, REUSE_PATIENCE_S))
            if info is not None:
                _adopt(state, paths, run_token, ttl_s)
                append_history(paths, "reuse", pid=state["pid"], run_token=run_token)
                return state, info, joined_via
            _stop_group(state, paths, "it does not answer its health check")
        else:
            running = (state.get("settings") or {}).get("purpose", CAPTURE)
            others = users_of(state, live_leases(paths, ttl_s, exclude=lease.path))
            if others:
                holders = ", ".join(f"PID {other['pid']}" for other in others)
                what = (
                    f"is a {running} server, this job needs a {purpose} one,"
                    if running != purpose
                    else f"runs with other settings (fingerprint {state['fingerprint'][:12]}, "
                    f"this config needs {fingerprint[:12]})"
                )
                raise PipelineError(
                    f"{describe_server(state)} {what} and is in use by {holders}: wait for "
                    "them, or stop it with `eaglepipe server stop`"
                )
            why = "the configuration changed (different fingerprint)"
            if running != purpose:
                # Regeneration is over and extraction begins (or the other way round).
                why = f"a {purpose} server replaces this {running} server"
            _stop_group(state, paths, why)
    return (*_start(run, paths, run_token, fingerprint, purpose), JOINED_STARTED)


def users_of(state: dict, leases: list[dict]) -> list[dict]:
    """The leases that may be using the server of `state`: those of jobs that want it (or say
    nothing of what they want). Jobs that want another server are not its users: extraction
    jobs that start together after regeneration all want the capture server, and none of them
    keeps the generation server in use for the others."""
    return [lease for lease in leases if lease.get("wants") in (None, state["fingerprint"])]


def wanted_fingerprint(run: RunSpec, purpose: str) -> str:
    """The fingerprint of the server a job of `purpose` needs (what its lease records)."""
    return server_fingerprint(run, server_purpose(run, purpose))


def _new_instance_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _start(
    run: RunSpec, paths: ServerPaths, run_token: str, fingerprint: str, purpose: str = CAPTURE
) -> tuple[dict, dict]:
    server = run.server
    host = server.host
    # null: this working directory's own port (the state records it for every job).
    port = server.port or working_directory_port(host, paths.root)
    warning = exposure_warning(host, port)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    from ..handoff.dumps import prepare_dump_dir

    dump_root = prepare_dump_dir(
        run.server.handoff_root, what="server.dump_root", refuse_open_mode=True
    ).resolve()
    _remove_stale_dumps(dump_root)
    if not port_is_free(host, port):
        hint = ""
        if any(SERVER_PACKAGE in h.cmdline for h in port_holders(port)):
            hint = (
                f" (an eaglepipe server not recorded in {paths.root}: another working "
                "directory's, or one whose state file was deleted)"
            )
        raise PipelineError(
            f"cannot start the server: {describe_port_holders(host, port)}{hint}, which this "
            "pipeline did not start and leaves running: stop it, or set server.port to a free "
            "port (or to null: a port of this working directory's own)"
        )
    instance_id = _new_instance_id()
    dump_dir = prepare_dump_dir(dump_root / instance_id)
    engine_argv, engine_env = engine_command(
        run, host=host, port=port, dump_dir=dump_dir, instance_id=instance_id, purpose=purpose
    )
    log_path = (SERVER_LOG_DIR / f"{hostname()}-{instance_id}.log").resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc, argv = start_supervised(
        engine_argv,
        state_dir=paths.root.resolve(),
        instance_id=instance_id,
        idle_timeout_s=server.idle_timeout_s,
        lease_ttl_s=server.lease_ttl_s,
        log_path=log_path,
        extra_env=engine_env,
        dump_dir=dump_dir,
    )
    supervisor = ProcessRef.of(proc.pid)
    atomic_write_json(
        owner_file(dump_dir),
        {"host": hostname(), "pid": proc.pid, "create_time": supervisor.create_time},
    )
    state = {
        "pid": proc.pid,
        "pgid": proc.pid,
        "create_time": supervisor.create_time,
        "host": host,
        "port": port,
        "url": f"http://{host}:{port}",
        "engine": server.engine,
        "fingerprint": fingerprint,
        "settings": launch_settings(run, purpose),
        "instance_id": instance_id,
        "dump_dir": str(dump_dir),
        "log": str(log_path),
        "node": hostname(),
        "started_by": run_token,
        "owner_run": run_token,
        "pinned": False,
        "lease_ttl_s": server.lease_ttl_s,
        "idle_timeout_s": server.idle_timeout_s,
        "started_at": now_iso(),
        "argv": argv,
    }
    atomic_write_json(paths.state, state)
    append_history(
        paths,
        "start",
        pid=proc.pid,
        create_time=supervisor.create_time,
        instance_id=instance_id,
        run_token=run_token,
        port=port,
    )
    print(
        f"started {server.engine} server: supervisor pid {proc.pid}, port {port}, log {log_path}",
        file=sys.stderr,
        flush=True,
    )
    info = wait_healthy(
        proc,
        lambda: _server_info_if_healthy(state),
        what=describe_server(state),
        timeout_s=server.health_timeout_s,
        log_path=state["log"],
        before_failing=lambda reason: _stop_group(state, paths, f"start failed: {reason}"),
    )
    engine_children = psutil.Process(proc.pid).children()
    state["engine_pid"] = engine_children[0].pid if engine_children else None
    state["ready_at"] = now_iso()
    state["info"] = info
    atomic_write_json(paths.state, state)
    append_history(paths, "ready", pid=proc.pid, instance_id=instance_id)
    return state, info


# ---------------------------------------------------------------- public API


@contextmanager
def server_lease(
    run: RunSpec,
    *,
    run_token: str | None = None,
    exclusive: bool = False,
    paths: ServerPaths | None = None,
    purpose: str = CAPTURE,
) -> Iterator[ServerHandle]:
    """Hold the node's server for the block, starting it if no fitting one runs.

    exclusive=True (validation spot checks) waits until no other job has requests in flight
    and keeps them out until the block ends. Shared users keep the gate for the whole block;
    those that call `handle.yield_to_exclusive()` between requests let a spot check in sooner.
    `purpose` (identity.py): `generation` for regeneration, which with SGLang is a server of
    its own, without the capture.
    """
    token = run_token or current_run_token()
    paths = paths or ServerPaths.for_this_host()
    ttl_s = run.server.lease_ttl_s
    lease = Lease(
        paths,
        ttl_s=ttl_s,
        run_token=token,
        kind="exclusive" if exclusive else "shared",
        wants=wanted_fingerprint(run, purpose),
    )
    gate = RequestGate(paths)
    handle: ServerHandle | None = None
    interrupted = False
    with sigterm_raises() as term:
        lease.acquire()
        try:
            with _locked(paths, _lock_wait_s(run)):
                state, info, joined_via = _ensure_server(run, paths, token, lease, purpose)
            handle = ServerHandle(
                url=state["url"],
                dump_dir=Path(state["dump_dir"]),
                info=info,
                state=state,
                gate=gate,
                answered_note=paths.answered,
                joined_via=joined_via,
            )
            if exclusive:
                gate.acquire_exclusive()
            else:
                gate.enter_shared()
            handle.start_watchdog(unresponsive_after_s=max(ttl_s, 10.0))
            yield handle
        except KeyboardInterrupt:
            interrupted = True
            raise
        except SystemExit:
            interrupted = term.received
            raise
        finally:
            if handle is not None:
                handle.stop_watchdog()
            gate.release_exclusive()
            lease.release()
            if interrupted:
                _stop_after_interrupt(paths, token, ttl_s)


def _stop_after_interrupt(paths: ServerPaths, run_token: str, ttl_s: float) -> None:
    """An interrupted job stops the server its run started, unless other jobs still use it."""
    with _locked(paths):
        state = read_json(paths.state)
        if not state or state.get("pinned") or state.get("owner_run") != run_token:
            return
        if live_leases(paths, ttl_s):
            return
        _stop_group(state, paths, "the job using it was interrupted and no other job uses it")


def stop_if_started_by(run_token: str, *, paths: ServerPaths | None = None) -> bool:
    """Stop this node's server if `run_token`'s run started (or adopted) it. For onsuccess/onerror.

    A server started by hand (`eaglepipe server start`) is left running. Returns True if stopped.
    """
    paths = paths or ServerPaths.for_this_host()
    if not paths.state.exists():
        return False
    with _locked(paths):
        state = read_json(paths.state)
        if not state:
            return False
        if supervisor_process(state) is None:
            _stop_group(state, paths, "stale state: its supervisor is gone")
            return False
        if state.get("pinned") or state.get("owner_run") != run_token:
            return False
        _stop_group(state, paths, f"the run {run_token} that started it ended")
        return True


def stop_server(*, paths: ServerPaths | None = None) -> dict | None:
    """Stop this node's server, whoever started it (it is ours: the state file names it)."""
    paths = paths or ServerPaths.for_this_host()
    if not paths.root.is_dir():  # never started here (not a run directory): leave no trace
        return None
    with _locked(paths):
        state = read_json(paths.state)
        if not state:
            return None
        _stop_group(state, paths, "stopped by hand (eaglepipe server stop)")
        return state


def start_server(
    run: RunSpec, *, paths: ServerPaths | None = None, purpose: str = CAPTURE
) -> ServerHandle:
    """Start (or reuse) the server and pin it: it stays up until `stop_server`, never idles out."""
    paths = paths or ServerPaths.for_this_host()
    lease = Lease(
        paths,
        ttl_s=run.server.lease_ttl_s,
        run_token=None,
        kind="manual",
        wants=wanted_fingerprint(run, purpose),
    )
    lease.acquire()
    try:
        with _locked(paths, _lock_wait_s(run)):
            state, info, _ = _ensure_server(run, paths, current_run_token(), lease, purpose)
            paths.pinned.write_text(state["instance_id"] + "\n")
            state["pinned"] = True
            atomic_write_json(paths.state, state)
    finally:
        lease.release()
    return ServerHandle(url=state["url"], dump_dir=Path(state["dump_dir"]), info=info, state=state)


def server_status(*, paths: ServerPaths | None = None) -> dict:
    """What `eaglepipe server status` shows: the state, liveness, health, leases and starts."""
    paths = paths or ServerPaths.for_this_host()
    state = read_json(paths.state)
    history = read_history(paths)
    status = {
        "state_dir": str(paths.root),
        "state": state,
        "running": False,
        "healthy": False,
        "starts": sum(1 for event in history if event["event"] == "start"),
    }
    if state is None:
        return status
    status["running"] = supervisor_process(state) is not None
    if status["running"]:
        status["health"] = probe_health(state["url"]) or "ok"
        status["healthy"] = status["health"] == "ok"
        status["uptime_s"] = time.time() - state["create_time"]
    status["leases"] = live_leases(paths, state["lease_ttl_s"])
    from ..handoff.dumps import handoff_usage

    status["handoff"] = handoff_usage(state["dump_dir"])
    return status

"""Server lifecycle with real processes: the reference server on a tiny Llama, on free ports.

Every test runs in its own working directory (state under .eaglepipe/server/<host>/, logs under
logs/server/) and kills every process group it started in teardown, whatever happened.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil
import pytest
import yaml
from conftest import REPO_ROOT, free_port

from eaglepipe.core.config import validate_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.ops.cli import EXIT_NOT_RUNNING
from eaglepipe.ops.cli import main as cli_main
from eaglepipe.server.lifecycle import ports, shared_server
from eaglepipe.server.lifecycle.leases import (
    Lease,
    ServerPaths,
    hostname,
    live_leases,
    read_history,
    read_json,
)
from eaglepipe.server.lifecycle.ports import port_is_free
from eaglepipe.server.lifecycle.shared_server import server_lease, stop_if_started_by

PYTHON = sys.executable
WAIT_S = 90  # generous bound on waiting for a condition; never an assertion on duration

# A job as Snakemake would run it: its own process, holding a lease while it works.
JOB = textwrap.dedent(
    """
    import json, sys, time, urllib.request, uuid
    from pathlib import Path
    from eaglepipe.core.run import load_run
    from eaglepipe.server.lifecycle.shared_server import server_lease

    run, mode, out = load_run(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    if len(sys.argv) > 4:  # the light stand-in engine, for tests of the lifecycle mechanics
        from eaglepipe.server.lifecycle import shared_server
        fake = sys.argv[4]
        shared_server.engine_command = lambda run, *, host, port, dump_dir, instance_id, purpose: (
            [sys.executable, "-u", fake, host, str(port), instance_id], {})
    with server_lease(run) as handle:
        payload = {"input_ids": [5, 6, 7], "rid": f"eaglepipe-{uuid.uuid4().hex[:12]}-0-0",
                   "sampling_params": {"max_new_tokens": 0}}
        request = urllib.request.Request(handle.url + "/generate", json.dumps(payload).encode(),
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        (out / "holding").write_text(json.dumps({"pid": handle.pid, "answer": answer}))
        if mode == "yield":
            while not handle.exclusive_waiting():
                time.sleep(0.05)
            (out / "yielded").write_text("")
            handle.yield_to_exclusive()
            (out / "resumed").write_text("")
        while not (out / "finish").exists():
            handle.check()
            time.sleep(0.05)
        (out / "left").write_text("")  # still inside the lease: the gate is not yet released
    """
)

# A stand-in engine that starts in a fraction of a second (aiohttp only, no torch): for the tests
# of process handling, where the reference server's model load would only add minutes.
FAKE_ENGINE = textwrap.dedent(
    """
    import sys
    from aiohttp import web

    host, port, instance_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    async def health(request):
        return web.Response()

    async def server_info(request):
        return web.json_response({"engine": "fake", "instance_id": instance_id})

    async def generate(request):
        body = await request.json()
        return web.json_response({"meta_info": {"prompt_tokens": len(body["input_ids"])}})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/server_info", server_info),
                    web.post("/generate", generate)])
    print(f"fake engine on {host}:{port}", flush=True)
    web.run_app(app, host=host, port=port, print=None)
    """
)


def wait_for(condition, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def starts(paths: ServerPaths) -> list[dict]:
    return [e for e in read_history(paths) if e["event"] == "start"]


def group_alive(pgid: int) -> bool:
    return bool(shared_server.group_members(pgid, 0))


@pytest.fixture
def run(tmp_path, monkeypatch, tiny_llama_dir):
    """A working directory, a config for it, and teardown that leaves no process behind."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(shared_server.RUN_TOKEN_ENV, raising=False)
    monkeypatch.delenv("EAGLEPIPE_FAULT", raising=False)
    raw = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())
    raw["model"]["path"] = str(tiny_llama_dir)
    raw["server"].update(
        port=free_port(),
        device="cpu",
        dump_root=str(tmp_path / "dumps"),
        health_timeout_s=180,
        idle_timeout_s=600,
        lease_ttl_s=3,
    )
    ctx = Run(tmp_path, validate_config(raw))
    yield ctx
    for proc in ctx.processes:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for event in starts(ctx.paths):
        for member in shared_server.group_members(event["pid"], event["create_time"]):
            member.kill()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    def __init__(self, workdir: Path, config: dict):
        self.workdir = workdir
        self.config = config
        self.paths = ServerPaths.for_this_host()
        self.processes: list[subprocess.Popen] = []

    fake_engine: Path | None = None

    def use_fake_engine(self, monkeypatch) -> None:
        self.fake_engine = self.workdir / "fake_engine.py"
        self.fake_engine.write_text(FAKE_ENGINE)
        argv = [PYTHON, "-u", str(self.fake_engine)]
        monkeypatch.setattr(
            shared_server,
            "engine_command",
            lambda config, *, host, port, dump_dir, instance_id, purpose: (
                [*argv, host, str(port), instance_id],
                {},
            ),
        )

    def with_server(self, **changes) -> dict:
        config = json.loads(json.dumps(self.config))
        config["server"].update(changes)
        return config

    def write_config(self, config: dict | None = None, name: str = "config.json") -> Path:
        path = self.workdir / name
        path.write_text(json.dumps(config or self.config))
        return path

    def spawn(self, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            cwd=self.workdir,
            # A test run started in the background inherits an ignored SIGINT, and Python then
            # never raises KeyboardInterrupt: give jobs the default, as a terminal would.
            preexec_fn=_default_sigint,
        )
        self.processes.append(proc)
        return proc

    def job(
        self,
        name: str,
        *,
        mode: str = "hold",
        token: str = "run-jobs",
        config=None,
        env: dict | None = None,
    ):
        script = self.workdir / "job.py"
        script.write_text(JOB)
        out = self.workdir / name
        out.mkdir()
        argv = [PYTHON, "-u", str(script), str(self.write_config(config)), mode, str(out)]
        if self.fake_engine is not None:
            argv.append(str(self.fake_engine))
        proc = self.spawn(argv, env={shared_server.RUN_TOKEN_ENV: token, **(env or {})})
        return proc, out


def generate(url: str, rid: str) -> dict:
    payload = {"input_ids": [3, 4, 5, 6], "rid": rid, "sampling_params": {"max_new_tokens": 0}}
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_start_on_demand_serve_and_stop_at_end_of_its_run(run):
    assert read_json(run.paths.state) is None
    with server_lease(resolve(run.config), run_token="run-a") as handle:
        rid = "eaglepipe-0123456789ab-7-0"
        assert generate(handle.url, rid)["meta_info"]["prompt_tokens"] == 4
        assert (handle.dump_dir / f"{rid}.safetensors").is_file()
        assert handle.info["aux_layer_ids"] == [1, 3, 4]
        assert handle.info["instance_id"] == handle.state["instance_id"]
        handle.raise_if_dead()
        state = read_json(run.paths.state)
        assert state["pid"] == handle.pid and state["started_by"] == "run-a"
        assert Path(state["log"]).parent == run.workdir / "logs" / "server"
        assert len(list((run.paths.leases).glob("*.lease"))) == 1
    # The block ended: the server stays for the next job of the run, the lease is gone.
    assert group_alive(handle.pid) and not list(run.paths.leases.glob("*.lease"))
    assert stop_if_started_by("another-run") is False and group_alive(handle.pid)
    assert stop_if_started_by("run-a") is True
    assert not group_alive(handle.pid)
    assert port_is_free("127.0.0.1", handle.state["port"])
    assert read_json(run.paths.state) is None and not handle.dump_dir.exists()
    assert [e["event"] for e in read_history(run.paths)] == ["start", "ready", "exit", "stop"]


def test_a_jobs_lease_is_written_whole_without_waiting_for_the_disk(tmp_path, monkeypatch):
    """A lease names a live process, so its file is not fsynced: an fsync waits for the chunks
    other jobs queue on the same disk (0.22 s median beside two chunk writers on an H100's
    disk, BENCHMARKS.md). It is still written whole by a rename, and counts as live."""
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    paths = ServerPaths(tmp_path / "server")
    lease = Lease(paths, ttl_s=60.0, run_token="run-a", kind="shared")
    lease.acquire()
    try:
        assert synced == []
        assert read_json(lease.path)["pid"] == os.getpid()
        (live,) = live_leases(paths, 60.0)
        assert live["run_token"] == "run-a" and live["file"] == lease.path.name
        assert [p.name for p in paths.leases.iterdir()] == [lease.path.name]  # no temp file
    finally:
        lease.release()
    assert live_leases(paths, 60.0) == [] and not lease.path.exists()


def test_two_concurrent_jobs_share_one_server(run):
    jobs = [run.job(name) for name in ("job-a", "job-b")]
    holding = [
        wait_for(lambda out=out: (out / "holding").exists() and out / "holding", "a job holding")
        for _, out in jobs
    ]
    pids = {json.loads(path.read_text())["pid"] for path in holding}
    assert len(pids) == 1 and len(starts(run.paths)) == 1
    for _, out in jobs:
        (out / "finish").write_text("")
    for proc, _ in jobs:
        assert proc.wait(timeout=WAIT_S) == 0
    (pid,) = pids
    assert group_alive(pid)
    assert stop_if_started_by("run-jobs") is True
    assert not group_alive(pid) and port_is_free("127.0.0.1", run.config["server"]["port"])


def count_server_info_calls(monkeypatch) -> list[str]:
    """The /server_info requests this process's leases make from here on (still made)."""
    calls: list[str] = []
    real = shared_server.http_get_json

    def counting(url, timeout_s):
        calls.append(url)
        return real(url, timeout_s)

    monkeypatch.setattr(shared_server, "http_get_json", counting)
    return calls


def test_a_job_joining_a_server_in_use_takes_its_lease_without_asking_it(run, monkeypatch):
    """A running SGLang's /server_info waits for the scheduler's current batch: a job that joins
    a server whose /health answered another job's watchdog within seconds takes the info its
    start recorded. A note gone stale, or of another instance, means asking again."""
    run.use_fake_engine(monkeypatch)
    proc, out = run.job("job-a")
    wait_for(lambda: (out / "holding").exists(), "job-a holding the server")
    state = read_json(run.paths.state)
    wait_for(
        lambda: (
            run.paths.answered.exists() and run.paths.answered.read_text() == state["instance_id"]
        ),
        "job-a's watchdog to note an answer",
    )
    calls = count_server_info_calls(monkeypatch)
    with server_lease(resolve(run.config), run_token="run-jobs") as joined:
        assert joined.pid == state["pid"] and joined.info == state["info"]
        assert joined.info["instance_id"] == state["instance_id"]
        assert joined.joined_via == "answered note"
    assert calls == [] and len(starts(run.paths)) == 1

    (out / "finish").write_text("")
    assert proc.wait(timeout=WAIT_S) == 0
    long_ago = time.time() - 60
    os.utime(run.paths.answered, (long_ago, long_ago))
    with server_lease(resolve(run.config), run_token="run-jobs") as asked:
        assert asked.pid == state["pid"] and asked.joined_via == "server_info"
    assert calls == [f"{state['url']}/server_info"]

    run.paths.answered.write_text("another-instance")
    with server_lease(resolve(run.config), run_token="run-jobs") as other_note:
        assert other_note.pid == state["pid"]
    assert len(calls) == 2 and len(starts(run.paths)) == 1
    assert stop_if_started_by("run-jobs") is True


def test_a_fresh_answer_note_does_not_hide_a_server_that_died(run, monkeypatch):
    run.use_fake_engine(monkeypatch)
    with server_lease(resolve(run.config), run_token="run-died") as first:
        assert first.joined_via == "started"
        wait_for(lambda: run.paths.answered.exists(), "the watchdog to note an answer")
        first.stop_watchdog()
    os.killpg(first.pid, signal.SIGKILL)
    wait_for(lambda: not group_alive(first.pid), "the killed server to be gone")
    os.utime(run.paths.answered)  # as fresh as a note can be
    with server_lease(resolve(run.config), run_token="run-died") as fresh:
        assert fresh.pid != first.pid and fresh.info["instance_id"] != first.info["instance_id"]
    assert len(starts(run.paths)) == 2
    assert stop_if_started_by("run-died") is True


def test_reuse_across_runs_and_replace_when_layer_ids_change(run, monkeypatch):
    run.use_fake_engine(monkeypatch)
    with server_lease(resolve(run.config), run_token="run-1") as first:
        pass
    with server_lease(resolve(run.config), run_token="run-2") as second:
        assert second.pid == first.pid
    assert len(starts(run.paths)) == 1
    # run-1 is over, so run-2, which reused the server, is the run that stops it.
    assert read_json(run.paths.state)["owner_run"] == "run-2"

    changed = json.loads(json.dumps(run.config))
    changed["aux_layer_ids"] = [0, 2, 5]
    with server_lease(resolve(changed), run_token="run-3") as third:
        assert third.pid != first.pid
        assert third.state["settings"]["aux_layer_ids"] == [0, 2, 5]
    assert not group_alive(first.pid) and len(starts(run.paths)) == 2
    assert stop_if_started_by("run-3") is True and not group_alive(third.pid)


def test_new_weights_in_the_same_model_dir_replace_the_running_server(run, tmp_path):
    # A fine-tune saved in place keeps config.json: the weights are part of the identity.
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "target"
    shutil.copytree(run.config["model"]["path"], model)
    config = json.loads(json.dumps(run.config))
    config["model"]["path"] = str(model)
    with server_lease(resolve(config), run_token="run-w") as first:
        pass
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    tensors = {name: t + 0.01 if t.is_floating_point() else t for name, t in tensors.items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    with server_lease(resolve(config), run_token="run-w") as second:
        assert second.pid != first.pid
        assert second.state["settings"]["weights"] != first.state["settings"]["weights"]
    assert not group_alive(first.pid) and len(starts(run.paths)) == 2
    assert stop_if_started_by("run-w") is True


@pytest.mark.parametrize("problem", ["other-owner", "writable-by-others"])
def test_a_handoff_root_of_another_user_or_open_to_others_is_refused(run, problem):
    root = Path(run.config["server"]["dump_root"])
    root.mkdir(mode=0o700)
    if problem == "other-owner":
        if os.getuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(root, 4242, 4242)
        expected = "is owned by uid 4242"
    else:
        root.chmod(0o777)
        expected = "has mode 777 (writable by group or others)"
    with pytest.raises(PipelineError) as excinfo:
        with server_lease(resolve(run.config), run_token="run-root"):
            pytest.fail("a server was started with an unsafe handoff root")
    assert f"server.dump_root {root} " in str(excinfo.value)
    assert expected in str(excinfo.value)
    assert read_json(run.paths.state) is None


def test_the_handoff_root_is_created_private(run):
    with server_lease(resolve(run.config), run_token="run-mode") as handle:
        root = Path(handle.dump_dir).parent
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    assert stop_if_started_by("run-mode") is True


def test_two_working_directories_on_one_node_draw_ports_of_their_own(run, monkeypatch, capsys):
    # The default (server.port null): no shared default port for two pipelines to meet on.
    run.use_fake_engine(monkeypatch)
    config = resolve(run.with_server(port=None))
    other = ServerPaths(run.workdir / "other" / ".eaglepipe" / "server" / hostname())
    with server_lease(config, run_token="run-here") as here:
        try:
            with server_lease(config, run_token="run-there", paths=other) as there:
                assert here.state["port"] != there.state["port"]
                for handle in (here, there):
                    assert shared_server.probe_health(handle.url) is None  # healthy
                    assert handle.state["port"] in ports.DRAWN_PORTS
                assert read_json(other.state)["port"] == there.state["port"]
        finally:
            shared_server.stop_server(paths=other)
    assert stop_if_started_by("run-here") is True
    assert "not a loopback address" not in capsys.readouterr().err


def test_a_working_directory_keeps_its_port_and_steps_past_a_taken_one(tmp_path):
    first = ports.working_directory_port("127.0.0.1", tmp_path / "a")
    assert first == ports.working_directory_port("127.0.0.1", tmp_path / "a")
    assert first != ports.working_directory_port("127.0.0.1", tmp_path / "b")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        assert ports.working_directory_port("127.0.0.1", tmp_path / "a") != first


def test_a_server_host_that_does_not_resolve_is_named_not_blamed_on_the_ports(tmp_path):
    # Every port "was taken", and the advice was to set server.port.
    with pytest.raises(PipelineError, match=r"^server.host no.such.host.invalid does not resolve"):
        ports.working_directory_port("no.such.host.invalid", tmp_path / "a")


def test_a_server_host_other_than_loopback_is_warned_about_in_one_line(run, monkeypatch, capsys):
    for host in ("127.0.0.1", "::1", "localhost"):
        assert ports.exposure_warning(host, 8000) is None
    run.use_fake_engine(monkeypatch)
    with server_lease(resolve(run.with_server(host="0.0.0.0")), run_token="run-open"):
        pass
    assert stop_if_started_by("run-open") is True
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "loopback" in x]
    assert line.startswith("warning: server.host 0.0.0.0 is not a loopback address")
    assert "no authentication" in line


def test_refuses_a_port_held_by_a_foreign_process_and_leaves_it_running(run):
    port = run.config["server"]["port"]
    listener = run.spawn(
        [
            PYTHON,
            "-c",
            "import socket, time\n"
            f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
            "time.sleep(600)",
        ]
    )
    wait_for(lambda: not port_is_free("127.0.0.1", port), "the foreign listener")
    with pytest.raises(PipelineError) as excinfo:
        with server_lease(resolve(run.config), run_token="run-port"):
            pytest.fail("a lease was granted on a foreign port")
    message = str(excinfo.value)
    assert f"port {port}" in message and f"PID {listener.pid}" in message
    assert "time.sleep(600)" in message
    assert listener.poll() is None
    assert not starts(run.paths) and read_json(run.paths.state) is None


def test_dead_or_silent_server_fails_its_client_within_seconds(run, monkeypatch):
    # hang_after:0: /generate never answers (and /health still does), like a wedged engine.
    monkeypatch.setenv("EAGLEPIPE_FAULT", "hang_after:0")
    with server_lease(resolve(run.config), run_token="run-kill") as handle:
        # Stopped (SIGSTOP): /health goes silent; the probe and the watchdog both say so.
        handle.stop_watchdog()
        handle.start_watchdog(unresponsive_after_s=2)
        os.killpg(handle.pid, signal.SIGSTOP)
        try:
            with pytest.raises(PipelineError, match="stopped answering"):
                handle.raise_if_dead(probe_timeout_s=1)
            wait_for(lambda: handle.failure, "the watchdog to notice the silence")
            with pytest.raises(PipelineError, match=f"PID {handle.pid}.*stopped answering"):
                handle.check()
        finally:
            os.killpg(handle.pid, signal.SIGCONT)
        handle.raise_if_dead()
        handle.stop_watchdog()
        handle.start_watchdog()
        handle.check()

        async def request_then_kill():
            async with aiohttp.ClientSession() as session:
                rid = "eaglepipe-0123456789ab-1-0"
                payload = {
                    "input_ids": [1, 2],
                    "rid": rid,
                    "sampling_params": {"max_new_tokens": 0},
                }
                timeout = aiohttp.ClientTimeout(total=600)
                post = session.post(f"{handle.url}/generate", json=payload, timeout=timeout)
                asyncio.get_running_loop().call_later(1.0, os.killpg, handle.pid, signal.SIGKILL)
                return await handle.guard(post)

        with pytest.raises(PipelineError) as excinfo:
            asyncio.run(asyncio.wait_for(request_then_kill(), WAIT_S))
        message = str(excinfo.value)
        assert f"PID {handle.pid}" in message and str(handle.log_path) in message
        with pytest.raises(PipelineError, match="exited while in use"):
            shared_server.server_alive(handle)
        with pytest.raises(PipelineError, match=str(handle.log_path)):
            handle.raise_if_dead()
    # The next lease finds the dead server's state and starts afresh.
    run.use_fake_engine(monkeypatch)
    with server_lease(resolve(run.config), run_token="run-kill") as fresh:
        assert fresh.pid != handle.pid
    assert stop_if_started_by("run-kill") is True


@pytest.mark.parametrize(
    "engine_code, expected",
    [
        ("print('loading shard 1 of 999', flush=True); import time; time.sleep(600)", "within 3s"),
        ("print('CUDA out of memory while loading', flush=True); raise SystemExit(2)", "code 2"),
    ],
    ids=["never-healthy", "exits-early"],
)
def test_failed_start_reports_the_log_tail_and_leaves_nothing(
    run, monkeypatch, engine_code, expected
):
    monkeypatch.setattr(
        shared_server, "engine_command", lambda *a, **k: ([PYTHON, "-u", "-c", engine_code], {})
    )
    config = run.with_server(health_timeout_s=3)
    with pytest.raises(PipelineError) as excinfo:
        with server_lease(resolve(config), run_token="run-fail"):
            pytest.fail("an unhealthy server was handed out")
    message = str(excinfo.value)
    assert expected in message and engine_code.split("'")[1] in message
    (event,) = starts(run.paths)
    assert not group_alive(event["pid"]) and read_json(run.paths.state) is None
    assert port_is_free("127.0.0.1", config["server"]["port"])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_job_stops_the_server_its_run_started(run, monkeypatch, sig):
    run.use_fake_engine(monkeypatch)
    proc, out = run.job("job", token="run-int")
    wait_for(lambda: (out / "holding").exists(), "the job to hold its lease")
    pid = json.loads((out / "holding").read_text())["pid"]
    proc.send_signal(sig)
    assert proc.wait(timeout=WAIT_S) != 0
    assert not group_alive(pid)
    assert read_json(run.paths.state) is None
    assert port_is_free("127.0.0.1", run.config["server"]["port"])


def test_interrupted_job_leaves_the_server_to_a_job_still_using_it(run, monkeypatch):
    run.use_fake_engine(monkeypatch)
    stays, stays_out = run.job("stays", token="run-int")
    wait_for(lambda: (stays_out / "holding").exists(), "the first job")
    leaves, leaves_out = run.job("leaves", token="run-int")
    wait_for(lambda: (leaves_out / "holding").exists(), "the second job")
    pid = json.loads((stays_out / "holding").read_text())["pid"]
    leaves.send_signal(signal.SIGINT)
    assert leaves.wait(timeout=WAIT_S) != 0
    assert group_alive(pid)
    (stays_out / "finish").write_text("")
    assert stays.wait(timeout=WAIT_S) == 0
    assert stop_if_started_by("run-int") is True


def test_server_of_a_killed_client_stops_after_the_idle_timeout(run, monkeypatch):
    run.use_fake_engine(monkeypatch)
    config = run.with_server(idle_timeout_s=2)
    proc, out = run.job("job", token="run-killed", config=config)
    wait_for(lambda: (out / "holding").exists(), "the job to hold its lease")
    state = read_json(run.paths.state)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not group_alive(state["pid"]), "the idle server to stop itself")
    (exit_event,) = [e for e in read_history(run.paths) if e["event"] == "exit"]
    assert "no live lease" in exit_event["reason"]
    assert read_json(run.paths.state) is None and not Path(state["dump_dir"]).exists()
    assert port_is_free("127.0.0.1", state["port"])


def test_server_started_in_a_slurm_job_stops_once_that_job_ended_and_nobody_uses_it(
    run, monkeypatch
):
    """Without cgroups SLURM loses the server when the job that started it exits (see
    eaglepipe/server/lifecycle/slurm_job.py); the supervisor stops it then, not after the idle
    timeout, but never under a job that still holds a lease."""
    run.use_fake_engine(monkeypatch)
    assert run.config["server"]["idle_timeout_s"] > 2 * WAIT_S
    starter, starter_out = run.job("starter", env={"SLURM_JOB_ID": "4242"})
    wait_for(lambda: (starter_out / "holding").exists(), "the SLURM job to hold its lease")
    other, other_out = run.job("other", token="run-other", env={"SLURM_JOB_ID": "4243"})
    wait_for(lambda: (other_out / "holding").exists(), "the other job to hold its lease")
    state = read_json(run.paths.state)
    (starter_out / "finish").write_text("")
    assert starter.wait(timeout=WAIT_S) == 0
    # The starting job is over, but the other job still uses the server: it keeps serving
    # through several of the supervisor's polls (every lease_ttl_s / 4).
    deadline = time.monotonic() + run.config["server"]["lease_ttl_s"]
    while time.monotonic() < deadline:
        rid = f"eaglepipe-0123456789ab-{int(time.monotonic() * 1000)}-0"
        assert generate(f"http://127.0.0.1:{state['port']}", rid)["meta_info"]
        assert other.poll() is None and group_alive(state["pid"])
        time.sleep(0.2)
    (other_out / "finish").write_text("")
    assert other.wait(timeout=WAIT_S) == 0
    wait_for(lambda: not group_alive(state["pid"]), "the server to stop with its SLURM job")
    (exit_event,) = [e for e in read_history(run.paths) if e["event"] == "exit"]
    assert "SLURM job 4242" in exit_event["reason"], exit_event
    assert read_json(run.paths.state) is None and not Path(state["dump_dir"]).exists()
    assert port_is_free("127.0.0.1", state["port"])


def test_a_server_stopped_by_a_signal_from_elsewhere_leaves_no_state(run, monkeypatch):
    """SLURM's scancel or time limit SIGTERMs the supervisor directly, and may SIGKILL the job
    before its own clean-up: the supervisor removes the state file that names it."""
    run.use_fake_engine(monkeypatch)
    proc, out = run.job("job")
    wait_for(lambda: (out / "holding").exists(), "the job to hold its lease")
    state = read_json(run.paths.state)
    os.kill(state["pid"], signal.SIGTERM)
    wait_for(lambda: not group_alive(state["pid"]), "the supervisor to stop its group")
    assert read_json(run.paths.state) is None
    (exit_event,) = [e for e in read_history(run.paths) if e["event"] == "exit"]
    assert exit_event["reason"] == "received SIGTERM"
    assert proc.wait(timeout=WAIT_S) != 0  # its client noticed the server was gone


def test_exclusive_lease_waits_for_shared_users_and_keeps_them_out(run, monkeypatch):
    run.use_fake_engine(monkeypatch)
    # A shared user that yields between requests lets the exclusive user in while it lives.
    polite, polite_out = run.job("polite", mode="yield")
    wait_for(lambda: (polite_out / "holding").exists(), "the shared job")
    with server_lease(resolve(run.config), run_token="run-jobs", exclusive=True) as handle:
        assert (polite_out / "yielded").exists() and polite.poll() is None
        generate(handle.url, "eaglepipe-0123456789ab-1-0")
        assert not (polite_out / "resumed").exists()
    wait_for(lambda: (polite_out / "resumed").exists(), "the shared job to resume")
    (polite_out / "finish").write_text("")
    assert polite.wait(timeout=WAIT_S) == 0

    # One that never yields keeps the exclusive user waiting until its lease ends.
    busy, busy_out = run.job("busy")
    wait_for(lambda: (busy_out / "holding").exists(), "the second shared job")
    seen: dict = {}

    def exclusive_user():
        try:
            with server_lease(resolve(run.config), run_token="run-jobs", exclusive=True):
                seen["busy_had_left"] = (busy_out / "left").exists()
        except BaseException as exc:  # reported by the assertion below
            seen["error"] = exc

    waiter = threading.Thread(target=exclusive_user)
    waiter.start()
    wait_for(run.paths.exclusive_marker.exists, "the exclusive user to queue at the gate")
    assert seen == {} and busy.poll() is None
    (busy_out / "finish").write_text("")
    waiter.join(WAIT_S)
    assert seen == {"busy_had_left": True}
    assert busy.wait(timeout=WAIT_S) == 0
    assert len(starts(run.paths)) == 1
    assert stop_if_started_by("run-jobs") is True


def test_server_command_line_start_status_stop(run, monkeypatch, capsys):
    run.use_fake_engine(monkeypatch)
    config_path = run.write_config()

    def script(*args):
        return subprocess.run(
            [PYTHON, "-u", str(REPO_ROOT / "scripts" / "server.py"), *args],
            cwd=run.workdir,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )

    # In-process, so the stand-in engine applies; the script path is exercised below.
    assert cli_main(["server", "start", "--config", str(config_path)]) == 0
    started = capsys.readouterr().out
    state = read_json(run.paths.state)
    assert state["url"] in started and state["log"] in started
    status = script("status")
    assert status.returncode == 0 and "healthy" in status.stdout and "pinned" in status.stdout
    assert str(state["pid"]) in status.stdout and state["fingerprint"] in status.stdout
    assert "  handoff     0 dump(s) waiting (0 B); " in status.stdout
    # What waits in the handoff: a dump, a write in progress, a failed write's note.
    dump_dir = Path(state["dump_dir"])
    (dump_dir / "eaglepipe-0123456789ab-4-0.safetensors").write_bytes(b"x" * 1500)
    (dump_dir / ".eaglepipe-0123456789ab-5-0.safetensors.tmp").write_bytes(b"x" * 500)
    (dump_dir / "eaglepipe-0123456789ab-6-0.failed").write_text("No space left on device")
    handoff = [line for line in script("status").stdout.splitlines() if "handoff" in line]
    assert len(handoff) == 1 and handoff[0].startswith("  handoff     2 dump(s) waiting (2.0 KB); ")
    assert handoff[0].endswith("; 1 failed write(s) not yet collected"), handoff
    # A pinned server belongs to the person who started it, not to a run.
    assert stop_if_started_by(state["owner_run"]) is False
    stopped = script("stop")
    assert stopped.returncode == 0 and f"port {state['port']} is free" in stopped.stdout
    assert not group_alive(state["pid"])
    assert script("status").returncode == EXIT_NOT_RUNNING


def test_group_members_recognises_only_the_servers_own_processes():
    # pgid reuse guard: a group whose leader predates the recorded start is never ours.
    me = psutil.Process()
    assert shared_server.group_members(os.getpgid(0), me.create_time() + 3600) == []
    # Nor are processes that lack the server instance's marker in their environment.
    assert me.pid in [p.pid for p in shared_server.group_members(os.getpgid(0), 0)]
    assert shared_server.group_members(os.getpgid(0), 0, "some-other-instance") == []


class CountingServer:
    """An HTTP server answering /health and SGLang's /server_info (with the project's hook),
    counting the /health requests it gets."""

    def __init__(self, instance_id: str):
        from eaglepipe.server.sglang.recipe import hook_spec

        self.health_hits = 0
        hook = hook_spec(
            dump_dir="/tmp/none", request_prefix="eaglepipe", aux_layer_ids=[1, 3, 4],
            instance_id=instance_id, hidden_size=32,
        )  # fmt: skip
        self.info = {"version": "0.5.14", "forward_hooks": [hook], "instance_id": instance_id}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _start(self) -> None:
        from aiohttp import web

        async def health(request):
            self.health_hits += 1
            return web.Response(text="")

        async def server_info(request):
            return web.json_response(self.info)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/server_info", server_info)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def __enter__(self) -> CountingServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.mark.parametrize(("engine", "health_hits"), [("sglang", 0), ("reference", 1)])
def test_a_lease_on_a_running_sglang_asks_its_server_info_not_its_slow_health(engine, health_hits):
    """SGLang's /health answers a second after a one-token generation at the earliest (the
    contract test reads it); its /server_info asks the scheduler, which proves it answers."""
    with CountingServer("inst-1") as server:
        state = {"url": server.url, "engine": engine, "instance_id": "inst-1"}
        info = shared_server._server_info_when_answering(state, patience_s=5)
        assert info is not None and info["instance_id"] == "inst-1"
        assert server.health_hits == health_hits


# A stand-in SGLang (aiohttp only): /server_info in SGLang's shape, with the project's hook config
# (its instance id, and `capture: false` for a generation server), as the real one echoes it.
FAKE_SGLANG = textwrap.dedent(
    """
    import sys
    from aiohttp import web

    host, port, instance_id, purpose = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    hook = {"instance_id": instance_id, "aux_layer_ids": [1, 3, 4], "dump_dir": "/none",
            "request_prefix": "eaglepipe", "hidden_size": 32}
    if purpose != "capture":
        hook["capture"] = False

    async def health(request):
        return web.Response()

    async def server_info(request):
        return web.json_response({"version": "0.5.14", "forward_hooks": [
            {"name": "eaglepipe-dump", "config": hook}]})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/server_info", server_info)])
    web.run_app(app, host=host, port=port, print=None)
    """
)


def serve_with_fake_sglang(run, monkeypatch) -> None:
    """Servers started from here run FAKE_SGLANG for the purpose they are started for."""
    fake = run.workdir / "fake_sglang.py"
    fake.write_text(FAKE_SGLANG)
    monkeypatch.setattr(
        shared_server,
        "engine_command",
        lambda config, *, host, port, dump_dir, instance_id, purpose: (
            [PYTHON, "-u", str(fake), host, str(port), instance_id, purpose],
            {},
        ),
    )


def test_regeneration_and_extraction_servers_replace_each_other_with_sglang(run, monkeypatch):
    """With SGLang, a generation lease starts a server without the capture; the first capture
    lease after it replaces it (naming why), and further leases of a purpose reuse its server."""
    from eaglepipe.server.lifecycle.identity import CAPTURE, GENERATION

    serve_with_fake_sglang(run, monkeypatch)
    config = run.with_server(engine="sglang")
    instances = {}
    for purpose in (GENERATION, GENERATION, CAPTURE, CAPTURE):
        with server_lease(resolve(config), run_token="run-a", purpose=purpose) as handle:
            assert handle.info["capture"] is (purpose == CAPTURE)
            instances.setdefault(purpose, set()).add(handle.info["instance_id"])
    assert len(instances[GENERATION]) == len(instances[CAPTURE]) == 1
    history = read_history(run.paths)
    assert [e["event"] for e in history].count("start") == 2
    stops = [e["reason"] for e in history if e["event"] == "stop"]
    assert stops == ["a capture server replaces this generation server"]
    shared_server.stop_server()


def test_extraction_jobs_starting_together_replace_the_generation_server(run, monkeypatch):
    """Seen on the H200 (2026-12-03): after regeneration, two extraction jobs started at once;
    each one's lease was taken for a user of the generation server, and both failed. A job
    waiting for another server is not a user of the running one; a job that wants the running
    server (or a lease that does not say what it wants) still is, and is named."""
    from eaglepipe.server.lifecycle.identity import CAPTURE, GENERATION
    from eaglepipe.server.lifecycle.leases import Lease

    serve_with_fake_sglang(run, monkeypatch)
    spec = resolve(run.with_server(engine="sglang"))
    ttl_s = spec.server.lease_ttl_s

    def other_job(wants: str | None) -> Lease:
        lease = Lease(run.paths, ttl_s=ttl_s, run_token="run-a", kind="shared", wants=wants)
        lease.acquire()
        return lease

    with server_lease(spec, run_token="run-a", purpose=GENERATION):
        pass  # the generation server stays up, idle
    capture = shared_server.wanted_fingerprint(spec, CAPTURE)
    generation = shared_server.wanted_fingerprint(spec, GENERATION)
    assert capture != generation
    # Another extraction job, waiting for the lock, wants the capture server too.
    waiting = other_job(capture)
    try:
        with server_lease(spec, run_token="run-a", purpose=CAPTURE) as handle:
            assert handle.info["capture"] is True
    finally:
        waiting.release()
    # A job that wants the running capture server is its user, and so is a lease that does not
    # say what it wants: a generation job is refused while either holds it.
    for wants in (capture, None):
        user = other_job(wants)
        try:
            with pytest.raises(PipelineError) as caught:
                with server_lease(spec, run_token="run-a", purpose=GENERATION):
                    raise AssertionError("the generation lease should have been refused")
        finally:
            user.release()
        message = str(caught.value)
        assert "is a capture server, this job needs a generation one" in message
        assert f"in use by PID {os.getpid()}" in message
    shared_server.stop_server()


def test_server_stop_outside_a_run_leaves_the_directory_untouched(tmp_path):
    # It created .eaglepipe/server/<host>/ (a lock and a leases dir) wherever it was typed.
    stopped = subprocess.run(
        [PYTHON, "-u", str(REPO_ROOT / "scripts" / "server.py"), "stop"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopped.stdout == "no server running on this node\n"
    assert list(tmp_path.iterdir()) == []


def test_a_port_that_answers_its_own_request_is_not_healthy_yet():
    """Polling a port before its server listens can connect the socket to itself (Linux), and
    it reads back its own request line: that was a BadStatusLine traceback out of the start-up
    wait (a benchmark run on the 2-core VM, 2026-12-05). An echo server stands in for it."""
    import socketserver

    class Echo(socketserver.StreamRequestHandler):
        def handle(self):
            self.wfile.write(self.rfile.readline())

    with socketserver.TCPServer(("127.0.0.1", 0), Echo) as echo:
        thread = threading.Thread(target=echo.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{echo.server_address[1]}"
            assert shared_server.probe_health(url) == "BadStatusLine: GET /health HTTP/1.1\r\n"
            state = {"url": url, "instance_id": "x", "engine": "reference"}
            assert shared_server._server_info_if_healthy(state, health_probe=False) is None
        finally:
            echo.shutdown()

"""Whole-run faults: the real Snakefile, real jobs, a real reference server, real signals.

One clean run over 20 shards (40 rows, 2 rows per shard, every row its own chunk) is shared
by the module: it is itself the "starts the server once" test and the reference the faulted
runs must reproduce. Each fault test works in a copy of that run taken before extraction (toy
target, prepared table, Snakemake metadata), on its own port, so only extract jobs run.

Runs that are killed or interrupted are first caught mid-extraction deterministically: their
server answers one request and then stalls (the reference server's test-only fault switch),
leaving one shard with one journalled chunk and a job waiting for the next.

What "kill -9 of the snakemake process" means here: SIGKILL to snakemake's process group,
i.e. snakemake and the extract jobs it runs, as when the terminal, tmux pane or batch
allocation holding the run is killed. The server is not in that group (the lifecycle starts
it in a session of its own), which is exactly the orphan its idle timeout exists for.
Ctrl-C is SIGINT to the same group, as a terminal sends it to its foreground job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import filelock
import psutil
import pytest
import torch
import yaml
from pipeline_run import (
    isolate,
    kill_group,
    run_snakemake,
    small_config,
    snakemake_argv,
    write_config,
)
from safetensors.torch import load_file

from eaglepipe.core.fingerprint import hash_file
from eaglepipe.plan.shard_plan import plan_shards
from eaglepipe.server.lifecycle.leases import ServerPaths, hostname, read_history, read_json
from eaglepipe.server.lifecycle.ports import port_holders, port_is_free

ROWS = 40
ROWS_PER_SHARD = 2
SHARDS = [shard.name for shard in plan_shards(ROWS, ROWS_PER_SHARD)]
# The schema's smallest chunk bound: every row (hundreds of tokens) gets a chunk of its own,
# so every shard has two chunks and a kill can land between them.
CHUNK_MAX_BYTES = 4096
# Long enough that gaps between jobs on a busy machine never idle the reference server out.
REFERENCE_IDLE_S = 120
# Short, so the orphan of a killed run stops by itself while the test waits.
ORPHAN_IDLE_S = 10
# Generous waits: a loaded 2-core machine needs ~15 s per extract job (Python + torch import).
RUN_WAIT_S = 600
STOP_WAIT_S = 120
LOCK_REFUSED = "Directory cannot be locked"
# See start_stalled_run.
STALL_AFTER_ONE = {"EAGLEPIPE_FAULT": "hang_after:1"}
# What a copy of the reference run leaves out: its extraction, logs, server state, handoff dir.
NOT_COPIED = ("hidden_states", "logs", "server", "dumps", "locks", "incomplete")
# Hidden states of the same rows from two runs: bf16 rounding of batch-dependent fp32 bits.
HIDDEN_REL_L2_MAX = 1e-2


# ------------------------------------------------------------------------------- helpers


def fault_config(workdir: Path, idle_timeout_s: float) -> dict:
    config = small_config(workdir, rows=ROWS, rows_per_shard=ROWS_PER_SHARD)
    config["shards"]["chunk_max_bytes"] = CHUNK_MAX_BYTES
    # The hidden states only need a deterministic target, not a trained one.
    config["model"]["toy"].update(train_steps=2, train_seq_len=32, train_batch_size=2)
    config["server"]["idle_timeout_s"] = idle_timeout_s
    write_config(workdir, config)
    return config


def manifest_targets(shards: list[str]) -> list[str]:
    return [f"hidden_states/{shard}/manifest.json" for shard in shards]


def start_run(
    workdir: Path, *args: str, log: Path, extra_env: dict | None = None
) -> subprocess.Popen:
    """Snakemake in its own process group, with Ctrl-C's default action restored.

    A shell starts background commands with SIGINT ignored, and exec keeps that: a test session
    started with `&` or nohup would otherwise hand the ignoring on to the snakemake under test.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    env.pop("EAGLEPIPE_RUN_TOKEN", None)
    return subprocess.Popen(
        snakemake_argv(workdir, *args),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def server_paths(workdir: Path) -> ServerPaths:
    return ServerPaths(workdir / ".eaglepipe" / "server" / hostname())


def starts(workdir: Path) -> list[dict]:
    return [e for e in read_history(server_paths(workdir)) if e["event"] == "start"]


def server_group(event: dict) -> list[psutil.Process]:
    """Live, non-zombie processes of a started server's process group (pgid = supervisor pid)."""
    members = []
    for proc in psutil.process_iter(["status", "create_time"]):
        try:
            if os.getpgid(proc.pid) != event["pid"]:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        # A later process reusing the number is not our server.
        if proc.info["create_time"] < event["create_time"] - 1:
            continue
        if proc.info["status"] != psutil.STATUS_ZOMBIE:
            members.append(proc)
    return members


def processes_in(workdir: Path) -> list[psutil.Process]:
    """Live processes whose working directory is `workdir` (snakemake jobs and their children)."""
    found = []
    for proc in psutil.process_iter(["status", "cwd"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE or not proc.info["cwd"]:
            continue
        if Path(proc.info["cwd"]) == workdir and proc.pid != os.getpid():
            found.append(proc)
    return found


def wait_for(condition: Callable[[], object], timeout_s: float, what: Callable[[], str]):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout_s:.0f}s waiting: {what()}")
        # Short: a toy shard's two chunks are written within a second of each other.
        time.sleep(0.1)


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return f"({path} not written)"


def first_chunk_journalled(workdir: Path) -> bool:
    return any(j.stat().st_size > 0 for j in (workdir / "hidden_states").glob("*/journal.jsonl"))


def journalled_chunks(workdir: Path, shard: str) -> int:
    try:
        return len((workdir / "hidden_states" / shard / "journal.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def start_stalled_run(
    workdir: Path, shards: list[str], log: Path, procs: list[subprocess.Popen]
) -> tuple[subprocess.Popen, str]:
    """A run caught mid-extraction: one shard has one journalled chunk and waits for the next.

    Its server answers one request and then never again (the reference server's test-only
    fault switch), so the run is certainly still extracting when the test kills or interrupts
    it. The stalled server holds back a whole batch, so the answered request must be alone in
    its batch: one job at a time (`--cores 1`) sending one request at a time (a `serial`
    working directory). Returns the run and the half-written shard.
    """
    proc = start_run(
        workdir, "--cores", "1", *manifest_targets(shards), log=log, extra_env=STALL_AFTER_ONE
    )
    procs.append(proc)
    wait_for(
        lambda: first_chunk_journalled(workdir) or proc.poll() is not None,
        RUN_WAIT_S,
        lambda: "no chunk journalled yet; snakemake output:\n" + tail(log),
    )
    assert proc.poll() is None, "snakemake ended while its server hung:\n" + tail(log)
    partial = [s for s in shards if journalled_chunks(workdir, s)]
    assert len(partial) == 1 and journalled_chunks(workdir, partial[0]) == 1, partial
    assert not (workdir / "hidden_states" / partial[0] / "manifest.json").exists()
    return proc, partial[0]


def assert_resumed(workdir: Path, shard: str) -> None:
    log = tail(workdir / "logs" / "extract" / f"{shard}.log")
    assert "1/2 chunk(s) verified from an earlier run" in log, log


def chunk_table(workdir: Path, shards: list[str]) -> dict[str, list[tuple]]:
    """Per shard: (file, row ids, tokens, bytes, xxh3-128) of every chunk in its manifest."""
    table = {}
    for shard in shards:
        manifest = json.loads((workdir / "hidden_states" / shard / "manifest.json").read_text())
        table[shard] = [
            (c["file"], c["row_ids"], c["num_tokens"], c["bytes"], c["xxh3_128"])
            for c in manifest["chunks"]
        ]
    return table


def assert_same_chunks(workdir: Path, reference: Path, shards: list[str]) -> None:
    """The same chunks as the reference run: layout, token ids and masks exactly; hidden states
    up to bf16 rounding; and every manifest checksum matches its file.

    Bit equality is not the contract: the reference server batches concurrent requests, and a
    row's fp32 forward differs in its last bits with the rows it shares a batch with (matmul
    blocking and padding), which bf16 rounding turns into one-ulp differences in a few values.
    Which rows share a batch depends on job timing, so the hidden states are compared per token
    by relative L2 error, with a bound far below the validator's spot-check bound (0.05).
    """
    ours, theirs = chunk_table(workdir, shards), chunk_table(reference, shards)
    layout = {shard: [chunk[:4] for chunk in chunks] for shard, chunks in ours.items()}
    assert layout == {shard: [chunk[:4] for chunk in chunks] for shard, chunks in theirs.items()}
    for shard in shards:
        shard_dir = workdir / "hidden_states" / shard
        leftovers = sorted(p.name for p in shard_dir.iterdir() if p.name.endswith(".tmp"))
        assert not leftovers, f"{shard}: temp files left: {leftovers}"
        for name, *_layout, checksum in ours[shard]:
            assert hash_file(shard_dir / name) == checksum, f"{shard}/{name}: checksum"
            mine = load_file(shard_dir / name)
            ref = load_file(reference / "hidden_states" / shard / name)
            for key in ("row_ids", "offsets", "input_ids", "loss_mask"):
                assert torch.equal(mine[key], ref[key]), f"{shard}/{name}: {key} differs"
            for key, layers in (("aux_hidden_states", 3), ("final_hidden_states", 1)):
                error = token_rel_l2(mine[key], ref[key], layers)
                assert error <= HIDDEN_REL_L2_MAX, f"{shard}/{name}: {key} rel L2 {error:.3g}"


def token_rel_l2(values: torch.Tensor, reference: torch.Tensor, layers: int) -> float:
    """The largest relative L2 error of one token's state in one layer ([T, layers * H] input)."""
    a = values.float().reshape(values.shape[0], layers, -1)
    b = reference.float().reshape(reference.shape[0], layers, -1)
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).max().item()


def assert_no_server_left(workdir: Path, port: int, wait_s: float = STOP_WAIT_S) -> None:
    """Every server this working directory ever started is gone, and nothing listens on its port."""
    events = starts(workdir)
    assert events, f"no server start recorded in {server_paths(workdir).history}"

    def leftovers() -> list[str]:
        return [f"pid {p.pid} ({' '.join(p.cmdline())})" for e in events for p in server_group(e)]

    def gone() -> bool:
        try:
            return not leftovers() and port_is_free("127.0.0.1", port)
        except psutil.NoSuchProcess:
            return False

    wait_for(
        gone,
        wait_s,
        lambda: (
            f"server processes left {leftovers()}, port {port} holders "
            f"{[h.describe() for h in port_holders(port)]}; history:\n"
            + tail(server_paths(workdir).history)
        ),
    )
    assert not server_paths(workdir).state.exists(), read_json(server_paths(workdir).state)


def kill_leftovers(workdir: Path, procs: list[subprocess.Popen]) -> None:
    """Teardown: the snakemake groups this test started, its jobs, and every server it started."""
    for proc in procs:
        kill_group(proc, signal.SIGKILL)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    for proc in processes_in(workdir):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    for event in starts(workdir) if workdir.exists() else []:
        if server_group(event):
            try:
                os.killpg(event["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[Path]:
    """`snakemake --cores 2` extracting all 20 shards, uninterrupted."""
    workdir = tmp_path_factory.mktemp("reference")
    fault_config(workdir, REFERENCE_IDLE_S)
    try:
        run_snakemake(workdir, "--cores", "2", *manifest_targets(SHARDS), timeout=1800)
        yield workdir
    finally:
        kill_leftovers(workdir, [])


@pytest.fixture
def run_dir(reference, tmp_path) -> Iterator[Callable[..., tuple[Path, dict]]]:
    """A copy of the reference run before extraction, on its own port and handoff dir.

    The copy keeps the toy target, the prepared table, Snakemake's metadata and the provenance
    stamps with their mtimes, so only extract jobs are left to run.
    """
    made: list[tuple[Path, list]] = []

    def make(
        name: str,
        idle_timeout_s: float = REFERENCE_IDLE_S,
        procs: list | None = None,
        serial: bool = False,
    ):
        workdir = tmp_path / name
        shutil.copytree(reference, workdir, ignore=shutil.ignore_patterns(*NOT_COPIED))
        config = yaml.safe_load((reference / "config.yaml").read_text())
        config["dataset"]["path"] = str(workdir / "conversations.jsonl")
        config = isolate(config, workdir)
        config["server"]["idle_timeout_s"] = idle_timeout_s
        if serial:
            # One request in flight per job (so the stalled server's one answer is a batch of
            # one); the hidden states still match the reference within bf16 rounding.
            config["extract"]["max_inflight_requests"] = 1
        write_config(workdir, config)
        made.append((workdir, procs if procs is not None else []))
        return workdir, config

    yield make
    for workdir, procs in made:
        kill_leftovers(workdir, procs)


# ------------------------------------------------------------------------------- the tests


@pytest.mark.slow
def test_twenty_shards_on_two_cores_start_the_server_once(reference):
    """Issue 4: one server for the whole run, started on demand, stopped by onsuccess."""
    for shard in SHARDS:
        assert (reference / "hidden_states" / shard / "manifest.json").is_file(), shard
    chunks = chunk_table(reference, SHARDS)
    assert all(len(c) >= 2 for c in chunks.values()), "every shard should have 2+ chunks"

    history = read_history(server_paths(reference))
    started = [e for e in history if e["event"] == "start"]
    assert len(started) == 1, "server started more than once:\n" + "\n".join(map(str, history))
    server_logs = sorted((reference / "logs" / "server").glob("*.log"))
    assert len(server_logs) == 1, server_logs
    reuses = [e for e in history if e["event"] == "reuse"]
    assert len(reuses) >= len(SHARDS) - 1, "jobs after the first should reuse the server"
    stops = [e for e in history if e["event"] == "stop"]
    assert len(stops) == 1 and "that started it ended" in stops[0]["reason"], stops
    assert stops[0]["port_free"] is True

    port = json.loads((reference / ".eaglepipe" / "config.json").read_text())["server"]["port"]
    assert_no_server_left(reference, port, wait_s=5)


@pytest.mark.slow
def test_kill9_mid_extraction_needs_unlock_then_reruns_to_identical_output(reference, run_dir):
    procs: list[subprocess.Popen] = []
    workdir, config = run_dir("killed", idle_timeout_s=ORPHAN_IDLE_S, procs=procs, serial=True)
    shards = SHARDS[:6]
    proc, partial = start_stalled_run(workdir, shards, workdir / "first-run.log", procs)
    orphan = read_json(server_paths(workdir).state)
    assert orphan is not None, "a chunk was written, so a server must be recorded"

    kill_group(proc, signal.SIGKILL)
    proc.wait(timeout=60)
    # Snakemake's traces of a killed run: its lock, and the killed jobs marked incomplete.
    assert any((workdir / ".snakemake" / "locks").iterdir())
    assert any((workdir / ".snakemake" / "incomplete").iterdir())

    refused = run_snakemake(workdir, "--cores", "2", *manifest_targets(shards), check=False)
    assert refused.returncode != 0
    assert LOCK_REFUSED in refused.stdout + refused.stderr, refused.stdout + refused.stderr
    assert "--unlock" in refused.stdout + refused.stderr

    # The orphaned server has no live lease (its jobs died with snakemake): it stops itself.
    orphan_event = next(e for e in starts(workdir) if e["pid"] == orphan["pid"])
    wait_for(
        lambda: not server_group(orphan_event),
        ORPHAN_IDLE_S + config["server"]["lease_ttl_s"] + STOP_WAIT_S,
        lambda: (
            f"orphaned server pid {orphan['pid']} still runs; log:\n" + tail(Path(orphan["log"]))
        ),
    )
    exits = [
        e
        for e in read_history(server_paths(workdir))
        if e["event"] == "exit" and e.get("pid") == orphan["pid"]
    ]
    assert exits and "idle" in exits[0]["reason"], exits

    run_snakemake(workdir, "--unlock")
    rerun = run_snakemake(workdir, "--cores", "2", "--rerun-incomplete", *manifest_targets(shards))
    assert_resumed(workdir, partial)
    assert_same_chunks(workdir, reference, shards)
    assert_no_server_left(workdir, config["server"]["port"])
    assert not processes_in(workdir), rerun.stdout[-3000:]


@pytest.mark.slow
def test_disk_full_while_writing_a_chunk_fails_cleanly_and_resumes(reference, run_dir):
    workdir, config = run_dir("diskfull")
    shard = SHARDS[0]
    reference_chunks = chunk_table(reference, [shard])[shard]
    assert len(reference_chunks) == 2
    # The job's preflight counts chunk payloads (headers excluded); a tmpfs with exactly that
    # much room (rounded up to a page) passes it, takes the first chunk and its journal, and
    # runs out of space in the middle of the second chunk.
    payload = 0
    for name, *_rest, size, _checksum in reference_chunks:
        with open(reference / "hidden_states" / shard / name, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
        payload += size - header
    room = -(-payload // 4096) * 4096
    hidden_states = workdir / "hidden_states"
    hidden_states.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={room}", "eaglepipe-test", str(hidden_states)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.strip()}")
    try:
        target = manifest_targets([shard])
        full = run_snakemake(workdir, "--cores", "2", *target, check=False)
        output = full.stdout + full.stderr
        assert full.returncode != 0, output[-3000:]
        shard_dir = hidden_states / shard
        assert "chunk-00000.safetensors" in os.listdir(shard_dir)
        leftovers = sorted(
            p.name for p in shard_dir.iterdir() if p.name.startswith((".", "chunk-00001"))
        )
        assert not leftovers, f"half-written chunk left: {leftovers}"
        assert not (shard_dir / "manifest.json").exists()
        # One clear line names the chunk file and the lack of space, not a traceback.
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert any(
            "chunk-00001.safetensors" in line and shard in line and "space" in line.lower()
            for line in errors
        ), "no error line naming the chunk and disk space:\n" + output[-6000:]
        assert "Traceback" not in output, output[-6000:]
        assert_no_server_left(workdir, config["server"]["port"])

        # Space returns: the shard resumes from its journalled first chunk (no --unlock needed).
        subprocess.run(["mount", "-o", f"remount,size={64 << 20}", str(hidden_states)], check=True)
        run_snakemake(workdir, "--cores", "2", *target)
        assert "1/2 chunk(s) verified from an earlier run" in tail(
            workdir / "logs" / "extract" / f"{shard}.log"
        )
        assert_same_chunks(workdir, reference, [shard])
        assert_no_server_left(workdir, config["server"]["port"])
    finally:
        kill_leftovers(workdir, [])
        if subprocess.run(["umount", str(hidden_states)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(hidden_states)], check=False)


@pytest.mark.slow
def test_ctrl_c_mid_extraction_stops_jobs_and_server_and_releases_the_lock(reference, run_dir):
    procs: list[subprocess.Popen] = []
    workdir, config = run_dir("interrupted", procs=procs, serial=True)
    shards = SHARDS[:4]
    log = workdir / "first-run.log"
    proc, partial = start_stalled_run(workdir, shards, log, procs)
    assert read_json(server_paths(workdir).state) is not None

    # Ctrl-C in a terminal signals the whole foreground process group: snakemake and its jobs.
    kill_group(proc, signal.SIGINT)
    try:
        code = proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("snakemake still runs after Ctrl-C:\n" + tail(log))
    # Snakemake 9.27 on SIGINT: cancels the running jobs (they die of the signal), runs the
    # onerror handler (which stops the server this run started), releases its lock, exits 1.
    assert code == 1, tail(log)
    assert "Terminating processes on user request" in tail(log, 100_000), tail(log)
    # The stalled job reports the interrupt (exit 130 from Python's KeyboardInterrupt, or death
    # by SIGINT when the signal lands outside Python code).
    assert any(
        f"--shard {partial}" in line and ("exit status 130" in line or "SIGINT" in line)
        for line in tail(log, 100_000).splitlines()
    ), tail(log)
    wait_for(
        lambda: not processes_in(workdir),
        STOP_WAIT_S,
        lambda: f"jobs still running after Ctrl-C: {processes_in(workdir)}",
    )
    assert_no_server_left(workdir, config["server"]["port"])
    locks = workdir / ".snakemake" / "locks"
    assert not locks.exists() or not any(locks.iterdir()), list(locks.iterdir())

    # The next run needs no --unlock, resumes, and matches the uninterrupted run.
    run_snakemake(workdir, "--cores", "2", *manifest_targets(shards))
    assert_resumed(workdir, partial)
    assert_same_chunks(workdir, reference, shards)
    assert_no_server_left(workdir, config["server"]["port"])


@pytest.mark.slow
def test_second_snakemake_in_the_same_directory_is_refused_by_the_lock(reference, run_dir):
    procs: list[subprocess.Popen] = []
    workdir, config = run_dir("locked", procs=procs)
    shards = SHARDS[:2]
    # Hold the node's server lock, so the first run's extract jobs wait for it: the first run
    # is then certainly still running while the second one tries its luck.
    paths = server_paths(workdir)
    paths.make()
    server_lock = filelock.FileLock(paths.lock)
    server_lock.acquire(timeout=5)
    log = workdir / "first-run.log"
    try:
        proc = start_run(workdir, "--cores", "2", *manifest_targets(shards), log=log)
        procs.append(proc)
        wait_for(
            lambda: "waiting for the server lock" in tail(log) or proc.poll() is not None,
            RUN_WAIT_S,
            lambda: "the first run's jobs never reached the server lock:\n" + tail(log),
        )
        assert proc.poll() is None, tail(log)

        second = run_snakemake(workdir, "--cores", "2", *manifest_targets(shards), check=False)
        output = second.stdout + second.stderr
        assert second.returncode != 0, output[-3000:]
        assert LOCK_REFUSED in output, output[-3000:]
        assert proc.poll() is None, "the refused run disturbed the first:\n" + tail(log)
    finally:
        server_lock.release()
    # The first run was not disturbed: it finishes and stops its server.
    try:
        code = proc.wait(timeout=RUN_WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the first run did not finish:\n" + tail(log))
    assert code == 0, tail(log)
    assert_same_chunks(workdir, reference, shards)
    assert_no_server_left(workdir, config["server"]["port"])

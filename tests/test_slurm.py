"""The pipeline on a real SLURM cluster: `snakemake --workflow-profile profiles/slurm`.

tests/slurm_cluster.py starts munge, MariaDB, slurmdbd, slurmctld and one slurmd on this machine
(node `node1`, a `main` and a `gpu` partition, no GPUs). Each test works in a copy of the
repository with `profiles/slurm/config.yaml` edited the way docs/cluster.md tells users to:
partitions, account, no GRES (the node has no GPU), memory, CPUs, runtime and group size. The
embedded default runs on 4 rows in 2 shards of 2 rows, every row its own chunk, so both shards
form one SLURM job (extract + validate of each, `group-components: 2`).

- One clean run builds everything through SLURM; sacct shows the grouped job; its server was
  started once on the node, shared by the group's four jobs, and gone with the job; the shards
  equal a local run's (test_workflow_faults.assert_same_chunks: the same files, rows, sizes,
  token ids and masks, every chunk re-hashing to its manifest checksum, hidden states up to
  bf16 rounding; they are mostly bit-identical, but a request computed alone by a fresh CPU
  server was seen to differ by one bf16 step in 20 values).
- A grouped job cancelled mid-shard (`scancel`), snakemake stopped (Ctrl-C), and the same
  command again: only the missing chunks are redone, the others are kept as they were.
- A group killed at its time limit: Snakemake reports it, and its retry resumes.

A mid-shard kill is caught deterministically with the reference server's test-only fault
switch: `EAGLEPIPE_FAULT=hang_after:1` reaches the server through the job's environment
(sbatch --export=ALL), so each server answers one request and then stalls. For exactly one
chunk before the stall, every request is computed alone: one request in flight per job
(`extract.max_inflight_requests: 1`) and one extract job at a time on the node (extract asks
for all the node's cores through `set-threads`, in SLURM and locally alike).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import REPO_ROOT
from pipeline_run import SNAKEMAKE, copy_workflow, isolate, small_config, write_config
from slurm_cluster import (
    ACCOUNT,
    APT_PACKAGES,
    DEFAULT_PARTITION,
    GPU_PARTITION,
    INSTALL_COMMAND,
    NODE,
    ClusterError,
    SlurmCluster,
    missing_requirements,
)
from test_workflow_faults import assert_same_chunks, server_group, tail, wait_for

from eaglepipe.plan.shard_plan import plan_shards
from eaglepipe.server.lifecycle.leases import ServerPaths, hostname, read_history
from eaglepipe.server.lifecycle.ports import port_is_free

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROWS = 4
ROWS_PER_SHARD = 2
SHARDS = [shard.name for shard in plan_shards(ROWS, ROWS_PER_SHARD)]
GROUP = "extract_node"
GROUP_SIZE = len(SHARDS)
# Every row (hundreds of tokens) gets a chunk of its own: a kill can land between two chunks.
CHUNK_MAX_BYTES = 4096
PER_JOB_MEM_MB = 2000
RUN_TIMEOUT_S = 1800
STALL_AFTER_ONE = {"EAGLEPIPE_FAULT": "hang_after:1"}
# What a copy of the clean run leaves out: everything from extraction on, and its server state.
NOT_COPIED = (
    "hidden_states",
    "validated",
    "drafter",
    "report",
    "logs",
    "server",
    "dumps",
    "locks",
    "incomplete",
    "slurm_logs",
    "snakemake.log",
)


def on_ci() -> bool:
    return os.environ.get("CI") == "true"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """The cluster for this module; under CI (where .ci/run installs it) it must start."""
    reason = missing_requirements()
    if reason:
        if on_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except ClusterError as exc:
        pytest.fail(f"cannot start the SLURM test cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


# ------------------------------------------------------------------------------- helpers


def edit_profile(workdir: Path, cluster: SlurmCluster) -> None:
    """profiles/slurm/config.yaml edited for the test cluster, as docs/cluster.md says."""
    path = workdir / "profiles" / "slurm" / "config.yaml"
    profile = yaml.safe_load(path.read_text())
    cpus = max(1, cluster.cpus // GROUP_SIZE)
    profile["default-resources"].update(
        slurm_account=ACCOUNT,
        slurm_partition=DEFAULT_PARTITION,
        mem_mb=PER_JOB_MEM_MB,
        cpus_per_task=1,
        runtime=20,
    )
    for resources in profile["set-resources"].values():
        del resources["gres"]  # the node has no GPU
        resources.update(
            slurm_partition=GPU_PARTITION, mem_mb=PER_JOB_MEM_MB, cpus_per_task=cpus, runtime=20
        )
    profile["group-components"][GROUP] = GROUP_SIZE
    # Not a cluster setting: one extract at a time on the node (see the module docstring).
    profile["set-threads"] = {"extract": cluster.cpus}
    # The plugin's first status check of a finished job comes sooner (40 s by default).
    profile["slurm-init-seconds-before-status-checks"] = 2
    path.write_text(yaml.safe_dump(profile, sort_keys=False))


def run_config(workdir: Path) -> dict:
    config = small_config(workdir, rows=ROWS, rows_per_shard=ROWS_PER_SHARD)
    config["shards"]["chunk_max_bytes"] = CHUNK_MAX_BYTES
    config["extract"]["max_inflight_requests"] = 1
    config["dataset"]["holdout"] = {"mode": "shards", "shards": [SHARDS[-1]]}
    # Long: a server is shared by every job of its group. It stops with its SLURM job anyway.
    config["server"]["idle_timeout_s"] = 600
    write_config(workdir, config)
    return config


def snakemake_env(cluster: SlurmCluster, extra: dict | None = None) -> dict:
    env = {**cluster.env, "PYTHONUNBUFFERED": "1", **(extra or {})}
    env.pop("EAGLEPIPE_RUN_TOKEN", None)
    if not extra or "EAGLEPIPE_FAULT" not in extra:
        env.pop("EAGLEPIPE_FAULT", None)
    return env


def profile_run(
    workdir: Path, cluster: SlurmCluster, *targets: str, log: str, env: dict | None = None
) -> subprocess.Popen:
    """`snakemake --workflow-profile profiles/slurm [targets]` in the background, as a user runs
    it on the login node; its output goes to `log` in the working directory."""
    return subprocess.Popen(
        [SNAKEMAKE, "--workflow-profile", "profiles/slurm", *targets],
        cwd=workdir,
        env=snakemake_env(cluster, env),
        stdout=(workdir / log).open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # Ctrl-C's default action, even when the test session itself ignores SIGINT.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(proc: subprocess.Popen, workdir: Path, log: str) -> str:
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"snakemake still ran after {RUN_TIMEOUT_S}s:\n{tail(workdir / log)}")
    return (workdir / log).read_text(errors="replace")


def manifests(shards: list[str]) -> list[str]:
    return [f"hidden_states/{shard}/manifest.json" for shard in shards]


def node_paths(workdir: Path) -> ServerPaths:
    return ServerPaths(workdir / ".eaglepipe" / "server" / NODE)


def jobs_of(cluster: SlurmCluster, workdir: Path) -> list[dict]:
    return [job for job in cluster.sacct() if Path(job["WorkDir"]) == workdir]


def journalled(workdir: Path) -> dict[str, int]:
    """Journalled chunks per shard."""
    counts = {}
    for shard in SHARDS:
        journal = workdir / "hidden_states" / shard / "journal.jsonl"
        counts[shard] = len(journal.read_text().splitlines()) if journal.exists() else 0
    return counts


def chunk_files(workdir: Path) -> dict[Path, tuple[int, int, int]]:
    """Every chunk file with (inode, size, mtime_ns): a rewritten chunk changes them."""
    found = {}
    for path in sorted((workdir / "hidden_states").glob("*/chunk-*.safetensors")):
        stat = path.stat()
        found[path] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return found


def assert_nothing_left_on_the_node(workdir: Path, port: int) -> None:
    """No server process of this run, no server state, no lease, and its port is free."""
    paths = node_paths(workdir)
    events = [e for e in read_history(paths) if e["event"] == "start"]

    def leftovers() -> list[str]:
        procs = [f"pid {p.pid} ({' '.join(p.cmdline())})" for e in events for p in server_group(e)]
        leases = [p.name for p in paths.leases.glob("*.lease")] if paths.leases.exists() else []
        state = [str(paths.state)] if paths.state.exists() else []
        busy = [] if port_is_free("127.0.0.1", port) else [f"port {port}"]
        return procs + leases + state + busy

    def clean() -> bool:
        try:
            return not leftovers()
        except psutil.NoSuchProcess:
            return False

    wait_for(
        clean, 120, lambda: f"left on the node: {leftovers()}; history:\n" + tail(paths.history)
    )


def copy_before_extraction(source: Path, dest: Path) -> Path:
    """The clean run's working directory as it was before extraction: the toy target, the
    prepared table, Snakemake's metadata and the provenance stamps; its own port and handoff."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    config = yaml.safe_load((dest / "config.yaml").read_text())
    # dataset.path stays the clean run's file (read only): a new path rebuilds the toy target's
    # tokenizer and reruns prepare, as for any run whose dataset moved.
    config = isolate(config, dest)
    config["server"]["idle_timeout_s"] = 600
    write_config(dest, config)
    return dest


@dataclass
class Run:
    workdir: Path
    log: str
    returncode: int


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def clean_run(cluster, tmp_path_factory) -> Run:
    """The whole pipeline, as the README's cluster section runs it."""
    workdir = copy_workflow(tmp_path_factory.mktemp("slurm-run"))
    run_config(workdir)
    edit_profile(workdir, cluster)
    proc = profile_run(workdir, cluster, log="snakemake.log")
    return Run(workdir, finish(proc, workdir, "snakemake.log"), proc.returncode)


@pytest.fixture(scope="module")
def local_run(clean_run, cluster, tmp_path_factory) -> Path:
    """The same shards extracted locally (profiles/default), from the same target and table."""
    workdir = copy_before_extraction(clean_run.workdir, tmp_path_factory.mktemp("local") / "run")
    done = subprocess.run(
        [SNAKEMAKE, *manifests(SHARDS), "--cores", str(cluster.cpus)]
        + ["--set-threads", f"extract={cluster.cpus}"],
        cwd=workdir,
        env=snakemake_env_local(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    return workdir


def snakemake_env_local() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("EAGLEPIPE_RUN_TOKEN", "EAGLEPIPE_FAULT", "SLURM_CONF"):
        env.pop(name, None)
    return env


# ------------------------------------------------------------------------------- the tests


def test_ci_installs_what_the_cluster_needs():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    (listed,) = re.findall(r'^slurm_packages="([^"]+)"$', ci, re.MULTILINE)
    assert listed.split() == APT_PACKAGES.split()
    assert "export CI=" in ci


def test_without_the_packages_the_reason_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    reason = missing_requirements()
    assert reason is not None and "\n" not in reason
    assert "slurmctld" in reason and INSTALL_COMMAND in reason


def test_the_whole_pipeline_runs_through_slurm(clean_run, cluster):
    assert clean_run.returncode == 0, clean_run.log[-6000:]
    workdir = clean_run.workdir
    for path in [
        "drafter/live.json",
        "drafter/eval.json",
        "drafter/export/sglang/model.safetensors",
        "drafter/export/vllm/model.safetensors",
        "report/acceptance.png",
        *manifests(SHARDS),
        *(f"validated/{shard}.json" for shard in SHARDS),
    ]:
        assert (workdir / path).is_file(), path
    jobs = jobs_of(cluster, workdir)
    assert jobs and all(job["State"] == "COMPLETED" for job in jobs), jobs
    assert {job["NodeList"] for job in jobs} == {NODE}
    # The login side sees every output the nodes wrote: nothing is left to do.
    done = subprocess.run(
        [SNAKEMAKE, "--workflow-profile", "profiles/slurm", "-n"],
        cwd=workdir,
        env=snakemake_env(cluster),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "Nothing to be done" in done.stdout + done.stderr, done.stdout


def test_sacct_shows_each_group_of_shards_as_one_gpu_job(clean_run, cluster):
    jobs = jobs_of(cluster, clean_run.workdir)
    grouped = [job for job in jobs if job["Comment"] == f"rule_{GROUP}_extract_validate"]
    assert len(grouped) == len(SHARDS) // GROUP_SIZE, jobs
    for job in grouped:
        assert job["Partition"] == GPU_PARTITION and job["Account"] == ACCOUNT, job
        # Snakemake adds up the CPUs and memory of the shards that run side by side.
        assert int(job["AllocCPUS"]) == cluster.cpus, job
        assert job["ReqMem"] == f"{GROUP_SIZE * PER_JOB_MEM_MB}M", job
        # ... and the runtimes along a shard's chain: extract, then validate.
        assert job["Timelimit"] == "00:40:00", job
    others = [job for job in jobs if job not in grouped]
    assert {job["Comment"] for job in others} >= {"rule_prepare", "rule_train"}
    assert {job["Account"] for job in others} == {ACCOUNT}
    assert all(
        job["Partition"] == DEFAULT_PARTITION for job in others if "rule_report" in job["Comment"]
    )


def test_the_grouped_jobs_share_one_server_on_the_node_that_stops_with_the_job(clean_run, cluster):
    workdir = clean_run.workdir
    (group_job,) = [
        job for job in jobs_of(cluster, workdir) if job["Comment"].startswith(f"rule_{GROUP}")
    ]
    history = read_history(node_paths(workdir))
    events = [e["event"] for e in history]
    assert events.count("start") == 1, history
    # Every extract and validate job of the group but the first reused it.
    assert events.count("reuse") >= 2 * len(SHARDS) - 1, history
    assert {e["host"] for e in history} == {NODE}
    (exit_event,) = [e for e in history if e["event"] == "exit"]
    assert f"SLURM job {group_job['JobIDRaw']}" in exit_event["reason"], exit_event
    # Nothing ran a server on the login side.
    assert not (workdir / ".eaglepipe" / "server" / hostname()).exists()
    port = json.loads((workdir / ".eaglepipe" / "config.json").read_text())["server"]["port"]
    assert_nothing_left_on_the_node(workdir, port)


def test_the_shards_equal_those_of_a_local_run(clean_run, local_run):
    assert clean_run.returncode == 0, clean_run.log[-3000:]
    assert_same_chunks(clean_run.workdir, local_run, SHARDS)


def requests_sent(workdir: Path, shards: list[str]) -> int:
    total = 0
    for shard in shards:
        manifest = json.loads((workdir / "hidden_states" / shard / "manifest.json").read_text())
        total += manifest["timing"]["requests_sent"]
    return total


def server_port(workdir: Path) -> int:
    return yaml.safe_load((workdir / "config.yaml").read_text())["server"]["port"]


def wait_until_gone(cluster: SlurmCluster, workdir: Path, job_id: str) -> None:
    wait_for(
        lambda: job_id not in dict(cluster.squeue(workdir)),
        120,
        lambda: f"job {job_id} still in squeue: {cluster.squeue(workdir)}",
    )


def running_job_with_a_chunk(
    cluster: SlurmCluster, workdir: Path, proc: subprocess.Popen, log: str
) -> str:
    """The id of this run's SLURM job once it runs and has journalled a chunk."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        running = [job for job, state in cluster.squeue(workdir) if state == "RUNNING"]
        if running and sum(journalled(workdir).values()):
            (job_id,) = running
            return job_id
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no job wrote a chunk (snakemake: {proc.poll()}):\n{tail(workdir / log)}")
        time.sleep(0.2)


def test_scancel_mid_shard_then_the_same_command_redoes_only_the_missing_chunks(
    cluster, clean_run, local_run, tmp_path
):
    workdir = copy_before_extraction(clean_run.workdir, tmp_path / "cancelled")
    targets = [f"validated/{shard}.json" for shard in SHARDS]
    first = profile_run(workdir, cluster, *targets, log="first.log", env=STALL_AFTER_ONE)
    try:
        job_id = running_job_with_a_chunk(cluster, workdir, first, "first.log")
        # Mid-shard: one chunk written, the server stalled on the next request.
        assert sorted(journalled(workdir).values()) == [0, 1], journalled(workdir)
        cluster.scancel(job_id)
        wait_until_gone(cluster, workdir, job_id)
        assert_nothing_left_on_the_node(workdir, server_port(workdir))
        # sacct says "CANCELLED by <uid>", which snakemake-executor-plugin-slurm 2.8 does not
        # read as an end: the user stops snakemake (Ctrl-C; it cancels its other jobs).
        os.killpg(first.pid, signal.SIGINT)
        log = finish(first, workdir, "first.log")
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode != 0, log[-6000:]
    states = {job["JobIDRaw"]: job["State"] for job in jobs_of(cluster, workdir)}
    assert states[job_id] == f"CANCELLED by {os.getuid()}", states
    wait_for(lambda: not cluster.squeue(workdir), 120, lambda: str(cluster.squeue(workdir)))
    assert_nothing_left_on_the_node(workdir, server_port(workdir))
    kept = chunk_files(workdir)
    assert kept and not any((workdir / m).exists() for m in manifests(SHARDS)), kept

    rerun = profile_run(workdir, cluster, *targets, log="rerun.log")
    log = finish(rerun, workdir, "rerun.log")
    assert rerun.returncode == 0, log[-6000:]
    # Finished chunks were kept as they were; only the missing rows were requested.
    assert {path: chunk_files(workdir)[path] for path in kept} == kept
    assert requests_sent(workdir, SHARDS) == ROWS - len(kept)
    for shard in SHARDS:
        before = sum(1 for path in kept if path.parent.name == shard)
        if before:
            extract_log = (workdir / "logs" / "extract" / f"{shard}.log").read_text()
            assert f"{before}/2 chunk(s) verified from an earlier run" in extract_log
    assert_same_chunks(workdir, local_run, SHARDS)
    assert_nothing_left_on_the_node(workdir, server_port(workdir))


def test_a_group_killed_at_its_time_limit_is_reported_and_its_retry_resumes(
    cluster, clean_run, local_run, tmp_path
):
    workdir = copy_before_extraction(clean_run.workdir, tmp_path / "timeout")
    profile_path = workdir / "profiles" / "slurm" / "config.yaml"
    profile = yaml.safe_load(profile_path.read_text())
    # SLURM's shortest limit for the first attempt; the retry gets the usual time.
    profile["set-resources"]["extract"]["runtime"] = "1 if attempt == 1 else 20"
    profile_path.write_text(yaml.safe_dump(profile, sort_keys=False))
    shard = SHARDS[0]
    proc = profile_run(workdir, cluster, *manifests([shard]), log="run.log", env=STALL_AFTER_ONE)
    log = finish(proc, workdir, "run.log")
    assert proc.returncode == 0, log[-6000:]
    timed_out, retried = [job for job in cluster.sacct("End") if Path(job["WorkDir"]) == workdir]
    assert (timed_out["State"], timed_out["Timelimit"]) == ("TIMEOUT", "00:01:00"), timed_out
    assert (retried["State"], retried["Timelimit"]) == ("COMPLETED", "00:20:00"), retried
    assert f"Error in group {GROUP}" in log, log[-6000:]
    killed = f"*** JOB {timed_out['JobIDRaw']} ON {NODE} CANCELLED AT "
    assert re.search(re.escape(killed) + r"\S+ DUE TO TIME LIMIT \*\*\*", log), log[-6000:]
    # The retry kept the chunk written before the kill and requested only the other row.
    extract_log = (workdir / "logs" / "extract" / f"{shard}.log").read_text()
    assert "1/2 chunk(s) verified from an earlier run" in extract_log, extract_log
    assert requests_sent(workdir, [shard]) == 1
    first_chunk = workdir / "hidden_states" / shard / "chunk-00000.safetensors"
    killed_at = time.mktime(time.strptime(timed_out["End"], "%Y-%m-%dT%H:%M:%S"))
    assert first_chunk.stat().st_mtime <= killed_at + 1, "the retry rewrote the first chunk"
    assert_same_chunks(workdir, local_run, [shard])
    assert_nothing_left_on_the_node(workdir, server_port(workdir))

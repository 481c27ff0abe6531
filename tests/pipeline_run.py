"""Running the real Snakemake workflow from tests, in a scratch working directory."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import REPO_ROOT, free_port

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
SAMPLE = REPO_ROOT / "data" / "sample" / "conversations.jsonl"


def default_config() -> dict:
    return yaml.safe_load((REPO_ROOT / "config.yaml").read_text())


def small_config(workdir: Path, *, rows: int = 40, rows_per_shard: int = 10) -> dict:
    """The embedded default, shrunk so a whole run takes seconds: fewer rows, shorter training."""
    workdir.mkdir(parents=True, exist_ok=True)
    lines = SAMPLE.read_text().splitlines(keepends=True)[:rows]
    dataset = workdir / "conversations.jsonl"
    dataset.write_text("".join(lines))
    config = default_config()
    config["dataset"]["path"] = str(dataset)
    config["shards"]["rows_per_shard"] = rows_per_shard
    config["shards"]["chunk_max_bytes"] = 1 << 20
    config["model"]["toy"]["train_steps"] = 20
    config["train"]["epochs"] = 2
    config["evaluate"]["live_prompts"] = 2
    config["evaluate"]["live_new_tokens"] = 8
    config["validate"]["spot_check_rows"] = 1
    # The spot check still re-extracts through the server; the independent transformers forward
    # (about 5 s of imports per validate job) has its own tests (test_validate.py) and runs in
    # the embedded default's (test_embedded_default.py).
    config["validate"]["independent_forward"] = False
    # The regenerate stage has its own runs (test_regenerate.py, test_embedded_default.py); these
    # test the stages after it, on the dataset's replies.
    config["dataset"]["regenerate"]["enabled"] = False
    # The benchmark stage has its own runs (test_prompt_bench.py, test_embedded_default.py).
    config["benchmarks"]["run"] = {}
    return isolate(config, workdir)


def isolate(config: dict, workdir: Path) -> dict:
    """Own port and handoff dir, so concurrent test runs never meet."""
    config = copy.deepcopy(config)
    config["server"]["port"] = free_port()
    config["server"]["dump_root"] = str(workdir / "dumps")
    config["server"]["idle_timeout_s"] = 90
    return config


def write_config(workdir: Path, config: dict) -> Path:
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_on_toy_as_user_model(workdir: Path, config: dict, *targets: str) -> Path:
    """Build the toy target, move it to `workdir/target` as a user's model directory, then run
    `targets` with `model.path` pointing there."""
    write_config(workdir, config)
    run_snakemake(workdir, "--cores", "2", "models/toy-target/config.json")
    shutil.copytree(workdir / "models" / "toy-target", workdir / "target")
    shutil.rmtree(workdir / "models")
    config["model"]["path"] = str(workdir / "target")
    write_config(workdir, config)
    run_snakemake(workdir, "--cores", "2", *targets)
    return workdir


def copy_run(source: Path, workdir: Path) -> Path:
    """A private copy of a finished run (Snakemake metadata included): its own dataset file,
    port and handoff dir; the model stays where it was."""
    shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("dumps", "server"))
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["dataset"]["path"] = str(workdir / "conversations.jsonl")
    write_config(workdir, isolate(config, workdir))
    return workdir


def snakemake_argv(workdir: Path, *args: str) -> list[str]:
    return [
        SNAKEMAKE,
        "--snakefile",
        str(REPO_ROOT / "Snakefile"),
        "--directory",
        str(workdir),
        # One compute thread per job, as conftest.py gives every process: Snakemake sets a job's
        # OMP_NUM_THREADS to its rule's threads (train: 2), and two torch threads on cores the
        # other test workers share took twice the CPU of one (spinning on a descheduled peer).
        "--max-threads",
        "1",
        # Last on purpose: test_workflow.py checks how a target written right after it is read.
        "--configfile",
        str(workdir / "config.yaml"),
        *args,
    ]


def run_snakemake(
    workdir: Path, *args: str, check: bool = True, timeout: float = 900, env: dict | None = None
):
    """`snakemake ARGS` on the repository's Snakefile in `workdir`; `env` adds variables."""
    result = subprocess.run(
        snakemake_argv(workdir, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_env(), **(env or {})},
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({result.returncode}):\n"
            + result.stdout[-6000:]
            + result.stderr[-6000:]
        )
    return result


def start_snakemake(workdir: Path, *args: str, log: Path) -> subprocess.Popen:
    """Start snakemake in its own process group (so a test can signal or kill it whole)."""
    return subprocess.Popen(
        snakemake_argv(workdir, *args),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=_env(),
    )


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _env() -> dict:
    env = dict(os.environ)
    env.pop("EAGLEPIPE_RUN_TOKEN", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def copy_workflow(dest: Path) -> Path:
    """The repository's tracked and new files (what a user checks out), without outputs."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        source = REPO_ROOT / rel
        if source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    return dest


def dry_run_jobs(workdir: Path, *args: str) -> dict[str, int]:
    """Job counts per rule from `snakemake -n` (empty when nothing is left to do)."""
    out = run_snakemake(workdir, "-n", *args).stdout
    counts: dict[str, int] = {}
    in_stats = False
    for line in out.splitlines():
        if line.startswith("job ") and "count" in line:
            in_stats = True
            continue
        if in_stats:
            parts = line.split()
            if not parts or parts[0] == "total":
                break
            if parts[0].startswith("-"):
                continue
            counts[parts[0]] = int(parts[1])
    return counts

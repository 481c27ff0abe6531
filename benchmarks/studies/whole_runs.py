"""A whole pipeline run in a directory of its own, to the end or stopped as Ctrl-C stops it (the
studies that compare whole runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO_ROOT

SNAKEMAKE = [sys.executable, "-m", "snakemake"]  # also where snakemake has no script on PATH


def workflow_env() -> dict:
    env = dict(os.environ)
    env.pop("EAGLEPIPE_RUN_TOKEN", None)  # each run is its own (it stops its own server)
    return env


def run_workflow(
    run_dir: Path, cores: int, log_path: Path, *extra: str, timeout_s: float | None = None
) -> float:
    """One snakemake run in `run_dir` (its config.yaml) to the end; past `timeout_s` it is
    stopped as Ctrl-C stops it (its jobs end, its lock goes), so the next call with the same
    directory resumes it. Returns its seconds."""
    argv = [
        *SNAKEMAKE,
        "--snakefile",
        str(REPO_ROOT / "Snakefile"),
        "--directory",
        str(run_dir),
        "--configfile",
        str(run_dir / "config.yaml"),
        "--cores",
        str(cores),
        "--rerun-incomplete",
        *extra,
    ]
    started = time.monotonic()
    with open(log_path, "a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=workflow_env())
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise SystemExit(
                f"snakemake in {run_dir} stopped after {timeout_s:.0f}s (--deadline-s); "
                f"rerun with the same --work-root to resume; log: {log_path}"
            ) from None
    if proc.returncode != 0:
        raise SystemExit(f"snakemake failed in {run_dir}; log: {log_path}")
    return time.monotonic() - started

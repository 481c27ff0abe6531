"""Shard jobs run as the workflow runs them (each `scripts/<stage>.py` its own process, several
at once), and what the speed benchmarks record beside them: GPU utilisation and the client's
timing keys."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from benchmarks.common import REPO_ROOT


def shard_jobs_in_parallel(
    run_dir: Path,
    config: dict,
    names: list[str],
    jobs: int,
    *,
    stage: str = "extract",
    finish=None,
) -> list[dict]:
    """Each shard as its own `scripts/<stage>.py` process, `jobs` at a time (Snakemake's way);
    their manifests, each with the job's whole wall time. Extracted shards are removed once
    read (the disk holds only the shards in progress); regenerated ones are small and kept.

    `finish(shard_dir, manifest)`, if given, takes over an extracted shard once its job has
    exited, in one thread of its own (so the next job starts at once): what a user does when
    moving a finished shard to bulk storage (see `verify_and_delete`). All finish before this
    returns; the first error of one is raised."""
    from eaglepipe.core.config import write_resolved

    resolved = write_resolved(config, run_dir / ".eaglepipe" / "config.json")
    outputs = {"extract": "hidden_states", "regenerate": "regenerated"}[stage]
    finishing = ThreadPoolExecutor(1) if finish is not None else None
    pending = []

    def one(name: str) -> dict:
        argv = [sys.executable, "-u", str(REPO_ROOT / "scripts" / f"{stage}.py")]
        argv += ["--config", str(resolved), "--shard", name]
        started = time.perf_counter()
        born = time.time()
        done = subprocess.run(argv, cwd=run_dir, capture_output=True, text=True)
        ended = time.time()
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
        shard_dir = run_dir / outputs / name
        manifest = json.loads((shard_dir / "manifest.json").read_text())
        # The job's whole life (interpreter start, imports, lease) beside the manifest's timing.
        manifest["job_wall_s"] = round(time.perf_counter() - started, 3)
        # Wall-clock life of the job's process, to line up with the server's log and the GPU.
        manifest["job_window"] = [born, ended]
        if stage == "extract":
            if finishing is None:
                shutil.rmtree(shard_dir)
            else:
                pending.append(finishing.submit(finish, shard_dir, manifest))
        return manifest

    try:
        with ThreadPoolExecutor(jobs) as pool:
            manifests = list(pool.map(one, names))
    finally:
        if finishing is not None:
            finishing.shutdown(wait=True)
    for future in pending:
        future.result()
    return manifests


class GpuUtilisation:
    """Samples `nvidia-smi` GPU utilisation every 200 ms while in use (mean and samples; each
    sample's wall-clock time in `points`)."""

    def __init__(self):
        self.samples: list[int] = []
        self.points: list[tuple[float, int]] = []
        self._proc = None

    def __enter__(self) -> GpuUtilisation:
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu",
                 "--format=csv,noheader,nounits", "-lms", "200", "-i", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        self.points = [p for p in map(_gpu_sample, out.splitlines()) if p is not None]
        self.samples = [util for _, util in self.points]

    def summary(self) -> dict:
        if not self.samples:
            return {}
        return {
            "gpu_util_mean_pct": round(sum(self.samples) / len(self.samples), 1),
            "gpu_util_samples": len(self.samples),
        }


def _gpu_sample(line: str) -> tuple[float, int] | None:
    """One `timestamp, utilization.gpu` line of nvidia-smi (local time) as (epoch s, percent)."""
    stamp, _, util = line.rpartition(",")
    if not util.strip().isdigit():
        return None
    try:
        when = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None
    return when, int(util)


BREAKDOWN_KEYS = (
    "budget_wait_s",
    "bytes_wait_s",
    "dump_wait_s",
    "read_dump_s",
    "lookahead_wait_s",
    "chunk_write_s",
)

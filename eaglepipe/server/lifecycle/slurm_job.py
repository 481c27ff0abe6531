"""The SLURM job a server was started in, so the supervisor can stop it when that job ends.

With `ProctrackType=proctrack/cgroup` SLURM kills every process of a job when the job ends. With
`proctrack/linuxproc` or `proctrack/pgid` (clusters and containers without cgroups) it finds a
job's processes only through their parents or process group, and the server leaves both: it
runs in a session of its own, and it is orphaned once the job that started it exits. It would
then keep the node's GPUs after the job until its idle timeout, while SLURM may already have
given the node to the next job.

A job's processes carry `SLURM_JOB_ID` in their environment; slurmstepd, which starts them, does
not. The oldest process on this node with the job's id is the job's first one here: the batch
script on the batch node, which lives exactly as long as the job. (Not an ancestor: the
Snakemake plugin runs each job of a group job as a step of its own, through srun.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from .leases import ProcessRef

JOB_ID_ENV = "SLURM_JOB_ID"


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    first_process: ProcessRef

    def ended(self) -> bool:
        return not self.first_process.alive()

    def describe(self) -> str:
        return f"SLURM job {self.job_id} (first process {self.first_process.pid})"


def current_slurm_job() -> SlurmJob | None:
    """The SLURM job this process runs in, or None outside SLURM."""
    job_id = os.environ.get(JOB_ID_ENV)
    if not job_id:
        return None
    first = None
    for proc in psutil.process_iter(["create_time"]):
        try:
            if proc.environ().get(JOB_ID_ENV) != job_id:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if first is None or proc.info["create_time"] < first.create_time:
            first = ProcessRef(proc.pid, proc.info["create_time"])
    return SlurmJob(job_id, first) if first is not None else None

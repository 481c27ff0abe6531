"""The SLURM job a server was started in, so the supervisor can stop it when that job ends.

With `ProctrackType=proctrack/cgroup` SLURM kills every process of a job when the job ends. With
`proctrack/linuxproc` or `proctrack/pgid` (clusters and containers without cgroups) it finds a
job's processes only through their parents or process group, and the server leaves both: it
runs in a session of its own, and it is orphaned once the job that started it exits. It would
then keep the node's GPUs after the job until its idle timeout, while SLURM may already have
given the node to the next job.

A job's processes carry `SLURM_JOB_ID`; slurmstepd, which starts them, does not. So the outermost
ancestor of the process that starts the server with the same `SLURM_JOB_ID` is the job step's
first process (the batch script, or the task that `srun` started), and it lives exactly as long
as the step.
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
    step_leader: ProcessRef

    def ended(self) -> bool:
        return not self.step_leader.alive()

    def describe(self) -> str:
        return f"SLURM job {self.job_id} (step process {self.step_leader.pid})"


def current_slurm_job() -> SlurmJob | None:
    """The SLURM job this process runs in, or None outside SLURM (or if its step is unseen)."""
    job_id = os.environ.get(JOB_ID_ENV)
    if not job_id:
        return None
    leader = None
    for proc in psutil.Process().parents():  # nearest first
        try:
            if proc.environ().get(JOB_ID_ENV) != job_id:
                break
            leader = ProcessRef(proc.pid, proc.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            break
    if leader is None:
        return None
    return SlurmJob(job_id, leader)

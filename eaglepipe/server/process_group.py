"""A server's process group: finding its members safely and stopping them all."""

from __future__ import annotations

import os
import signal
import time

import psutil

from .leases import reap_started_children

# Every process of a server carries its instance id in this variable: how a stop recognises them.
INSTANCE_ENV = "EAGLEPIPE_SERVER_INSTANCE"


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


def stop_members(state: dict, grace_s: float) -> None:
    """SIGTERM every process of the server's group, SIGKILL what is left after `grace_s`."""
    pgid, since, instance = state["pgid"], state["create_time"], state["instance_id"]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        members = group_members(pgid, since, instance)
        if not members:
            return
        for proc in members:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                continue
        deadline = time.monotonic() + wait_s
        while group_members(pgid, since, instance) and time.monotonic() < deadline:
            reap_started_children()
            time.sleep(0.2)

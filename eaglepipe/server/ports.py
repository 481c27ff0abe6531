"""Who holds a TCP port: a bind probe, and the listening process found through psutil.

The lifecycle asks before starting a server, so that a port taken by someone else's process
ends in an error naming that process (never a kill), and waits on it after a stop, so that no
process of ours holds the port afterwards.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class PortHolder:
    """A process listening on the port; pid is None when the OS would not tell us (permissions)."""

    pid: int | None
    cmdline: str

    def describe(self) -> str:
        if self.pid is None:
            return "a process this user may not inspect"
        return f"PID {self.pid} ({self.cmdline or 'command line unavailable'})"


def port_is_free(host: str, port: int) -> bool:
    """True if a server could bind host:port now (SO_REUSEADDR, so TIME_WAIT does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def port_holders(port: int) -> list[PortHolder]:
    """Processes with a TCP socket listening on `port` (any address)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return [PortHolder(pid=None, cmdline="")]
    pids = sorted(
        {
            conn.pid if conn.pid is not None else -1
            for conn in connections
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
        }
    )
    return [
        PortHolder(pid=None, cmdline="") if pid == -1 else PortHolder(pid, _cmdline(pid))
        for pid in pids
    ]


def describe_port_holders(host: str, port: int) -> str:
    holders = port_holders(port)
    if not holders:
        return f"port {port} on {host} is in use, but no listening process could be identified"
    names = "; ".join(holder.describe() for holder in holders)
    return f"port {port} on {host} is held by {names}"


def wait_port_free(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not port_is_free(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True

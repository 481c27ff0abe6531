"""Which port a server listens on, and who holds a TCP port: a bind probe, and the listening
process found through psutil.

With `server.port: null` (the default) each working directory draws a port of its own
(`working_directory_port`), so two pipelines on one node never meet on a shared default. The
lifecycle asks before starting a server, so that a port taken by someone else's process ends
in an error naming that process (never a kill), and waits on it after a stop, so that no
process of ours holds the port afterwards.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import xxhash

from ...core.errors import PipelineError

# Where a working directory's port is drawn from: below Linux's ephemeral range (32768-60999,
# where client sockets bind), and below SGLang's limit (it also takes port + 10000).
DRAWN_PORTS = range(20000, 32768)
# Ports tried after the drawn one when it is taken, before giving up.
PORT_TRIES = 64


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


def working_directory_port(host: str, directory: str | os.PathLike) -> int:
    """The port of the server `directory`'s runs start when `server.port` is null.

    Drawn from the directory's real path, so two working directories on one node (two users, or
    two runs of one user) draw different ports and a directory keeps its port from run to run;
    when that port is taken, the next free one. The server state records the port chosen, and
    every job reads its server's address from there.
    """
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        # Else every port looks taken and the advice would be to set server.port.
        raise PipelineError(f"server.host {host} does not resolve to an address ({exc})") from None
    key = str(Path(directory).resolve()).encode()
    first = xxhash.xxh3_64_intdigest(key) % len(DRAWN_PORTS)
    for offset in range(PORT_TRIES):
        port = DRAWN_PORTS[(first + offset) % len(DRAWN_PORTS)]
        if port_is_free(host, port):
            return port
    start = DRAWN_PORTS[first]
    raise PipelineError(
        f"no free port on {host} among {PORT_TRIES} from {start} (drawn for {directory}): "
        "set server.port to a free port"
    )


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, or a name resolving to them)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def exposure_warning(host: str, port: int) -> str | None:
    """One line when the server will listen where other machines can reach it."""
    if is_loopback(host):
        return None
    return (
        f"warning: server.host {host} is not a loopback address: the hidden-state server has no "
        f"authentication, so whoever reaches port {port} of this node can use it and fill its "
        "handoff directory; keep server.host 127.0.0.1 unless clients on other machines need it"
    )

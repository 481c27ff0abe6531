"""A real single-host SLURM cluster for tests, in a scratch directory.

It starts, each on its own socket or free port and with all state under one directory:
munged (its own key), MariaDB (slurmdbd's database), slurmdbd (so `sacct` works as on a real
cluster, and the Snakemake SLURM plugin polls job states with it, its default), slurmctld and
one slurmd. The node has this machine's CPUs and memory (`slurmd -C`), no GPUs, and runs in
UTS and mount namespaces of its own: its hostname is `node1`, so jobs on it see another host
than the login side, as on a cluster (the pipeline's per-node server directory is
`.eaglepipe/server/node1/`), and it sees the generated configuration in /etc/slurm, where
compute nodes keep it (the Snakemake plugin starts job steps without SLURM_CONF). Partitions:
`main` (the default) and `gpu`. Accounting knows one account, `eaglepipe`, with the current
user in it.

Containers without cgroups work: processes are tracked through the /proc parent tree
(proctrack/linuxproc), tasks are not bound (task/none). Time limits, `scancel`, sacct and
srun inside jobs behave as on a real cluster. Every daemon runs in the foreground as a child of
this process; `stop()` cancels what is still queued or running, stops the daemons in reverse
order and checks that none of them, and no job step they started, is left.

By hand (as root; the Debian packages are those `.ci/run` installs):

    python tests/slurm_cluster.py [--dir /tmp/eaglepipe-slurm]   # Ctrl-C stops it
    export SLURM_CONF=/tmp/eaglepipe-slurm/etc/slurm.conf        # (printed) then sinfo, sbatch...
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from conftest import free_port

# What `.ci/run` installs; also the command a skipped test names.
APT_PACKAGES = (
    "munge slurmctld slurmd slurm-client slurmdbd mariadb-server-core mariadb-client-core"
)
INSTALL_COMMAND = (
    "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
    f"--no-install-recommends {APT_PACKAGES}"
)
PROGRAMS = ("munged", "mungekey", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld")
PROGRAMS += ("slurmd", "unshare", "sbatch", "srun", "squeue", "sacct", "sacctmgr", "scancel")
PROGRAMS += ("scontrol", "sinfo")
NODE = "node1"
DEFAULT_PARTITION = "main"
GPU_PARTITION = "gpu"
ACCOUNT = "eaglepipe"
CLUSTER = "eaglepipe-test"
# Where SLURM's commands look for slurm.conf without SLURM_CONF (created by the packages).
SYSTEM_CONF_DIR = Path("/etc/slurm")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


class ClusterError(RuntimeError):
    """The test cluster could not be started or stopped; the message says which daemon and why."""


def missing_requirements() -> str | None:
    """Why this machine cannot run the test cluster, or None when it can."""
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        return f"SLURM test cluster: {', '.join(missing)} not installed; as root: {INSTALL_COMMAND}"
    if not SYSTEM_CONF_DIR.is_dir():
        return f"SLURM test cluster: {SYSTEM_CONF_DIR} does not exist; as root: {INSTALL_COMMAND}"
    if os.geteuid() != 0:
        return "SLURM test cluster: slurmd must run as root to start jobs; run the tests as root"
    return None


def detected_node() -> dict[str, str]:
    """This machine's CPUs, sockets, cores and memory, as slurmd itself reports them."""
    done = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60)
    first = done.stdout.splitlines()[0] if done.stdout else ""
    fields = dict(re.findall(r"(\w+)=(\S+)", first))
    if done.returncode != 0 or "CPUs" not in fields or "RealMemory" not in fields:
        raise ClusterError(f"slurmd -C failed ({done.returncode}): {done.stderr.strip()}")
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    return {key: fields[key] for key in keep if key in fields}


@dataclass
class SlurmCluster:
    root: Path
    node: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    # ------------------------------------------------------------------ layout

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def db_socket(self) -> Path:
        return self.root / "mysql" / "mysqld.sock"

    @property
    def env(self) -> dict[str, str]:
        """The environment for SLURM's client commands (and snakemake) against this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def cpus(self) -> int:
        return int(self.node["CPUs"])

    # ------------------------------------------------------------------ start

    def start(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def _start(self) -> None:
        reason = missing_requirements()
        if reason:
            raise ClusterError(reason)
        for sub in ("etc", "log", "munge", "mysql", "ctld", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.node = detected_node()
        self.ports = {name: free_port() for name in ("slurmctld", "slurmd", "slurmdbd")}
        self._write_configs()
        self._start_munge()
        self._start_database()
        self._start_slurmdbd()
        self._register_accounts()
        self._spawn("slurmctld", ["slurmctld", "-D"])
        self._wait("slurmctld", lambda: self._run("scontrol", "ping", check=False).find("UP") >= 0)
        # The node gets a hostname of its own, so jobs see another host than the login side,
        # and the configuration where compute nodes keep it: the SLURM plugin starts job steps
        # (srun) without SLURM_CONF. Both stay inside slurmd's own UTS and mount namespaces.
        node_setup = f"mount --bind {self.etc} {SYSTEM_CONF_DIR} && hostname {NODE}"
        self._spawn(
            "slurmd",
            [
                "unshare",
                "--mount",
                "--uts",
                "sh",
                "-c",
                f"{node_setup} && exec slurmd -D -N {NODE}",
            ],
        )
        self._wait("slurmd", lambda: self.node_state() == "idle")

    def _write_configs(self) -> None:
        hostname = socket.gethostname()
        node = " ".join(f"{key}={value}" for key, value in self.node.items())
        r = self.root
        self.conf.write_text(
            f"""# Generated by tests/slurm_cluster.py: one host, no cgroups, all state under {r}.
ClusterName={CLUSTER}
SlurmctldHost={hostname}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={self.ports["slurmctld"]}
SlurmdPort={self.ports["slurmd"]}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={r}/ctld
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd.log
# Without cgroups: processes tracked through /proc parents, tasks not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
# sacct needs slurmdbd; the plugin's default status command is sacct, as on most clusters.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.ports["slurmdbd"]}
AccountingStoragePass={self.munge_socket}
AccountingStoreFlags=job_comment
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
# A cancelled or timed-out job gets SIGTERM, then SIGKILL after this many seconds (SLURM's
# default is 30): short, so tests are quick and the pipeline's clean-up must not need longer.
KillWait=5
InactiveLimit=0
# How long squeue still shows an ended job (SLURM's default).
MinJobAge=300
NodeName={NODE} NodeHostname={NODE} NodeAddr=127.0.0.1 {node} State=UNKNOWN
PartitionName={DEFAULT_PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
PartitionName={GPU_PARTITION} Nodes={NODE} MaxTime=INFINITE State=UP
"""
        )
        # slurmdbd reads slurmdbd.conf next to slurm.conf; it must be private to SlurmUser.
        dbd = self.etc / "slurmdbd.conf"
        dbd.write_text(
            f"""AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.ports["slurmdbd"]}
SlurmUser=root
LogFile={self.logs}/slurmdbd.log
PidFile={r}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
"""
        )
        dbd.chmod(0o600)

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        self._run_tool(["mungekey", "--create", f"--keyfile={key}"], "mungekey")
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                # The socket may sit below private directories (pytest's tmp dirs are 0700):
                # every client of this cluster runs as the same user.
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--log-file={self.logs / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
        )
        self._wait("munged", lambda: _accepts_unix(self.munge_socket))

    def _start_database(self) -> None:
        data = self.root / "mysql" / "data"
        self._run_tool(
            [
                "mariadb-install-db",
                "--no-defaults",
                f"--datadir={data}",
                "--user=root",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ],
            "mariadb-install-db",
        )
        self._spawn(
            "mariadbd",
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={data}",
                "--user=root",
                f"--socket={self.db_socket}",
                "--skip-networking",
                f"--pid-file={self.root / 'mysql' / 'mysqld.pid'}",
                f"--log-error={self.logs / 'mariadbd.log'}",
                # gVisor and some container runtimes lack Linux native AIO.
                "--innodb-use-native-aio=0",
                "--innodb-buffer-pool-size=64M",
                "--innodb-lock-wait-timeout=900",
            ],
        )
        self._wait("mariadbd", lambda: _accepts_unix(self.db_socket))

    def _start_slurmdbd(self) -> None:
        # The MariaDB client library takes its default socket from this variable.
        self._spawn(
            "slurmdbd", ["slurmdbd", "-D"], extra_env={"MYSQL_UNIX_PORT": str(self.db_socket)}
        )
        self._wait("slurmdbd", lambda: _accepts_tcp(self.ports["slurmdbd"]))

    def _register_accounts(self) -> None:
        user = getpass.getuser()
        self._run("sacctmgr", "-i", "add", "cluster", CLUSTER)
        self._run("sacctmgr", "-i", "add", "account", ACCOUNT, f"cluster={CLUSTER}")
        self._run("sacctmgr", "-i", "add", "user", user, f"account={ACCOUNT}", f"cluster={CLUSTER}")

    # ------------------------------------------------------------------ queries

    def node_state(self) -> str:
        """The node's state as sinfo prints it (one line per partition), e.g. `idle`."""
        out = self._run("sinfo", "-h", "-N", "-n", NODE, "-o", "%T", check=False)
        states = {line.strip() for line in out.splitlines() if line.strip()}
        return states.pop() if len(states) == 1 else ",".join(sorted(states))

    def squeue(self, workdir: Path | None = None) -> list[tuple[str, str]]:
        """(job id, state) of every job not yet ended (of those started in `workdir`)."""
        out = self._run("squeue", "-h", "-o", "%i|%T|%Z", check=False)
        jobs = [line.split("|", 2) for line in out.splitlines() if line.count("|") == 2]
        return [
            (job_id, state)
            for job_id, state, where in jobs
            if workdir is None or Path(where) == Path(workdir)
        ]

    def scancel(self, job_id: str) -> None:
        self._run("scancel", job_id)

    def sacct(self, *args: str) -> list[dict[str, str]]:
        """Whole jobs (no steps) as dicts of the given fields, from the accounting database."""
        fields = ["JobIDRaw", "JobName", "Partition", "Account", "State", "Comment", "NodeList"]
        fields += ["AllocCPUS", "ReqMem", "Timelimit", "WorkDir%400", *args]
        out = self._run(
            "sacct", "-a", "-X", "-P", "-n", "--format", ",".join(fields), "-S", "now-1days"
        )
        names = [name.split("%")[0] for name in fields]
        return [dict(zip(names, line.split("|"), strict=False)) for line in out.splitlines()]

    def _run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise ClusterError(
                f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}"
            )
        return done.stdout

    # ------------------------------------------------------------------ stop

    def stop(self, check: bool = True) -> None:
        """Cancel every job, stop the daemons (last started first), check nothing is left."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._run("scancel", "--full", "--user", getpass.getuser(), check=False)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self.squeue() and time.monotonic() < deadline:
                time.sleep(0.5)
        steps_before = self.job_steps()
        for name in reversed(list(self.procs)):
            _terminate(self.procs[name])
        # A step that outlived slurmd (it was killed, or a job ignored the cancel): kill it.
        for proc in steps_before + self.job_steps():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if not check:
            return
        left = [f"{name} (pid {p.pid})" for name, p in self.procs.items() if p.poll() is None]
        left += [f"slurmstepd (pid {p.pid})" for p in self.job_steps()]
        if left:
            raise ClusterError(f"still running after stop: {', '.join(left)}")

    def job_steps(self) -> list[psutil.Process]:
        """slurmstepd processes of this cluster's slurmd (they carry its SLURM_CONF)."""
        found = []
        for proc in psutil.process_iter(["name"]):
            if proc.info["name"] != "slurmstepd":
                continue
            try:
                if proc.environ().get("SLURM_CONF") == str(self.conf):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    # ------------------------------------------------------------------ helpers

    def _spawn(self, name: str, argv: list[str], extra_env: dict | None = None) -> None:
        out = (self.logs / f"{name}.out").open("w")
        self.procs[name] = subprocess.Popen(
            argv,
            env={**self.env, **(extra_env or {})},
            cwd=self.root,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _run_tool(self, argv: list[str], name: str) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if done.returncode != 0:
            raise ClusterError(f"{name} failed ({done.returncode}): {_last(done.stderr)}")

    def _wait(self, name: str, ready) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        proc = self.procs[name]
        while not ready():
            if proc.poll() is not None:
                raise ClusterError(
                    f"{name} exited with {proc.returncode} while starting: {self._log_tail(name)}"
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{name} not ready within {START_TIMEOUT_S:.0f}s: {self._log_tail(name)}"
                )
            time.sleep(0.2)

    def _log_tail(self, name: str) -> str:
        lines = []
        for path in (self.logs / f"{name}.log", self.logs / f"{name}.out"):
            if path.exists():
                lines += path.read_text(errors="replace").splitlines()[-8:]
        return " | ".join(lines) or "(no log)"


def _last(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def _accepts_unix(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _accepts_tcp(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S / 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S / 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="state directory (default: a new temp dir)")
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="eaglepipe-slurm-"))
    cluster = SlurmCluster(root.resolve())
    # SIGTERM stops the cluster as Ctrl-C does, also while it starts.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}  # node {NODE}: {cluster.node}; Ctrl-C stops it")
        signal.pause()
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        cluster.stop()
        print("stopped; nothing left running")
    return 0


if __name__ == "__main__":
    sys.exit(main())

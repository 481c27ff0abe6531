"""The supervisor: the process-group leader that runs one server engine and outlives its jobs.

    python -u -m eaglepipe.server.lifecycle.supervise --state-dir D --idle-timeout S --lease-ttl S \
        --dump-dir DIR -- <engine argv>

The lifecycle starts it in a new session (its own process group) with stdout and stderr going
to the server log. It runs the engine as a child in the same group, forwards SIGTERM/SIGINT to
the whole group, and stops the group when no lease has been live for the idle timeout: the
last resort when the workflow that started the server was killed and never stopped it. Started
inside a SLURM job, it also stops the group as soon as that job has ended and no lease is live
(`slurm_job.py` says why SLURM may not). It exits when the engine exits, and removes its
instance's dump directory on the way out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import filelock
import psutil

from .leases import ServerPaths, append_history, live_leases, pinned_instance, read_json
from .slurm_job import current_slurm_job

# The lifecycle SIGKILLs the group this long after its SIGTERM; the supervisor escalates sooner
# so it can still clean up.
ENGINE_STOP_GRACE_S = 15.0


def log(message: str) -> None:
    print(f"[supervisor {time.strftime('%H:%M:%S')}] {message}", flush=True)


def owner_file(dump_dir: Path) -> Path:
    return dump_dir.with_name(dump_dir.name + ".owner.json")


def group_members_except_self() -> list[psutil.Process]:
    pgid = os.getpgid(0)
    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def stop_engine(engine: subprocess.Popen, reason: str) -> None:
    """SIGTERM every other member of our group, then SIGKILL what is left after the grace."""
    log(f"stopping engine pid {engine.pid}: {reason}")
    for proc in group_members_except_self():
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            continue
    try:
        engine.wait(timeout=ENGINE_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        log(f"engine pid {engine.pid} ignored SIGTERM for {ENGINE_STOP_GRACE_S:.0f}s; SIGKILL")
    leftovers = group_members_except_self()
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    engine.wait()
    psutil.wait_procs(leftovers, timeout=ENGINE_STOP_GRACE_S)


class Supervisor:
    def __init__(self, args: argparse.Namespace):
        self.paths = ServerPaths(Path(args.state_dir))
        self.idle_timeout_s = args.idle_timeout
        self.lease_ttl_s = args.lease_ttl
        self.dump_dir = Path(args.dump_dir) if args.dump_dir else None
        self.instance_id = args.instance_id
        self.engine_argv = args.engine
        self.stop_signal: int | None = None
        self.slurm_job = current_slurm_job()

    def on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def in_use(self) -> bool:
        if self.instance_id and pinned_instance(self.paths) == self.instance_id:
            return True
        return bool(live_leases(self.paths, self.lease_ttl_s))

    def stop_if_still_idle(self, engine: subprocess.Popen, reason: str) -> bool:
        """Stop the engine if no job uses it, deciding and stopping under the lifecycle lock.

        A job creates its lease before it takes the lock, so once we hold the lock every job
        about to reuse this server is visible; and holding it until the engine is gone means
        no job starts a new server while our port is still taken. A busy lock means a job is
        deciding right now: try again on the next round.
        """
        lock = filelock.FileLock(self.paths.lock)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            return False
        try:
            if self.in_use():
                return False
            stop_engine(engine, reason)
            state = read_json(self.paths.state)
            if state and state.get("pid") == os.getpid():
                self.paths.state.unlink(missing_ok=True)
            return True
        finally:
            lock.release()

    @property
    def idle_reason(self) -> str:
        return f"no live lease for {self.idle_timeout_s:g}s (server.idle_timeout_s)"

    def unused_reason(self, last_in_use: float) -> str | None:
        """Why to stop a server no lease uses now, or None to keep it for the next job."""
        if time.monotonic() - last_in_use > self.idle_timeout_s:
            return self.idle_reason
        if self.slurm_job is not None and self.slurm_job.ended():
            return f"{self.slurm_job.describe()} that started it ended; no live lease"
        return None

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        log(f"pid {os.getpid()} starting engine: {' '.join(self.engine_argv)}")
        engine = subprocess.Popen(self.engine_argv, stdin=subprocess.DEVNULL)
        log(f"engine pid {engine.pid}")
        poll_s = min(1.0, max(self.lease_ttl_s / 4, 0.1))
        last_in_use = time.monotonic()
        reason = "engine exited"
        stopped_unused = False
        if self.slurm_job is not None:
            log(f"started in {self.slurm_job.describe()}: stopping when it ends, if unused")
        while True:
            code = engine.poll()
            if code is not None:
                log(f"engine pid {engine.pid} exited with code {code}")
                reason = f"engine exited with code {code}"
                break
            if self.stop_signal is not None:
                reason = f"received {signal.Signals(self.stop_signal).name}"
                stop_engine(engine, reason)
                break
            if self.in_use():
                last_in_use = time.monotonic()
            elif (unused := self.unused_reason(last_in_use)) is not None:
                if self.stop_if_still_idle(engine, unused):
                    reason, stopped_unused = unused, True
                    break
            time.sleep(poll_s)
        self.clean_up(reason, engine.returncode)
        if self.stop_signal is not None or stopped_unused:
            return 0
        code = engine.returncode
        return code if code >= 0 else 128 - code

    def forget_state(self) -> None:
        """Remove the state file if it still names this supervisor, so nobody reads a dead server
        as running (after SLURM's SIGTERM, say, when the job's own clean-up was cut short).

        Only if the lock is free now: a job holding it is stopping this server and removes the
        file itself, and waiting for it would hold up the stop that job waits for.
        """
        lock = filelock.FileLock(self.paths.lock)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            return
        try:
            state = read_json(self.paths.state)
            if state and state.get("pid") == os.getpid():
                self.paths.state.unlink(missing_ok=True)
        finally:
            lock.release()

    def clean_up(self, reason: str, code: int | None) -> None:
        self.forget_state()
        if self.dump_dir is not None:
            shutil.rmtree(self.dump_dir, ignore_errors=True)
            owner_file(self.dump_dir).unlink(missing_ok=True)
        append_history(
            self.paths, "exit", pid=os.getpid(), instance_id=self.instance_id, reason=reason
        )
        log(f"exiting: {reason}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--idle-timeout", type=float, required=True)
    parser.add_argument("--lease-ttl", type=float, required=True)
    parser.add_argument("--dump-dir", default=None)
    parser.add_argument("--instance-id", default=None)
    parser.add_argument("engine", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.engine and args.engine[0] == "--":
        args.engine = args.engine[1:]
    if not args.engine:
        parser.error("no engine command given after --")
    return args


def main(argv: list[str] | None = None) -> int:
    return Supervisor(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())

"""The 8B-shape comparison (scale_steps.py), (a) after a `kill -9` half-way: when to kill,
the kill itself, what each tool's rerun kept and redid, whether the shards are whole, and
the steady generation rates."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import log
from benchmarks.studies.specforge.steps import MARGIN_S, Command, Context, StepFailed, show, tail

# SpecForge's feature files (written by its prepare_hidden_states.py).
SPECFORGE_FILES = "rows_*/data_*.ckpt*"


# ---------------------------------------------------------------- killing half-way


@dataclass(frozen=True)
class KillPlan:
    """When to `kill -9`: once `fraction` of the rows are stored, at the first poll that sees
    a file being written (so the kill lands inside a write), or `wait_for_write_s` later."""

    fraction: float = 0.5
    poll_s: float = 0.002
    wait_for_write_s: float = 5.0
    # Looks are that fast only from `fraction - near` of the rows on; before, every idle_poll_s.
    near: float = 0.1
    idle_poll_s: float = 0.05

    def pause(self, done: int, total: int) -> float:
        return self.poll_s if done >= (self.fraction - self.near) * total else self.idle_poll_s


def kill_due(
    done: int, total: int, writing: bool, reached_at: float | None, now: float, plan: KillPlan
) -> tuple[bool, float | None]:
    """(kill now?, when the fraction was first reached)."""
    if done < plan.fraction * total:
        return False, None
    reached_at = now if reached_at is None else reached_at
    return writing or now - reached_at >= plan.wait_for_write_s, reached_at


class SpecforgeWatch:
    """SpecForge's progress: the feature files present, and whether one appeared since the last
    look (its writer creates a file and then fills it: a new file is one being written)."""

    def __init__(self, features: Path):
        self.features = Path(features)
        self.seen: set[str] = set()

    def __call__(self) -> tuple[int, bool]:
        names = {p.name for p in self.features.glob(SPECFORGE_FILES)}
        appeared = bool(names - self.seen)
        self.seen = names
        return len(names), appeared


class PipelineWatch:
    """The pipeline's progress: rows of journalled chunks, and whether a chunk is being written
    (its temporary file exists)."""

    def __init__(self, shard_dirs: list[Path]):
        self.shard_dirs = [Path(d) for d in shard_dirs]

    def __call__(self) -> tuple[int, bool]:
        from eaglepipe.extract.shard_files import read_journal

        done = sum(
            len(entry.get("row_ids", ()))
            for shard_dir in self.shard_dirs
            for entry in read_journal(shard_dir).values()
        )
        writing = any(any(d.glob(".chunk-*.tmp")) for d in self.shard_dirs if d.is_dir())
        return done, writing


def start(command: Command) -> subprocess.Popen:
    command.log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"[{command.name}] {' '.join(command.argv)}  (log {command.log_path})")
    with open(command.log_path, "ab") as out:
        return subprocess.Popen(
            command.argv, cwd=command.cwd, env=command.env, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def kill_trees(procs: list[subprocess.Popen], wait_s: float = 30.0) -> None:
    """SIGKILL every process of each command's tree, and wait until they are gone (the GPU
    memory of a killed process is free once it is). The tree, not the process group: torchrun
    starts its workers in sessions of their own, so killing its group would leave SpecForge's
    worker running."""
    import psutil

    victims = []
    for proc in procs:
        try:
            parent = psutil.Process(proc.pid)
            victims += [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        # Also what left the tree but kept the group (reparented workers).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    psutil.wait_procs(victims, timeout=wait_s)
    for proc in procs:
        proc.poll()


def run_and_kill(ctx: Context, commands: list[Command], watch, total: int, plan: KillPlan) -> dict:
    """Start the commands, and `kill -9` all of them when `kill_due` says so (or at the deadline);
    what was stored at that moment, and the seconds from the start."""
    if ctx.args.dry_run:
        for command in commands:
            show(ctx, command)
        log(f"[{commands[0].name}] kill -9 once {plan.fraction:.0%} of {total} rows are stored")
        return {}
    started, wall_started = time.monotonic(), time.time()
    procs = [start(c) for c in commands]
    reached_at, done, writing, killed = None, 0, False, False
    try:
        while True:
            done, writing = watch()
            due, reached_at = kill_due(done, total, writing, reached_at, time.monotonic(), plan)
            if due:
                killed = True
                break
            if all(p.poll() is not None for p in procs):
                break
            if ctx.left() < MARGIN_S:
                raise StepFailed(f"{commands[0].name}: out of time before the kill", 124)
            time.sleep(plan.pause(done, total))
    finally:
        kill_trees(procs)
    seconds = time.monotonic() - started
    codes = [p.returncode for p in procs]
    if not killed:
        tails = "\n".join(tail(c.log_path, 15) for c in commands)
        raise StepFailed(f"{commands[0].name}: ended (exit {codes}) before the kill:\n{tails}")
    log(f"[{commands[0].name}] kill -9 after {seconds:.1f}s: {done}/{total} rows stored, "
        f"a write in flight: {writing}")  # fmt: skip
    return {
        "started_at": wall_started,
        "killed_after_s": round(seconds, 2),
        "rows_stored_at_kill": done,
        "rows": total,
        "write_in_flight_at_kill": writing,
        "fraction_reached_s": None if reached_at is None else round(reached_at - started, 2),
    }


# ---------------------------------------------------------------- what the rerun kept


def specforge_file_complete(path: Path) -> bool:
    """Whether a SpecForge feature file was written to its end: torch.save writes a zip whose
    central directory comes last, so a file cut short has none."""
    return zipfile.is_zipfile(path)


def specforge_snapshot(features: Path) -> dict[str, dict]:
    """Each feature file (path under `features`): bytes, mtime, written to its end or not."""
    snapshot = {}
    for path in sorted(Path(features).glob(SPECFORGE_FILES)):
        stat = path.stat()
        snapshot[str(path.relative_to(features))] = {
            "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "complete": specforge_file_complete(path),
        }
    return snapshot


def same_file(a: dict, b: dict) -> bool:
    return a["bytes"] == b["bytes"] and a["mtime_ns"] == b["mtime_ns"]


def _names(names, limit: int = 20) -> list[str]:
    return sorted(names)[:limit]


def specforge_resume_report(at_kill: dict, after: dict, expected: int) -> dict:
    """What SpecForge's rerun did with the files the kill left: kept (untouched), rewritten,
    new; a file cut short at the kill and left as it was is one the rerun took as done."""
    kept = {n for n in at_kill if n in after and same_file(at_kill[n], after[n])}
    rewritten = {n for n in at_kill if n in after and not same_file(at_kill[n], after[n])}
    new = set(after) - set(at_kill)
    torn = {n for n, f in at_kill.items() if not f["complete"]}
    incomplete = {n for n, f in after.items() if not f["complete"]}
    return {
        "files_at_kill": len(at_kill),
        "torn_at_kill": len(torn),
        "torn_files": _names(torn),
        "kept": len(kept),
        "rewritten": len(rewritten),
        "new": len(new),
        "removed": len(set(at_kill) - set(after)),
        "torn_taken_as_done": len(torn & kept),
        "files_after": len(after),
        "expected_files": expected,
        "incomplete_after": len(incomplete),
        "incomplete_files": _names(incomplete),
        "complete": len(after) == expected and not incomplete,
    }


def shard_snapshot(shard_dir: Path) -> dict:
    """A shard directory as a kill left it: chunk files (bytes, mtime), the chunks the journal
    vouches for (with their rows and tokens), temporary files, whether a manifest exists."""
    from eaglepipe.extract.shard_files import MANIFEST_NAME, read_journal

    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        return {"chunks": {}, "journal": {}, "tmp": [], "manifest": False}
    chunks = {}
    for path in sorted(shard_dir.glob("chunk-*.safetensors")):
        stat = path.stat()
        chunks[path.name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    journal = {
        name: {"rows": len(e.get("row_ids", ())), "tokens": int(e.get("num_tokens", 0))}
        for name, e in read_journal(shard_dir).items()
    }
    return {
        "chunks": chunks,
        "journal": journal,
        "tmp": sorted(p.name for p in shard_dir.glob(".*.tmp")),
        "manifest": (shard_dir / MANIFEST_NAME).is_file(),
    }


def chunk_fates(before: dict, now: dict, manifest: dict) -> tuple[list[dict], list[dict]]:
    """The manifest's chunks the rerun kept (journalled at the kill and untouched since) and
    those it wrote."""
    kept, written = [], []
    for chunk in manifest["chunks"]:
        name = chunk["file"]
        was = before["chunks"].get(name)
        if name in before["journal"] and was is not None and same_file(was, now["chunks"][name]):
            kept.append(chunk)
        else:
            written.append(chunk)
    return kept, written


def pipeline_resume_report(at_kill: dict[str, dict], after: dict[str, dict], manifests) -> dict:
    """Per shard and in all: the chunks the rerun kept, those it wrote (again or for the first
    time), the rows it had to request, and what the kill had left that the rerun removed
    (temporary files, chunks the journal did not vouch for)."""
    keys = ("chunks_kept", "chunks_written", "rows_kept", "rows_redone", "tmp_at_kill",
            "unjournalled_at_kill", "tmp_after", "requests_sent")  # fmt: skip
    shards, totals = {}, dict.fromkeys(keys, 0)
    for shard, manifest in manifests.items():
        before, now = at_kill[shard], after[shard]
        kept, written = chunk_fates(before, now, manifest)
        entry = {
            "chunks": len(manifest["chunks"]),
            "chunks_kept": len(kept),
            "chunks_written": len(written),
            "rows_kept": sum(len(c["row_ids"]) for c in kept),
            "rows_redone": sum(len(c["row_ids"]) for c in written),
            "tmp_at_kill": len(before["tmp"]),
            "unjournalled_at_kill": sum(1 for n in before["chunks"] if n not in before["journal"]),
            "tmp_after": len(now["tmp"]),
            "requests_sent": int(manifest.get("timing", {}).get("requests_sent", 0)),
        }
        shards[shard] = entry
        for key in keys:
            totals[key] += entry[key]
    return {"shards": shards, **totals}


def pipeline_completions(at_kill: dict, after: dict, manifests: dict) -> tuple[list, list]:
    """(time, tokens) of the chunks finished before the kill (journalled then) and of those
    the rerun wrote, from the chunk files' mtimes."""
    killed, resumed = [], []
    for shard, manifest in manifests.items():
        before = at_kill[shard]
        for name, entry in before["journal"].items():
            if name in before["chunks"]:
                killed.append((before["chunks"][name]["mtime_ns"] / 1e9, entry["tokens"]))
        _, written = chunk_fates(before, after[shard], manifest)
        for chunk in written:
            mtime = after[shard]["chunks"][chunk["file"]]["mtime_ns"] / 1e9
            resumed.append((mtime, chunk["num_tokens"]))
    return killed, resumed


def verify_shards(shard_dirs: list[Path], row_tokens: dict[int, int]) -> dict:
    """The validation stage's integrity checks of every shard (each listed chunk there with its
    size, re-hashed against the manifest, no unlisted chunk), and the rows they hold against
    the prepared table's: the result is whole and right when `ok`."""
    from eaglepipe.core.manifest import read_manifest
    from eaglepipe.extract.shard_files import HIDDEN_STATES_MANIFEST
    from eaglepipe.validate.integrity import (
        check_chunk_checksum,
        check_chunk_file,
        check_no_stray_chunks,
    )

    errors, rows, tokens, chunk_bytes, all_bytes = [], {}, 0, 0, 0
    for shard_dir in shard_dirs:
        shard = Path(shard_dir).name
        try:
            manifest, _ = read_manifest(Path(shard_dir), HIDDEN_STATES_MANIFEST, shard=shard)
            for entry in manifest["chunks"]:
                check_chunk_file(Path(shard_dir), shard, entry)
                check_chunk_checksum(Path(shard_dir), shard, entry)
                chunk_bytes += entry["bytes"]
                for row_id in entry["row_ids"]:
                    rows[row_id] = rows.get(row_id, 0) + 1
            check_no_stray_chunks(Path(shard_dir), shard, manifest)
            tokens += manifest["num_tokens"]
        except Exception as exc:  # noqa: BLE001 - every failed check is reported, not raised
            errors.append(f"{shard}: {exc}"[:500])
        all_bytes += sum(p.stat().st_size for p in Path(shard_dir).rglob("*") if p.is_file())
    missing = sorted(set(row_tokens) - set(rows))
    twice = sorted(r for r, n in rows.items() if n > 1)
    expected_tokens = sum(row_tokens.values())
    return {
        "ok": not errors and not missing and not twice and tokens == expected_tokens,
        "errors": errors,
        "rows": len(rows),
        "missing_rows": missing[:20],
        "rows_twice": twice[:20],
        "tokens": tokens,
        "expected_tokens": expected_tokens,
        "chunk_bytes": chunk_bytes,
        "dir_bytes": all_bytes,
    }


# ---------------------------------------------------------------- rates


def steady_rate(completions: list[tuple[float, int]]) -> dict:
    """Tokens stored per second between the first and the last file finished in a run (file
    mtimes): the generator's rate once it runs, start-up left out. The first file's tokens are
    not counted (its work began before the span)."""
    done = sorted(completions)
    if len(done) < 2 or done[-1][0] <= done[0][0]:
        return {"files": len(done), "tokens": None, "seconds": None, "tokens_per_s": None}
    tokens = sum(t for _, t in done[1:])
    seconds = done[-1][0] - done[0][0]
    return {
        "files": len(done),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def combined_rate(rates: list[dict]) -> float | None:
    """Tokens over seconds summed over runs (each run's own span)."""
    parts = [r for r in rates if r.get("tokens_per_s")]
    if not parts:
        return None
    return round(sum(r["tokens"] for r in parts) / sum(r["seconds"] for r in parts), 1)


def specforge_completions(snapshot: dict, names, tokens_per_file: int) -> list[tuple[float, int]]:
    return [
        (snapshot[n]["mtime_ns"] / 1e9, tokens_per_file) for n in names if snapshot[n]["complete"]
    ]

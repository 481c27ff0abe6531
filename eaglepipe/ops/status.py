"""Where a long extraction stands: per-shard state, totals, recent throughput and an ETA.

Built for thousands of shards: it never opens a chunk file. Per shard it stats the shard
directory and reads at most the small JSON files (manifest, journal, lock, failure record),
so `eaglepipe status` answers in seconds on a 5,000-shard run.

A shard is
- done: `manifest.json` exists (the manifest is written last, atomically);
- stale: done, but from other rows or settings than the config status was given: the same
  rule as the workflow's (`plan.freshness.staleness`), so the next run makes it again;
- running: its lock file names a live process (chunks done of planned from `journal.jsonl`);
- failed: not done, not running, and its last attempt recorded why it failed (`failed.json`,
  gone once another attempt starts or the shard directory is removed);
- partial: not done, not running, no failure, but some chunks are journaled (a killed job, or
  a damaged shard `eaglepipe verify` set aside);
- remaining: nothing of it exists yet.

Shard directories the plan does not contain (an earlier `rows_per_shard`) are listed apart.
The stages after extraction follow (`drafter_status.py`), then, while anything is still to be
written, the disk the rest of the plan needs (`disk_plan.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TextIO

import psutil

from ..core.config import HIDDEN_STATES_DIR, PREPARED_DIR, PREPARED_TABLE, REGENERATED_DIR
from ..core.errors import PipelineError
from ..core.hidden_store import BF16_STORE, HiddenStore
from ..core.jsonio import read_json_object
from ..core.progress import human_duration
from ..core.run import RunSpec
from ..core.shard_job import LOCK_NAME, read_failure
from ..core.space import format_bytes
from ..extract.chunk_file import plan_bytes, plan_chunks
from ..extract.shard_files import (
    INVALID_MANIFEST_NAME,
    JOURNAL_NAME,
    MANIFEST_NAME,
    read_journal,
)
from ..plan.shard_plan import parse_shard_name
from .disk_plan import PreparedRows, planned_disk
from .drafter_status import drafter_lines

# Throughput is measured over this trailing window, so an ETA reflects the current pace.
RECENT_WINDOW_S = 3600.0
# A running shard with no finished chunk for this long is flagged in the listing.
QUIET_WARNING_S = 3600.0

DONE, RUNNING, FAILED, PARTIAL, REMAINING = "done", "running", "failed", "partial", "remaining"
# Done, but from other rows or settings than the config's: the next run makes it again.
STALE = "stale"
STATES = (DONE, STALE, RUNNING, FAILED, PARTIAL, REMAINING)


@dataclass
class ShardStatus:
    name: str
    row_start: int
    row_end: int
    state: str = REMAINING
    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    chunks_done: int = 0
    chunks_planned: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    last_activity: float | None = None
    lock_pid: int | None = None
    lock_host: str | None = None
    error: str | None = None
    # Why `eaglepipe verify` set the shard's manifest aside (it is extracted again).
    damage: str | None = None

    @property
    def planned_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass
class StatusSummary:
    shards: list[ShardStatus]
    counts: dict[str, int]
    rows: int
    tokens: int
    bytes: int
    planned_rows: int
    planned_tokens: int | None
    tokens_per_s: float | None
    bytes_per_s: float | None
    remaining_tokens: int | None
    eta_s: float | None
    remaining_bytes: int | None = None
    # Shard directories on disk that the plan does not contain.
    unplanned: list[str] = field(default_factory=list)
    generated_at: float = field(default_factory=time.time)

    @property
    def failed(self) -> list[ShardStatus]:
        return [s for s in self.shards if s.state == FAILED]


def _parse_time(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PipelineError(f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else None


def _finished(status: ShardStatus, manifest: dict) -> ShardStatus:
    timing = manifest.get("timing") or {}
    status.state = DONE
    status.rows = int(manifest.get("num_rows", 0))
    status.tokens = int(manifest.get("num_tokens", 0))
    status.bytes = int(manifest.get("num_bytes", 0))
    status.chunks_done = status.chunks_planned = len(manifest.get("chunks", []))
    status.started_at = _parse_time(timing.get("started_at"))
    status.finished_at = _parse_time(timing.get("finished_at"))
    status.last_activity = status.finished_at
    return status


def lock_is_live(lock: dict, *, hostname: str | None = None) -> bool:
    """Whether the holder recorded in a shard's writer lock still runs.

    The writer empties the lock file on release; a killed writer leaves its PID behind, so a
    PID that is gone, a zombie, or a process younger than the lock (a recycled PID) is dead.
    A lock from another host (a cluster node) cannot be checked from here and counts as live.
    The lock itself is never taken: trying it could make a starting writer fail.
    """
    hostname = hostname or socket.gethostname()
    pid = lock.get("pid")
    if not isinstance(pid, int):
        return False
    if lock.get("host") not in (None, hostname):
        return True
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        started = _parse_time(lock.get("started_at"))
        return started is None or process.create_time() <= started + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _read_lock(path: Path) -> dict | None:
    try:
        return _read_json(path)
    except PipelineError:
        # Empty (released) or torn by a kill mid-write: nobody holds it.
        return None


def inspect_shard(
    name: str,
    *,
    hidden_states_dir: Path = HIDDEN_STATES_DIR,
    hostname: str | None = None,
) -> ShardStatus:
    """One shard's state from its manifest, journal, writer lock and failure record (no chunk is
    opened)."""
    shard = parse_shard_name(name)
    status = ShardStatus(name, shard.start, shard.end)
    shard_dir = Path(hidden_states_dir) / name
    manifest_path = shard_dir / MANIFEST_NAME
    try:
        if manifest_path.exists():
            return _finished(status, read_json_object(manifest_path, what="shard manifest"))
    except (PipelineError, TypeError, ValueError, AttributeError) as exc:
        # One damaged shard among thousands must not hide the rest: it is named, with its repair.
        why = str(exc) if isinstance(exc, PipelineError) else f"{manifest_path}: {exc}"
        status.state = FAILED
        status.error = (
            f"damaged manifest: {why}; `snakemake --cores N` makes it again (from the shard's "
            "journalled chunks where they are intact)"
        )
        return status

    if shard_dir.is_dir():
        journal = list(read_journal(shard_dir).values())
        status.chunks_done = len(journal)
        status.rows = sum(len(entry.get("row_ids", [])) for entry in journal)
        status.tokens = sum(int(entry.get("num_tokens", 0)) for entry in journal)
        status.bytes = sum(int(entry.get("bytes", 0)) for entry in journal)
        if journal:
            status.last_activity = (shard_dir / JOURNAL_NAME).stat().st_mtime
    set_aside = _read_json(shard_dir / INVALID_MANIFEST_NAME)
    status.state, lock, failure = unfinished_state(
        shard_dir, kept_work=bool(status.chunks_done or set_aside), hostname=hostname
    )
    if status.state == RUNNING:
        status.lock_pid, status.lock_host = lock.get("pid"), lock.get("host")
        status.started_at = _parse_time(lock.get("started_at"))
    elif status.state == FAILED:
        status.error = failure.get("error", "(no reason recorded)")
    elif status.state == PARTIAL and set_aside is not None:
        status.damage = set_aside.get("reason", "damaged")
    return status


def unfinished_state(
    shard_dir: Path, *, kept_work: bool, hostname: str | None = None
) -> tuple[str, dict | None, dict | None]:
    """The state of a shard directory without its manifest, for every per-shard stage: RUNNING
    under a live writer lock, else FAILED with a failure record, else PARTIAL when work is kept,
    else REMAINING; with the lock and the failure record it read."""
    lock = _read_lock(shard_dir / LOCK_NAME)
    if lock is not None and lock_is_live(lock, hostname=hostname):
        return RUNNING, lock, None
    failure = read_failure(shard_dir)
    if failure is not None:
        return FAILED, lock, failure
    return (PARTIAL if kept_work else REMAINING), lock, None


def fill_plan(
    shards: list[ShardStatus],
    prepared: PreparedRows,
    *,
    hidden_size: int | None = None,
    chunk_max_bytes: int | None = None,
    store: HiddenStore = BF16_STORE,
) -> dict[str, int]:
    """Planned tokens of every shard; planned chunk counts of unfinished shards with progress.

    Chunk counts need the target's hidden size and the chunk bound; they are planned exactly
    as extraction plans them (`shard_store.plan_chunks`).
    """
    planned_tokens = {}
    for shard in shards:
        row_ids, num_tokens = prepared.of_rows(shard.row_start, shard.row_end)
        planned_tokens[shard.name] = int(num_tokens.sum())
        unfinished = shard.state in (RUNNING, PARTIAL, FAILED) and shard.chunks_done
        if unfinished and hidden_size and chunk_max_bytes:
            shard.chunks_planned = len(
                plan_chunks(
                    row_ids, num_tokens, hidden_size, max_chunk_bytes=chunk_max_bytes, store=store
                )
            )
    return planned_tokens


def recent_throughput(
    shards: list[ShardStatus], now: float, window_s: float = RECENT_WINDOW_S
) -> tuple[float | None, float | None]:
    """Tokens/s and bytes/s over the trailing window, all shards together (so concurrency counts).

    A finished shard contributes the part of its work inside the window, assuming an even pace
    over [started, finished]; a running shard the same over [started, last journal write].
    """
    window_start = now - window_s
    tokens = byts = 0.0
    earliest = None
    for shard in shards:
        if shard.state not in (DONE, STALE, RUNNING) or shard.started_at is None:
            continue
        end = shard.finished_at if shard.state != RUNNING else shard.last_activity
        if end is None or end <= window_start:
            continue
        span = max(end - shard.started_at, 1e-6)
        fraction = min(1.0, (end - max(shard.started_at, window_start)) / span)
        tokens += shard.tokens * fraction
        byts += shard.bytes * fraction
        earliest = shard.started_at if earliest is None else min(earliest, shard.started_at)
    if earliest is None or tokens <= 0:
        return None, None
    elapsed = now - max(earliest, window_start)
    if elapsed <= 0:
        return None, None
    return tokens / elapsed, byts / elapsed


def summarize(
    shards: list[ShardStatus],
    *,
    planned_tokens: dict[str, int] | None = None,
    now: float | None = None,
    window_s: float = RECENT_WINDOW_S,
) -> StatusSummary:
    now = time.time() if now is None else now
    counts = dict.fromkeys(STATES, 0)
    for shard in shards:
        counts[shard.state] += 1
    tokens = sum(s.tokens for s in shards)
    planned_total = sum(planned_tokens.values()) if planned_tokens else None
    tokens_per_s, bytes_per_s = recent_throughput(shards, now, window_s)
    if planned_tokens is not None:
        remaining = sum(
            planned_tokens.get(s.name, 0)
            if s.state == STALE
            else max(0, planned_tokens.get(s.name, 0) - s.tokens)
            for s in shards
            if s.state != DONE
        )
    else:
        # Without the prepared table: scale the done shards' tokens per row to what is left.
        done_rows = sum(s.planned_rows for s in shards if s.state == DONE)
        done_tokens = sum(s.tokens for s in shards if s.state == DONE)
        left_rows = sum(s.planned_rows for s in shards if s.state != DONE)
        left_written = sum(s.tokens for s in shards if s.state != DONE)
        remaining = (
            max(0, int(done_tokens / done_rows * left_rows) - left_written) if done_rows else None
        )
    eta = remaining / tokens_per_s if tokens_per_s and remaining is not None else None
    return StatusSummary(
        shards=shards,
        counts=counts,
        rows=sum(s.rows for s in shards),
        tokens=tokens,
        bytes=sum(s.bytes for s in shards),
        planned_rows=sum(s.planned_rows for s in shards),
        planned_tokens=planned_total,
        tokens_per_s=tokens_per_s,
        bytes_per_s=bytes_per_s,
        remaining_tokens=remaining,
        eta_s=0.0 if remaining == 0 else eta,
        generated_at=now,
    )


def shard_status(
    workdir: str | os.PathLike,
    plan: Iterable[str],
    *,
    hidden_size: int | None = None,
    chunk_max_bytes: int | None = None,
    store: HiddenStore = BF16_STORE,
    now: float | None = None,
    window_s: float = RECENT_WINDOW_S,
    stale: Iterable[str] = (),
) -> StatusSummary:
    """Status of every planned shard (names `rows_<start>-<end>`) under `workdir`.

    `hidden_size` and `chunk_max_bytes` (optional) let running shards show chunks done of
    planned and the totals show the bytes still to write; shards named in `stale` are STALE
    when done.
    """
    stale = set(stale)
    workdir = Path(workdir)
    hostname = socket.gethostname()
    plan = list(plan)
    shards = [
        inspect_shard(name, hidden_states_dir=workdir / HIDDEN_STATES_DIR, hostname=hostname)
        for name in plan
    ]
    for shard in shards:
        if shard.state == DONE and shard.name in stale:
            shard.state = STALE
    prepared = PreparedRows.read(workdir / PREPARED_TABLE)
    planned = (
        fill_plan(
            shards, prepared, hidden_size=hidden_size, chunk_max_bytes=chunk_max_bytes, store=store
        )
        if prepared is not None
        else None
    )
    summary = summarize(shards, planned_tokens=planned, now=now, window_s=window_s)
    summary.unplanned = unplanned_shard_dirs(workdir / HIDDEN_STATES_DIR, plan)
    if hidden_size and summary.remaining_tokens is not None:
        summary.remaining_bytes = plan_bytes([summary.remaining_tokens], hidden_size, store=store)
    return summary


def unplanned_shard_dirs(hidden_states_dir: Path, plan: list[str]) -> list[str]:
    """Names of shard directories under `hidden_states_dir` that `plan` does not contain."""
    planned = set(plan)
    try:
        names = [p.name for p in Path(hidden_states_dir).iterdir() if p.is_dir()]
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        try:
            shard = parse_shard_name(name)
        except PipelineError:
            continue
        if name not in planned:
            found.append((shard.start, shard.end, name))
    return [name for *_, name in sorted(found)]


def human_count(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def format_status(summary: StatusSummary, *, list_all: bool = False, max_listed: int = 20) -> str:
    """A screenful for a person: totals first, then running and failed shards by name."""
    c = summary.counts
    total = len(summary.shards)
    stale = f", {c[STALE]} stale" if c[STALE] else ""
    lines = [
        f"shards: {total} planned, {c[DONE]} done{stale}, {c[RUNNING]} running, "
        f"{c[FAILED]} failed, {c[PARTIAL]} partial, {c[REMAINING]} remaining",
        f"written: {summary.rows} rows, {human_count(summary.tokens)} tokens, "
        f"{format_bytes(summary.bytes)}"
        + (
            f" (of {human_count(summary.planned_tokens)} tokens planned)"
            if summary.planned_tokens
            else ""
        ),
    ]
    if summary.tokens_per_s:
        lines.append(
            f"recent throughput: {human_count(summary.tokens_per_s)} tokens/s, "
            f"{format_bytes(summary.bytes_per_s or 0)}/s"
        )
    else:
        lines.append("recent throughput: none in the last hour")
    if summary.eta_s is not None:
        left = f"{human_count(summary.remaining_tokens or 0)} tokens"
        if summary.remaining_bytes is not None:
            left += f" ({format_bytes(summary.remaining_bytes)})"
        lines.append(f"remaining: {left}, ETA {human_duration(summary.eta_s)}")
    else:
        lines.append("remaining: ETA unknown until a shard makes progress")

    def shown(state: str) -> list[ShardStatus]:
        selected = [s for s in summary.shards if s.state == state]
        return selected if list_all or state == FAILED else selected[:max_listed]

    for shard in shown(RUNNING):
        planned = f"/{shard.chunks_planned}" if shard.chunks_planned else ""
        where = f"pid {shard.lock_pid}" + (f" on {shard.lock_host}" if shard.lock_host else "")
        quiet = summary.generated_at - (shard.last_activity or shard.started_at or 0)
        if shard.started_at is not None and quiet > QUIET_WARNING_S:
            # A job killed on another node (SLURM time limit) leaves a lock this host cannot test.
            where += f"; no chunk finished for {human_duration(quiet)}"
        lines.append(f"  running  {shard.name}: {shard.chunks_done}{planned} chunks ({where})")
    for shard in shown(FAILED):
        lines.append(f"  FAILED   {shard.name}: {shard.error}")
    for shard in shown(STALE):
        lines.append(
            f"  stale    {shard.name}: extracted from other rows or settings than this config; "
            "the next run extracts it again (keeping the chunks whose rows are unchanged)"
        )
    for shard in shown(PARTIAL):
        damage = f", damaged ({shard.damage})" if shard.damage else ""
        lines.append(
            f"  partial  {shard.name}: {shard.chunks_done} chunks kept{damage}, "
            "resumes on the next run"
        )
    if summary.unplanned:
        names = " ".join(f"{HIDDEN_STATES_DIR}/{name}" for name in summary.unplanned)
        lines.append(
            f"not in the plan: {len(summary.unplanned)} shard dir(s) of an earlier plan, never "
            f"trained on; remove with `rm -r {names}`"
        )
    if list_all:
        for state in (DONE, REMAINING):
            lines.extend(f"  {state:<8} {s.name}" for s in summary.shards if s.state == state)
    else:
        hidden = sum(max(0, c[state] - max_listed) for state in (RUNNING, STALE, PARTIAL))
        if hidden:
            lines.append(f"  ... {hidden} more shards not listed (--all lists every shard)")
    return "\n".join(lines)


def planned_shard_names(run: RunSpec, workdir: str | os.PathLike = ".") -> list[str]:
    """The run's shard names, planned exactly as the workflow plans them."""
    from ..plan.shard_plan import plan_for_source

    workdir = Path(workdir)
    plan = plan_for_source(
        workdir / run.dataset.path,
        run.shards.rows_per_shard,
        cache_dir=workdir / ".eaglepipe" / "cache",
    )
    return [shard.name for shard in plan]


def _hidden_size(run: RunSpec) -> int | None:
    """The target's hidden size (the toy's from its settings before it is built), if known."""
    try:
        return run.model.hidden_size
    except (PipelineError, KeyError):
        return None


def regeneration_lines(
    regenerated_dir: Path,
    shard_names: list[str],
    *,
    hostname: str | None = None,
    stale: Iterable[str] = (),
    max_listed: int = 20,
) -> tuple[list[str], bool]:
    """What `eaglepipe status` says of the regeneration stage (dataset.regenerate): a count of
    its shards by state, then each stale, running or failed one; and whether one failed."""
    stale = set(stale)
    counts = dict.fromkeys(STATES, 0)
    listed = []
    for name in shard_names:
        shard_dir = regenerated_dir / name
        if (shard_dir / MANIFEST_NAME).exists():
            state = STALE if name in stale else DONE
            counts[state] += 1
            if state == STALE and counts[STALE] <= max_listed:
                listed.append(
                    f"  stale    {REGENERATED_DIR}/{name}: made under other settings or source "
                    "rows than this config; the next run regenerates it"
                )
            continue
        try:
            rows = (shard_dir / JOURNAL_NAME).read_text().count("\n")
        except (FileNotFoundError, NotADirectoryError):
            rows = 0
        state, lock, failure = unfinished_state(shard_dir, kept_work=rows > 0, hostname=hostname)
        counts[state] += 1
        if state == RUNNING:
            where = f"pid {lock.get('pid')}" + (f" on {lock['host']}" if lock.get("host") else "")
            listed.append(f"  running  {REGENERATED_DIR}/{name}: {rows} rows done ({where})")
        elif state == FAILED:
            listed.append(f"  FAILED   {REGENERATED_DIR}/{name}: {failure.get('error', '?')}")
    if counts[STALE] > max_listed:
        listed.append(f"  ... {counts[STALE] - max_listed} more stale regenerated shards")
    stale_count = f", {counts[STALE]} stale" if counts[STALE] else ""
    head = (
        f"regenerated: {len(shard_names)} planned, {counts[DONE]} done{stale_count}, "
        f"{counts[RUNNING]} running, {counts[FAILED]} failed, {counts[PARTIAL]} partial (rows "
        f"kept), {counts[REMAINING]} remaining"
    )
    return [head, *listed], counts[FAILED] > 0


def print_status(
    run: RunSpec,
    *,
    workdir: str | os.PathLike = ".",
    list_all: bool = False,
    stream: TextIO | None = None,
) -> int:
    """`eaglepipe status`: print where the run stands for `run`'s config; exit code 1 if any
    shard failed. Nothing is written: what is stale is judged as the workflow would judge it."""
    workdir = Path(workdir)
    names = planned_shard_names(run, workdir)
    found, note = judge_staleness(run, names, workdir)
    summary = shard_status(
        workdir,
        names,
        hidden_size=_hidden_size(run),
        chunk_max_bytes=run.shards.chunk_max_bytes,
        store=run.extract.store,
        stale=found.hidden_states,
    )
    text = format_status(summary, list_all=list_all)
    regeneration_failed = False
    if run.dataset.regenerate.enabled:
        lines, regeneration_failed = regeneration_lines(
            workdir / REGENERATED_DIR, names, stale=found.regenerated
        )
        text = "\n".join(lines) + "\n" + text
    # A shard extracted again is validated again, as the workflow plans it.
    stale_reports = dict.fromkeys(found.hidden_states, "its shard is extracted again")
    stale_reports.update(found.validations)
    text += "\n" + "\n".join(
        drafter_lines(workdir, names, stale_reports, found.single_job, engines=run.export.engines)
    )
    text += "".join("\n" + line for line in prepared_loss_lines(workdir))
    text += "".join("\n" + line for line in benchmark_lines(run, workdir))
    extra = [note] if note else []
    plan = disk_plan_text(run, workdir, names, found)
    if plan:
        extra.append(plan)
    if found.prepared:
        extra.append(
            f"stale: {PREPARED_DIR}/ was made from other rows or settings than this config; "
            "the next run prepares it again"
        )
    if found.validations:
        shown = ", ".join(sorted(found.validations)[:5])
        more = f" and {len(found.validations) - 5} more" if len(found.validations) > 5 else ""
        extra.append(
            f"stale: {len(found.validations)} validation report(s) ({shown}{more}): "
            f"{next(iter(found.validations.values()))}; the next run validates them again"
        )
    if extra:
        text += "\n" + "\n".join(extra)
    print(text, file=stream or sys.stdout, flush=True)
    return 1 if summary.failed or regeneration_failed else 0


def prepared_loss_lines(workdir: Path) -> list[str]:
    """What prepare dropped, per reason in rows, turns and assistant tokens, and a cut-off
    source, from `prepared/summary.json` (nothing before prepare has run)."""
    from ..prepare.table import loss_lines

    summary = _read_json(workdir / PREPARED_DIR / "summary.json")
    if not summary or "source_rows" not in summary:
        return []
    head = (
        f"prepared: kept {summary.get('rows', 0):,} of {summary['source_rows']:,} rows, "
        f"{summary.get('assistant_tokens', 0):,} assistant tokens"
    )
    return [head, *(f"  {line}" for line in loss_lines(summary))]


def benchmark_lines(run: RunSpec, workdir: Path) -> list[str]:
    """Each configured benchmark's results table (drafter/benchmarks/<name>.json), or that it
    has not run."""
    from ..prompt_bench.measure import BENCHMARK_DIR, read_result
    from ..prompt_bench.summary import status_lines

    lines = []
    for name in run.benchmarks.names:
        path = BENCHMARK_DIR / f"{name}.json"
        result = read_result(workdir / path)
        lines += status_lines(result) if result else [f"benchmark {name}: not run ({path})"]
    return lines


def disk_plan_text(run: RunSpec, workdir: Path, names: list[str], found) -> str | None:
    """The bytes the rest of the plan stores per stage (`disk_plan`) while anything is still to
    be written, or a note on why they are not known; None before the tokenized table exists."""
    try:
        plan = planned_disk(run, workdir, shard_names=names, found=found)
    except PipelineError as exc:
        return f"note: the disk plan was not judged ({exc})"
    if plan is None or not any(stage.to_write for stage in plan.stages):
        return None
    return plan.text()


def judge_staleness(run: RunSpec, names: list[str], workdir: Path):
    """(`Staleness` of the run in `workdir` for `run`'s config, a note when it cannot be judged:
    the model directory is gone, say; then nothing counts as stale)."""
    from ..drafter.live import live_export_engine
    from ..plan.freshness import Staleness, staleness

    try:
        with contextlib.chdir(workdir):
            return staleness(run, names, live_export_engine=live_export_engine(run)), None
    except PipelineError as exc:
        return Staleness(), f"note: what is stale was not judged ({exc})"

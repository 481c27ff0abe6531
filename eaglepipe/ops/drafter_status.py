"""What `eaglepipe status` says of the stages after extraction: the validation reports, the
training (its step, loss and ETA while it runs), the offline evaluation and the live acceptance.

Each line is read from the files its stage leaves; nothing is computed again and no file is
written. Whether the next run makes a stage again is the workflow's own judgement
(`plan.freshness.single_job_staleness`, what `snakemake -n` plans): a stale stage's line says
so and why, then what is on disk. A file that cannot be read is named in its line, not raised,
so one damaged file never hides the rest of the status.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

from ..core.config import (
    DRAFT_VOCAB,
    DRAFTER_MODEL,
    EVAL_REPORT,
    EXPORT_DIR,
    EXPORT_FILES,
    LIVE_REPORT,
    TRAIN_CHECKPOINTS,
    TRAIN_LOG,
    VALIDATED_DIR,
)
from ..core.progress import human_duration
from ..core.sealed import read_metadata

MODEL = DRAFTER_MODEL
# The copy a resumed training keeps beside its checkpoints (drafter/train.py, HISTORY_NAME).
TRAIN_HISTORY = TRAIN_CHECKPOINTS / "train_log.jsonl"
EVAL = EVAL_REPORT
LIVE = LIVE_REPORT
# The ETA uses the pace of the last this many steps.
RECENT_STEPS = 20


def validation_line(workdir: Path, shard_names: list[str], stale: Iterable[str]) -> str:
    stale = set(stale)
    present = {n for n in shard_names if (workdir / VALIDATED_DIR / f"{n}.json").exists()}
    stale_count = len(present & stale)
    stale_text = f", {stale_count} stale" if stale_count else ""
    return (
        f"validated: {len(shard_names)} planned, {len(present - stale)} done{stale_text}, "
        f"{len(shard_names) - len(present)} remaining"
    )


def _last_steps(path: Path, count: int) -> list[dict]:
    """The last `count` whole step records of a training log (a torn last line is skipped)."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - 4096 * (count + 1)))
        tail = f.read().decode(errors="replace").splitlines()
    records = []
    for line in tail:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records[-count:]


def training_line(workdir: Path, *, now: float | None = None) -> str:
    model = workdir / MODEL
    if model.exists():
        try:
            meta = read_metadata(model)
            loss = float(meta["final_loss"])
            return f"training: done, {meta['total_steps']} steps, final loss {loss:.4f} ({MODEL})"
        except (OSError, KeyError, ValueError, UnicodeDecodeError) as exc:  # damaged: say which
            return f"training: {MODEL} is unreadable ({exc}); `eaglepipe verify` checks it"
    log = next((workdir / p for p in (TRAIN_LOG, TRAIN_HISTORY) if (workdir / p).exists()), None)
    recent = _last_steps(log, RECENT_STEPS) if log is not None else []
    if not recent:
        return "training: not started"
    last = recent[-1]
    now = time.time() if now is None else now
    age = human_duration(max(0.0, now - log.stat().st_mtime))
    total = last.get("total_steps")
    line = f"training: step {last['step']}" + (f" of {total}" if total else "")
    if isinstance(last.get("loss"), int | float):
        line += f", loss {last['loss']:.4f}"
    line += f", last step logged {age} ago"
    paces = [
        float(r.get("seconds", 0.0)) + float(r.get("data_wait_s", 0.0))
        for r in recent
        if isinstance(r.get("seconds"), int | float)
    ]
    if total and paces:
        eta = (int(total) - int(last["step"])) * sum(paces) / len(paces)
        line += f", ETA {human_duration(eta)} at the last {len(paces)} steps' pace"
    return line + " (no drafter yet)"


def vocab_line(workdir: Path) -> str:
    if (workdir / DRAFT_VOCAB).exists():
        return f"vocab: done ({DRAFT_VOCAB})"
    return "vocab: not built yet"


def export_line(workdir: Path, engines: Iterable[str]) -> str:
    engines = list(engines)
    made = [
        engine
        for engine in engines
        if all((workdir / EXPORT_DIR / engine / name).exists() for name in EXPORT_FILES)
    ]
    if not engines:
        return "export: none (export.engines is empty)"
    if not made:
        return "export: not made yet"
    missing = [engine for engine in engines if engine not in made]
    return f"export: {', '.join(made)} done ({EXPORT_DIR})" + (
        f", {', '.join(missing)} not made yet" if missing else ""
    )


def _report_line(workdir: Path, relative: Path, stage: str, describe) -> str | None:
    """`stage: <describe(record)>` for a JSON report, None when it is not there yet, and a line
    naming it and the rerun when it cannot be read."""
    path = workdir / relative
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("it holds no JSON object")
        return f"{stage}: {describe(data)}"
    except (KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        why = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        return f"{stage}: {relative} is unreadable ({why}); rerun: snakemake --cores N {relative}"


def _evaluation(result: dict) -> str:
    return (
        f"acceptance length {float(result['acceptance_length']):.2f} offline (decode order, "
        f"{result['rows']} held-out rows, {result['positions']} positions; {EVAL})"
    )


def _live(result: dict) -> str:
    if result.get("skipped"):
        return f"skipped ({result['skipped']})"
    line = (
        f"acceptance length {float(result['acceptance_length']):.2f} on {result['prompts']} "
        f"prompts, {result['export_engine']} export through {result['harness']}"
    )
    same_turns = result.get("offline_same_turns")
    if isinstance(same_turns, int | float):
        line += f" (offline on the same turns {same_turns:.2f})"
    return line


def _stale(line: str, why: str) -> str:
    """A stage's line when the next run makes it again: that first, then what is on disk."""
    label, _, on_disk = line.partition(": ")
    return f"{label}: stale ({why}): the next run makes it again; on disk: {on_disk}"


def drafter_lines(
    workdir: Path,
    shard_names: list[str],
    stale_validations: Iterable[str],
    stale_stages: dict[str, str] | None = None,
    *,
    engines: Iterable[str] = (),
    now=None,
) -> list[str]:
    """The status lines of the stages after extraction, in pipeline order; `stale_stages` is
    `{stage: why}` of the single-job stages the next run makes again."""
    stale_stages = stale_stages or {}
    lines = [
        ("validate", validation_line(workdir, shard_names, stale_validations)),
        ("vocab", vocab_line(workdir)),
        ("train", training_line(workdir, now=now)),
        ("evaluate", _report_line(workdir, EVAL, "evaluation", _evaluation)),
        ("export", export_line(workdir, engines)),
        ("live_acceptance", _report_line(workdir, LIVE, "live", _live)),
    ]
    return [
        _stale(line, stale_stages[stage]) if stage in stale_stages else line
        for stage, line in lines
        if line is not None
    ]

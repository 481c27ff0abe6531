"""`eaglepipe verify` beyond the hidden states: every other stored stage's files against what
records them, and the repair of each.

- regenerate: `regenerated/<shard>/rows.jsonl` against its `manifest.json` (size, xxh3-128).
  Restored from the shard's journal when the journalled rows give exactly the listed bytes;
  else the manifest is set aside and the next run regenerates the shard (journalled rows kept).
- prepare: `prepared/tokenized.parquet` and `skipped.json` against `prepared/summary.json`
  (`files`: size, xxh3-128). Set aside; the next run prepares the table again.
- vocab, train: `drafter/vocab.safetensors`, `drafter/model.safetensors` against the checksum
  each records in its header (`core/sealed.py`). Set aside; the next run builds it again.
- export: each engine's `model.safetensors` against its header's checksums (its own, and its
  `config.json`'s). Set aside; the next run exports again.
- evaluate, live: `drafter/eval.json` and `drafter/live.json`, written whole (atomically): each
  must parse as a JSON object with its headline `acceptance_length`. Set aside; the next run
  evaluates (or checks live) again, and the acceptance report follows.

A file is set aside by renaming it to `<name>.invalid<suffix>` beside itself (kept for a look):
missing, it is a target the next `snakemake --cores N` builds again, with what depends on it.
Files written before they were sealed or recorded have nothing to be checked against: they are
named as unchecked, never as damaged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.config import (
    DRAFT_VOCAB,
    DRAFTER_MODEL,
    EVAL_REPORT,
    EXPORT_DIR,
    LIVE_REPORT,
    PREPARED_DIR,
    PREPARED_SUMMARY,
)
from ..core.errors import PipelineError
from ..core.manifest import read_manifest
from ..core.run import RunSpec
from ..core.sealed import config_seal_problem, is_sealed, seal_problem
from ..plan.provenance import regenerated_manifest_path
from ..prepare.table import SUMMARY_FILES_KEY, listed_file_problem
from ..regenerate.store import (
    REGENERATED_MANIFEST,
    ROWS_NAME,
    restore_rows_from_journal,
    rows_problem,
    set_aside_manifest,
)

# What the next `snakemake --cores N` does once a stage's damaged file is set aside.
REBUILDS = {
    "regenerate": "regenerates the shard, keeping its journalled rows (then prepare and that "
    "shard's extraction, which keeps every chunk whose rows came out the same)",
    "prepare": "prepares the table again (the hidden states and their validation stay as they "
    "are: their rows did not change), then trains again on it",
    "vocab": "builds the draft vocabulary again, then trains, evaluates and exports again",
    "train": "trains the drafter again (from its newest checkpoint, when one is left), then "
    "evaluates and exports again",
    "export": "exports the drafter again and checks it live",
    "evaluate": "evaluates the drafter again (then its live check and the acceptance report)",
    "live": "checks the exported drafter live again (then the acceptance report)",
}

# The drafter's reports, by the stage that writes each.
REPORT_FILES = (("evaluate", EVAL_REPORT), ("live", LIVE_REPORT))


@dataclass
class Damage:
    """One damaged file of a stage, and how verify repairs it."""

    stage: str
    path: Path
    problem: str
    # Repairs what verify can; returns what it did, and whether that restored the file in
    # place (nothing left to run) or set something aside for the next run.
    fix: Callable[[], tuple[str, bool]]

    def repair(self) -> str:
        """Repair what verify can; one line saying what was done and what is left to run."""
        done, restored = self.fix()
        if restored:
            return f"{self.path}: {done}"
        return f"{self.path}: {done}; `snakemake --cores N` {REBUILDS[self.stage]}"


@dataclass
class StoredReport:
    damaged: list[Damage]
    # Files with no checksum recorded (written by an older version): not checkable.
    unchecked: list[Path]


def set_aside(path: Path) -> Path:
    """Rename a damaged file to `<stem>.invalid<suffix>` beside it; returns the new path."""
    target = path.with_name(f"{path.stem}.invalid{path.suffix}")
    path.replace(target)
    return target


def _setting_aside(path: Path) -> Callable[[], tuple[str, bool]]:
    def fix() -> tuple[str, bool]:
        return f"set aside as {set_aside(path)}", False

    return fix


def check_regenerated(shard_names: list[str]) -> StoredReport:
    """Each finished regenerated shard's rows file against its manifest."""
    report = StoredReport([], [])
    for shard in shard_names:
        manifest_path = Path(regenerated_manifest_path(shard))
        if not manifest_path.exists():
            continue  # not done: the workflow's business, not damage
        try:
            problem = rows_problem(
                manifest_path, read_manifest(manifest_path, REGENERATED_MANIFEST)[0]
            )
        except (PipelineError, OSError) as exc:  # an unreadable or incomplete manifest
            problem = f"{manifest_path} cannot be read ({exc})"
            report.damaged.append(
                Damage("regenerate", manifest_path, problem, _setting_aside(manifest_path))
            )
            continue
        if problem:

            def fix(manifest_path=manifest_path, problem=problem) -> tuple[str, bool]:
                if restore_rows_from_journal(manifest_path):
                    return "restored from its journal (the bytes its manifest lists)", True
                aside = set_aside_manifest(manifest_path, problem)
                return f"the journal cannot restore it: manifest set aside as {aside}", False

            rows = manifest_path.parent / ROWS_NAME
            report.damaged.append(Damage("regenerate", rows, problem, fix))
    return report


def check_prepared() -> StoredReport:
    """The prepared table and skipped rows against the sizes and checksums the summary lists."""
    report = StoredReport([], [])
    if not PREPARED_SUMMARY.exists():
        return report
    try:
        summary = json.loads(PREPARED_SUMMARY.read_text())
        recorded = summary.get(SUMMARY_FILES_KEY) if isinstance(summary, dict) else None
    except (OSError, ValueError) as exc:
        problem = f"{PREPARED_SUMMARY} cannot be read ({exc})"
        report.damaged.append(
            Damage("prepare", PREPARED_SUMMARY, problem, _setting_aside(PREPARED_SUMMARY))
        )
        return report
    if not recorded:
        report.unchecked.append(PREPARED_DIR)
        return report
    for name, listed in sorted(recorded.items()):
        path = PREPARED_DIR / name
        if not path.exists():
            continue  # missing: a target the next run builds (nothing to set aside)
        if problem := listed_file_problem(path, listed, PREPARED_SUMMARY):
            report.damaged.append(Damage("prepare", path, problem, _setting_aside(path)))
    return report


def drafter_files(run: RunSpec) -> list[tuple[str, Path]]:
    """(stage, path) of every sealed drafter file the run's plan makes."""
    files = [("vocab", DRAFT_VOCAB), ("train", DRAFTER_MODEL)]
    files += [
        ("export", EXPORT_DIR / engine / "model.safetensors") for engine in run.export.engines
    ]
    return files


def check_drafter(run: RunSpec) -> StoredReport:
    """The drafter's vocabulary, model and exports against the checksums they record."""
    report = StoredReport([], [])
    for stage, path in drafter_files(run):
        if not path.exists():
            continue
        problem = seal_problem(path)
        if problem is None and not is_sealed(path):
            report.unchecked.append(path)
            continue
        if problem:
            report.damaged.append(Damage(stage, path, problem, _setting_aside(path)))
        elif stage == "export":
            config = path.parent / "config.json"
            # A missing config is a target the next run builds: nothing to set aside.
            if problem := config_seal_problem(path, config):
                report.damaged.append(Damage(stage, config, problem, _setting_aside(config)))
    return report


def check_reports() -> StoredReport:
    """The drafter's evaluation and live reports: whole JSON objects with their headline."""
    report = StoredReport([], [])
    for stage, path in REPORT_FILES:
        if not path.exists():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            problem = f"{path} cannot be read as JSON ({exc})"
        else:
            if isinstance(data, dict) and "acceptance_length" in data:
                continue
            problem = f"{path} is JSON but has no acceptance_length (not a {stage} report)"
        report.damaged.append(Damage(stage, path, problem, _setting_aside(path)))
    return report


def check_stored_stages(run: RunSpec, shard_names: list[str]) -> StoredReport:
    """Every stage's files but the hidden states' (`verify.verify_shards` has those), in the
    working directory."""
    report = StoredReport([], [])
    parts = [check_prepared(), check_drafter(run), check_reports()]
    if run.dataset.regenerate.enabled:
        parts.insert(0, check_regenerated(shard_names))
    for part in parts:
        report.damaged += part.damaged
        report.unchecked += part.unchecked
    return report

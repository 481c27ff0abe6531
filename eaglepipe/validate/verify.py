"""`eaglepipe verify`: integrity and schema of every shard (e.g. after copying the data), shards
outside the plan named, damaged shards set aside for the next run to re-extract."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..core import config as cfg
from ..core.errors import PipelineError
from ..core.manifest import read_manifest
from ..extract.shard_files import HIDDEN_STATES_MANIFEST, MANIFEST_NAME, invalidate_shard
from ..plan.shard_plan import parse_shard_name
from .checks import ValidationFailure
from .integrity import (
    check_chunk_checksum,
    check_chunk_file,
    check_no_stray_chunks,
)
from .schema import check_chunk_schema, check_manifest_schema, open_chunk


def _shard_dirs(hidden_states_dir: Path) -> list[Path]:
    dirs = []
    for path in Path(hidden_states_dir).glob("rows_*"):
        if path.is_dir():
            try:
                dirs.append((parse_shard_name(path.name), path))
            except PipelineError:
                continue
    return [path for _, path in sorted(dirs)]


@dataclass
class VerifyReport:
    """What `verify_shards` found: problems by shard, and shards outside the plan."""

    checked: int = 0
    bytes: int = 0
    # Shards with a manifest whose data fails integrity or schema: {shard: [problems]}.
    damaged: dict[str, list[str]] = field(default_factory=dict)
    # Planned shards that have no manifest yet (or an unreadable one): {shard: problem}.
    unfinished: dict[str, str] = field(default_factory=dict)
    # Shard directories the current plan does not contain (an earlier plan's).
    unplanned: list[str] = field(default_factory=list)
    # Damaged shards whose damage is the manifest itself (unreadable or malformed): their
    # chunks were not checked, the next run rebuilds the shard from its journal.
    bad_manifests: set[str] = field(default_factory=set)

    @property
    def problems(self) -> list[str]:
        found = [p for problems in self.damaged.values() for p in problems]
        return found + list(self.unfinished.values())


def verify_shards(
    hidden_states_dir: str | os.PathLike = cfg.HIDDEN_STATES_DIR,
    planned: list[str] | None = None,
    progress: bool = True,
) -> VerifyReport:
    """Integrity and schema of every shard under `hidden_states_dir`.

    Keeps going past a bad chunk or shard, so one run lists every problem. With `planned`,
    shard directories outside the plan are listed apart (training never reads them) and not
    checked, and planned shards without a directory count as unfinished.
    """
    report = VerifyReport()
    # Each shard: its manifest, or None when it has no readable one (then `unfinished` says why).
    shards: list[tuple[Path, dict | None]] = []
    found = _shard_dirs(Path(hidden_states_dir))
    if planned is not None:
        plan = set(planned)
        report.unplanned = [d.name for d in found if d.name not in plan]
        found = [d for d in found if d.name in plan]
        present = {d.name for d in found}
        for shard in planned:
            if shard not in present:
                report.unfinished[shard] = f"shard {shard}: not extracted yet"
    for shard_dir in found:
        if not (shard_dir / MANIFEST_NAME).exists():
            problem = f"shard {shard_dir.name}: no manifest.json (extraction not finished)"
            report.unfinished[shard_dir.name] = problem
            shards.append((shard_dir, None))
            continue
        try:
            try:
                manifest, _ = read_manifest(shard_dir, HIDDEN_STATES_MANIFEST, shard=shard_dir.name)
            except PipelineError as exc:
                raise ValidationFailure(shard_dir.name, "schema", str(exc)) from None
            check_manifest_schema(shard_dir.name, manifest)
        except ValidationFailure as exc:
            report.damaged[shard_dir.name] = [str(exc)]
            report.bad_manifests.add(shard_dir.name)
            continue
        shards.append((shard_dir, manifest))
    report.bytes = sum(manifest["num_bytes"] for _, manifest in shards if manifest)
    report.checked = len(shards)
    began = time.monotonic()
    with tqdm(
        total=report.bytes,
        unit="B",
        unit_scale=True,
        desc="verify",
        disable=not progress,
        file=sys.stderr,
        mininterval=1.0,
    ) as bar:
        for shard_dir, manifest in shards:
            if manifest is None:
                continue
            shard = shard_dir.name
            problems: list[str] = []
            try:
                check_no_stray_chunks(shard_dir, shard, manifest)
            except ValidationFailure as exc:
                problems.append(str(exc))
            for entry in manifest["chunks"]:
                try:
                    check_chunk_file(shard_dir, shard, entry)
                    check_chunk_checksum(shard_dir, shard, entry)
                    with open_chunk(shard_dir, shard, entry) as reader:
                        check_chunk_schema(reader, shard, entry, manifest)
                except ValidationFailure as exc:
                    problems.append(str(exc))
                bar.update(entry["bytes"])
            if problems:
                report.damaged[shard] = problems
    if progress:
        seconds = time.monotonic() - began
        print(
            f"verified {report.checked} shard(s), {report.bytes / 1e9:.3f} GB in {seconds:.1f} s "
            f"({report.bytes / 1e9 / max(seconds, 1e-9):.2f} GB/s): "
            f"{len(report.problems)} problem(s)",
            file=sys.stderr,
            flush=True,
        )
    return report


def verify_all(
    hidden_states_dir: str | os.PathLike = cfg.HIDDEN_STATES_DIR, progress: bool = True
) -> list[str]:
    """The problems `verify_shards` finds under `hidden_states_dir` (no plan: every shard)."""
    return verify_shards(hidden_states_dir, progress=progress).problems


def invalidate_damaged(
    report: VerifyReport, hidden_states_dir: str | os.PathLike = cfg.HIDDEN_STATES_DIR
) -> list[str]:
    """Set aside the manifest of every damaged shard that still has one (see
    `shard_store.invalidate_shard`); returns the shards invalidated."""
    invalidated = []
    for shard, problems in report.damaged.items():
        shard_dir = Path(hidden_states_dir) / shard
        if (shard_dir / MANIFEST_NAME).exists():
            invalidate_shard(shard_dir, problems[0])
            invalidated.append(shard)
    return invalidated

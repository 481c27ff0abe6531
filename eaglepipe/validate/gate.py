"""The gate: `validate_shard` runs every check over one shard and writes its report
(`validated/<shard>.json`) atomically, only when all of them pass."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from ..core import config as cfg
from ..core.atomic import atomic_write_json
from ..core.errors import PipelineError
from ..core.manifest import read_manifest
from ..core.run import RunSpec
from ..extract.shard_files import HIDDEN_STATES_MANIFEST
from ..plan.provenance import require_planned, validation_settings
from ..plan.shard_plan import parse_shard_name
from .checks import CHECKS, ValidationFailure
from .coverage import check_chunk_tokens, check_coverage_rows, load_prepared_rows
from .integrity import check_chunk_checksum, check_chunk_file, check_no_stray_chunks
from .provenance import check_provenance, expected_provenance
from .schema import check_chunk_schema, check_manifest_schema, open_chunk
from .spot_check import check_spot
from .values import (
    ValueStats,
    check_chunk_values,
    check_norm_drift,
    find_norm_reference,
    norm_comparable_on,
)


@dataclass
class ShardPaths:
    hidden_states_dir: Path = cfg.HIDDEN_STATES_DIR
    validated_dir: Path = cfg.VALIDATED_DIR
    prepared_table: Path = cfg.PREPARED_TABLE
    prepared_skipped: Path = cfg.PREPARED_SKIPPED
    prepared_summary: Path = cfg.PREPARED_SUMMARY


def _printer(progress: bool) -> Callable[[str], None]:
    def log(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    return log


def validate_shard(
    run: RunSpec, shard: str, paths: ShardPaths | None = None, progress: bool = True
) -> dict:
    """Run every check on `shard`; write its report atomically only if all pass, and return it."""
    paths = paths or ShardPaths()
    parse_shard_name(shard)
    shard_dir = Path(paths.hidden_states_dir) / shard
    report_path = Path(paths.validated_dir) / f"{shard}.json"
    # A stale pass must not outlive a validation that is now running (and may fail).
    report_path.unlink(missing_ok=True)
    log = _printer(progress)
    began = time.monotonic()

    # The report records the hash of the very bytes checked: no window in which the manifest
    # could be replaced between hashing and reading.
    try:
        manifest, manifest_hash = read_manifest(shard_dir, HIDDEN_STATES_MANIFEST, shard=shard)
    except PipelineError as exc:
        require_planned(run, shard)  # a name outside the plan is said so, not "no manifest"
        raise ValidationFailure(shard, "schema", str(exc)) from None
    checks: dict[str, dict] = {}
    checks["provenance"] = check_provenance(
        shard, manifest, expected_provenance(run, paths.prepared_summary)
    )
    check_manifest_schema(shard, manifest)
    prepared = load_prepared_rows(
        paths.prepared_table, paths.prepared_skipped, manifest["row_start"], manifest["row_end"]
    )
    checks["coverage"] = check_coverage_rows(shard, manifest, prepared)
    for entry in manifest["chunks"]:
        check_chunk_file(shard_dir, shard, entry)
    check_no_stray_chunks(shard_dir, shard, manifest)

    stats = ValueStats(manifest["hidden_size"], manifest["num_aux_layers"])
    hashed_seconds = 0.0
    total = manifest["num_bytes"]
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"validate {shard}",
        disable=not progress,
        file=sys.stderr,
        mininterval=1.0,
    ) as bar:
        for entry in manifest["chunks"]:
            t0 = time.monotonic()
            check_chunk_checksum(shard_dir, shard, entry)
            hashed_seconds += time.monotonic() - t0
            with open_chunk(shard_dir, shard, entry) as reader:
                layout = check_chunk_schema(reader, shard, entry, manifest)
                check_chunk_tokens(reader, shard, layout, prepared)
                check_chunk_values(reader, shard, layout, stats, manifest["aux_layer_ids"])
            bar.update(entry["bytes"])
    checks["integrity"] = {
        "ok": True,
        "chunks": len(manifest["chunks"]),
        "bytes": total,
        "hash_gb_per_s": total / 1e9 / max(hashed_seconds, 1e-9),
    }
    checks["schema"] = {
        "ok": True,
        "hidden_size": manifest["hidden_size"],
        "num_aux_layers": manifest["num_aux_layers"],
        "num_tokens": manifest["num_tokens"],
    }
    provenance = manifest["provenance"]
    comparable_on = norm_comparable_on(manifest)
    reference = find_norm_reference(paths.validated_dir, shard, comparable_on)
    checks["values"] = check_norm_drift(
        shard, stats, reference, run.validate.norm_drift_factor, manifest["aux_layer_ids"]
    )
    checks["spot_check"] = check_spot(run, shard, shard_dir, manifest, log)

    seconds = time.monotonic() - began
    report = {
        "shard": shard,
        "manifest_xxh3_128": manifest_hash,
        # What makes this report stale besides its manifest (eaglepipe.plan).
        "validation_settings": validation_settings(run),
        "provenance": provenance,
        "checks": {name: checks[name] for name in CHECKS},
        "layer_norms": stats.layer_means(),
        "norm_comparable_on": comparable_on,
        "layer_norm_reference": reference["shard"] if reference and stats.tokens else shard,
        "num_rows": manifest["num_rows"],
        "num_tokens": manifest["num_tokens"],
        "num_bytes": total,
        "seconds": seconds,
        "gb_per_s": total / 1e9 / max(seconds, 1e-9),
        "validated_at": datetime.now(UTC).isoformat(timespec="microseconds"),
    }
    atomic_write_json(report_path, report)
    log(
        f"validated {shard}: {manifest['num_rows']} rows, {manifest['num_tokens']} tokens, "
        f"{total / 1e9:.3f} GB in {seconds:.1f} s ({report['gb_per_s']:.2f} GB/s); "
        f"all checks passed -> {report_path}"
    )
    return report

"""The regeneration stage's gate: `regenerated/summary.json`, written once every planned shard
is regenerated, fresh (made under the current settings) and intact (its rows file matches its
manifest), with the stage's totals.

It is prepare's one input from regeneration. With each of 5,000 manifests an input of prepare,
Snakemake scanned that list once for every lookup of the prepared table (three per shard): a
third of a 5,000-shard dry run (BENCHMARKS.md, "5,000-shard dry run").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from ..core.atomic import atomic_write_json
from ..core.config import REGENERATION_SUMMARY
from ..core.errors import PipelineError
from ..core.manifest import read_manifest
from ..core.run import RunSpec
from .store import REGENERATED_MANIFEST, check_rows

# What the summary copies from each shard's manifest, and sums over the shards.
COUNTED = ("num_rows", "bad_rows", "output_tokens", "length_limited_replies")


def fresh_regenerated_manifests(run: RunSpec) -> Iterator[tuple[str, str]]:
    """(shard, manifest path) of every planned shard, in plan order; a shard that is missing or
    was made under other settings ends it in one error naming its manifest."""
    from ..plan.freshness import regeneration_freshness
    from ..plan.provenance import regenerated_manifest_path, shards

    is_fresh = regeneration_freshness(run)
    for shard in shards(run):
        path = regenerated_manifest_path(shard)
        if not is_fresh(shard):
            raise PipelineError(
                f"{path} is missing or was made under other settings (dataset.regenerate, the "
                "model or the shard's source rows changed): run snakemake, which regenerates "
                "that shard first"
            )
        yield shard, path


def summarize_regeneration(run: RunSpec) -> dict:
    """Every planned regenerated shard's counts and rows checksum, and their totals; a shard
    that is missing, stale or damaged ends it in one error naming the shard's files."""
    per_shard = {}
    for shard, path in fresh_regenerated_manifests(run):
        manifest, _ = read_manifest(path, REGENERATED_MANIFEST)
        check_rows(path, manifest)
        per_shard[shard] = {
            **{key: int(manifest.get(key, 0)) for key in COUNTED},
            "xxh3_128": manifest["xxh3_128"],
        }
    totals = {key: sum(entry[key] for entry in per_shard.values()) for key in COUNTED}
    return {"format_version": 1, "shards": len(per_shard), **totals, "per_shard": per_shard}


def write_regeneration_summary(
    run: RunSpec, path: str | os.PathLike = REGENERATION_SUMMARY
) -> dict:
    """Check every regenerated shard and write the summary atomically (nothing on an error)."""
    summary = summarize_regeneration(run)
    atomic_write_json(Path(path), summary)
    return summary

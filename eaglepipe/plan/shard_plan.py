"""The shard plan: half-open row-id ranges over the *source* dataset, named `rows_{start}-{end}`.

Snakemake needs the shard list when it builds the DAG, so the plan is computed at parse time
from the source's row count (Parquet metadata, or a count of the non-blank lines of a JSONL
file), not from a checkpoint. Ranges are over source rows, so a row skipped by `prepare`
leaves a gap in its shard and never shifts the shards after it.

Counting a large JSONL file and hashing every shard's rows costs a full read, and the
Snakefile is parsed by every job; both results are cached in a small JSON file per source,
keyed by the source's absolute path and `fingerprint.file_identity` (inode, size, mtime and
ctime: an edit cannot keep all of them), so only the first parse pays.

`shard_source_digests` gives each shard an xxh3-128 digest of its raw source rows: editing
one row changes only its shard's digest, which lets the workflow rerun exactly that shard.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from ..core.atomic import atomic_write_json
from ..core.errors import PipelineError
from ..core.fingerprint import file_identity
from ..core.run import HoldoutSettings
from ..data.dataset import (
    BadRow,
    bad_rows_of,
    iter_jsonl_lines,
    iter_parquet_records,
    source_kind,
)

DEFAULT_CACHE_DIR = ".eaglepipe/cache"
# 2: keyed on file_identity (inode, ctime), not size + mtime; 3: a row without an assistant
# message, or with a null format key beside a usable one, is read anew; every bad row's id kept
_CACHE_VERSION = 3
_NAME_RE = re.compile(r"^rows_(\d+)-(\d+)$")


@dataclass(frozen=True, order=True)
class Shard:
    """Source rows `start <= row_id < end`."""

    start: int
    end: int

    @property
    def name(self) -> str:
        return f"rows_{self.start}-{self.end}"

    @property
    def num_rows(self) -> int:
        return self.end - self.start

    def contains(self, row_id: int) -> bool:
        return self.start <= row_id < self.end


def plan_shards(num_rows: int, rows_per_shard: int) -> list[Shard]:
    """Consecutive ranges of `rows_per_shard` rows; the last one short; none for 0 rows."""
    if not isinstance(rows_per_shard, int) or rows_per_shard < 1:
        raise PipelineError(
            f"shards.rows_per_shard must be a positive integer, not {rows_per_shard!r}"
        )
    if num_rows < 0:
        raise PipelineError(f"a dataset cannot have {num_rows} rows")
    return [
        Shard(start, min(start + rows_per_shard, num_rows))
        for start in range(0, num_rows, rows_per_shard)
    ]


def parse_shard_name(name: str) -> Shard:
    match = _NAME_RE.match(name)
    if not match:
        raise PipelineError(f"shard name {name!r} is not of the form rows_<start>-<end>")
    start, end = int(match.group(1)), int(match.group(2))
    if end <= start:
        raise PipelineError(f"shard name {name!r}: end must be greater than start")
    return Shard(start, end)


def planned_near(shard: str, planned: list[Shard]) -> str:
    """The planned shards a mistyped name most likely meant (those holding its rows)."""
    if not planned:
        return "the dataset has no rows"
    span = (
        f"1 shard, {planned[0].name}"
        if len(planned) == 1
        else f"{len(planned)} shards, {planned[0].name} to {planned[-1].name}"
    )
    try:
        wanted = parse_shard_name(shard)
    except PipelineError:
        return f"the plan has {span}"
    near = [s.name for s in planned if s.start < wanted.end and wanted.start < s.end]
    if not near:
        return f"its rows are past the dataset's {planned[-1].end} rows ({span})"
    shown = ", ".join(near[:3]) + (f" ... {near[-1]}" if len(near) > 3 else "")
    return f"its rows are in {shown} (the plan has {span})"


def holdout_shard_indices(holdout: HoldoutSettings, num_rows: int, rows_per_shard: int) -> set[int]:
    """Indices (in the plan) of the shards `dataset.holdout` holds out whole (none in fraction
    mode). A name not in the plan is refused: at the start of a run (rules/common.smk), not after
    hours of regeneration, when prepare reads it."""
    if holdout.mode != "shards":
        return set()
    plan = plan_shards(num_rows, rows_per_shard)
    names = {shard.name: index for index, shard in enumerate(plan)}
    chosen = set()
    for name in holdout.shards:
        parse_shard_name(name)
        if name not in names:
            raise PipelineError(
                f"config key dataset.holdout.shards: {name} is not a shard of the plan "
                f"({len(plan)} shards of {rows_per_shard} rows over {num_rows} source rows)"
            )
        chosen.add(names[name])
    if not chosen:
        raise PipelineError("config key dataset.holdout.shards: mode 'shards' needs at least one")
    return chosen


def is_eval_row(row_id: int, fraction: float, seed: int) -> bool:
    """Seeded, per-row and order-free: a row's split never depends on the other rows."""
    draw = xxhash.xxh3_64_intdigest(f"{seed}:{row_id}".encode()) / 2**64
    return draw < fraction


def check_holdout(
    holdout: HoldoutSettings,
    num_rows: int,
    rows_per_shard: int,
    skipped: frozenset[int] = frozenset(),
) -> None:
    """A held-out split that leaves evaluation or training without a source row, refused when
    the workflow starts: prepare or evaluate found it only after every shard's regeneration,
    extraction and the training. `skipped`: the rows `dataset.bad_rows: skip` drops, which
    count on neither side."""
    if holdout.mode == "shards":
        chosen = holdout_shard_indices(holdout, num_rows, rows_per_shard)
        if len(chosen) == len(plan_shards(num_rows, rows_per_shard)):
            raise PipelineError(
                "config key dataset.holdout.shards: every shard of the plan is held out: no row "
                "is left to train on"
            )
        usable = [r for r in range(num_rows) if r not in skipped]
        held = [r for r in usable if shard_of_row(r, rows_per_shard) in chosen]
        for side, left in (("evaluation", held), ("training", len(usable) - len(held))):
            if not left:
                raise PipelineError(
                    f"config key dataset.holdout.shards: every row {_side_rows(side)} is a bad "
                    f"row that dataset.bad_rows: skip drops ({len(skipped)} of {num_rows}): "
                    f"nothing is left for {side}; hold out other shards, or mend the rows"
                )
        return
    if holdout.shards:
        raise PipelineError(
            "config key dataset.holdout.shards: lists shards, but dataset.holdout.mode is "
            "fraction, which ignores them: set mode: shards, or remove the list"
        )
    fraction, seed = holdout.fraction, holdout.seed
    rows = [r for r in range(num_rows) if r not in skipped]
    what = (
        f"{len(rows)} usable source rows ({len(skipped)} bad rows skipped)"
        if skipped
        else (f"{num_rows} source rows")
    )
    if fraction == 0 or not any(is_eval_row(r, fraction, seed) for r in rows):
        raise PipelineError(
            f"config key dataset.holdout.fraction: {fraction} holds out none of the {what} "
            f"(seed {seed}): evaluation needs at least one; raise it"
        )
    if fraction >= 1 or all(is_eval_row(r, fraction, seed) for r in rows):
        raise PipelineError(
            f"config key dataset.holdout.fraction: {fraction} holds out every one of the "
            f"{what} (seed {seed}): none is left to train on; lower it"
        )


def _side_rows(side: str) -> str:
    return "of the held-out shards" if side == "evaluation" else "outside the held-out shards"


def shard_of_row(row_id: int, rows_per_shard: int) -> int:
    """Index of the shard holding `row_id` in a plan of `rows_per_shard`."""
    return row_id // rows_per_shard


# --- cached facts about a source file -------------------------------------------------------


def _cache_path(path: Path, cache_dir: str | os.PathLike) -> Path:
    key = xxhash.xxh3_64_hexdigest(str(path).encode())
    return Path(cache_dir) / f"source-{key}.json"


def _source_identity(path: Path) -> dict:
    try:
        identity = file_identity(path)
    except FileNotFoundError:
        raise PipelineError(f"dataset.path {path} does not exist") from None
    return {"version": _CACHE_VERSION, "path": str(path), "identity": list(identity)}


def _load_cache(path: Path, cache_dir: str | os.PathLike) -> tuple[dict, Path]:
    identity = _source_identity(path)
    cache_file = _cache_path(path, cache_dir)
    try:
        cached = json.loads(cache_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cached = {}
    if any(cached.get(k) != v for k, v in identity.items()):
        cached = dict(identity)  # the source changed: every cached fact is stale
    return cached, cache_file


def _row_bytes(path: Path):
    """Each source row's raw bytes, in row-id order (JSONL line, or canonical JSON of a row)."""
    if source_kind(path) == "jsonl":
        for _, _, raw in iter_jsonl_lines(path):
            yield raw
    else:
        for record in iter_parquet_records(path):
            yield json.dumps(
                record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
            ).encode()


def _count_rows(path: Path) -> int:
    if source_kind(path) == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (OSError, ValueError) as exc:
            raise PipelineError(f"dataset.path {path}: cannot read Parquet: {exc}") from None
    return sum(1 for _ in iter_jsonl_lines(path))


def count_source_rows(
    path: str | os.PathLike, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR
) -> int:
    """Number of data rows in the source (cached by path and file identity)."""
    path = Path(path).resolve()
    cached, cache_file = _load_cache(path, cache_dir)
    if "num_rows" not in cached:
        cached["num_rows"] = _count_rows(path)
        atomic_write_json(cache_file, cached)
    return cached["num_rows"]


def source_bad_rows(
    path: str | os.PathLike, fmt: str, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR
) -> tuple[BadRow | None, frozenset[int]]:
    """The source's first row that cannot be read as a conversation in `fmt` (or None), and the
    ids of all such rows (cached like the row count, per format)."""
    path = Path(path).resolve()
    cached, cache_file = _load_cache(path, cache_dir)
    by_format = cached.setdefault("bad_rows", {})
    if fmt not in by_format:
        bad = bad_rows_of(path, fmt)
        first = asdict(bad[0]) if bad else None
        by_format[fmt] = {"first": first, "row_ids": [row.row_id for row in bad]}
        atomic_write_json(cache_file, cached)
    found = by_format[fmt]
    first = None if found["first"] is None else BadRow(**found["first"])
    return first, frozenset(found["row_ids"])


def shard_source_digests(
    path: str | os.PathLike,
    rows_per_shard: int,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
) -> dict[str, str]:
    """`{shard name: xxh3-128 of the shard's raw source rows}` (cached like the row count)."""
    path = Path(path).resolve()
    plan_shards(0, rows_per_shard)  # validates rows_per_shard
    cached, cache_file = _load_cache(path, cache_dir)
    by_size = cached.setdefault("digests", {})
    key = str(rows_per_shard)
    if key not in by_size:
        digests: dict[str, str] = {}
        hasher = xxhash.xxh3_128()
        num_rows = 0
        for raw in _row_bytes(path):
            # Length-prefixed, so moving bytes across a row boundary changes the digest.
            hasher.update(len(raw).to_bytes(8, "little"))
            hasher.update(raw)
            num_rows += 1
            if num_rows % rows_per_shard == 0:
                digests[Shard(num_rows - rows_per_shard, num_rows).name] = hasher.hexdigest()
                hasher = xxhash.xxh3_128()
        if num_rows % rows_per_shard:
            start = num_rows - num_rows % rows_per_shard
            digests[Shard(start, num_rows).name] = hasher.hexdigest()
        by_size[key] = digests
        cached["num_rows"] = num_rows
        atomic_write_json(cache_file, cached)
    return by_size[key]


def plan_for_source(
    path: str | os.PathLike,
    rows_per_shard: int,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
) -> list[Shard]:
    """The shard plan of a source file (what the Snakefile expands its per-shard targets over)."""
    return plan_shards(count_source_rows(path, cache_dir), rows_per_shard)

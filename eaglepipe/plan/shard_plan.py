"""The shard plan: half-open row-id ranges over the *source* dataset, named `rows_{start}-{end}`.

Snakemake needs the shard list when it builds the DAG, so the plan is computed at parse time
from the source's row count (Parquet metadata, or the records of a JSONL file or JSON array as
`data.source_files` reads them: a cut-off array counts its whole records), not from a
checkpoint. Ranges are over source rows, so a row skipped by `prepare`
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
from ..data.dataset import BadRow, iter_rows
from ..data.source_files import (
    SourceCut,
    SourceRecords,
    iter_parquet_records,
    parquet_num_rows,
    source_kind,
)

DEFAULT_CACHE_DIR = ".eaglepipe/cache"
# 2: keyed on file_identity (inode, ctime), not size + mtime; 3: a row without an assistant
# message, or with a null format key beside a usable one, is read anew; every bad row's id kept;
# 4: JSON arrays and their cut, bad rows per format and turn order, with counts per reason
_CACHE_VERSION = 4
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


def _row_bytes(path: Path, found: dict):
    """Each source row's raw bytes, in row-id order (a JSONL line or a JSON array's element as
    in the file, or the canonical JSON of a Parquet row); `found["cut"]` is set after the
    last one (a SourceCut as a dict, or None)."""
    found["cut"] = None
    if source_kind(path) == "parquet":
        for record in iter_parquet_records(path):
            yield json.dumps(
                record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
            ).encode()
        return
    records = SourceRecords(path)
    for record in records:
        yield record.raw
    found["cut"] = asdict(records.cut) if records.cut else None


def _count_rows(path: Path, cached: dict) -> None:
    if source_kind(path) == "parquet":
        cached["num_rows"], cached["cut"] = parquet_num_rows(path), None
        return
    found: dict = {}
    cached["num_rows"] = sum(1 for _ in _row_bytes(path, found))
    cached["cut"] = found["cut"]


def count_source_rows(
    path: str | os.PathLike, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR
) -> int:
    """Number of data rows in the source (cached by path and file identity)."""
    path = Path(path).resolve()
    cached, cache_file = _load_cache(path, cache_dir)
    if "num_rows" not in cached or "cut" not in cached:
        _count_rows(path, cached)
        atomic_write_json(cache_file, cached)
    return cached["num_rows"]


def source_cut(
    path: str | os.PathLike, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR
) -> SourceCut | None:
    """Where a JSON array source stops being readable (None for a whole file), cached like the
    row count."""
    path = Path(path).resolve()
    cached, cache_file = _load_cache(path, cache_dir)
    if "cut" not in cached:
        _count_rows(path, cached)
        atomic_write_json(cache_file, cached)
    return None if cached["cut"] is None else SourceCut(**cached["cut"])


@dataclass(frozen=True)
class SourceBadRows:
    """What the source's rows make unusable as a whole, before any tokenizer: the first such
    row, every one's id, and how many per reason."""

    first: BadRow | None
    row_ids: frozenset[int]
    reasons: dict[str, int]


def source_bad_rows(
    path: str | os.PathLike,
    fmt: str,
    turn_order: str = "trim",
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
) -> SourceBadRows:
    """The source's rows that cannot be read as a conversation in `fmt` under `turn_order`
    (cached like the row count, per format and turn order)."""
    path = Path(path).resolve()
    cached, cache_file = _load_cache(path, cache_dir)
    by_rule = cached.setdefault("bad_rows", {})
    key = f"{fmt}/{turn_order}"
    if key not in by_rule:
        first = None
        ids: list[int] = []
        reasons: dict[str, int] = {}
        for row in iter_rows(path, fmt, turn_order):
            if isinstance(row, BadRow):
                if first is None:
                    first = {"row_id": row.row_id, "reason": row.reason, "detail": row.detail}
                    first["line"] = row.line
                ids.append(row.row_id)
                reasons[row.reason] = reasons.get(row.reason, 0) + 1
        by_rule[key] = {"first": first, "row_ids": ids, "reasons": reasons}
        atomic_write_json(cache_file, cached)
    found = by_rule[key]
    first = None if found["first"] is None else BadRow(**found["first"])
    return SourceBadRows(first, frozenset(found["row_ids"]), dict(found["reasons"]))


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
        found: dict = {}
        for raw in _row_bytes(path, found):
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
        cached["num_rows"], cached["cut"] = num_rows, found["cut"]
        atomic_write_json(cache_file, cached)
    return by_size[key]


def plan_for_source(
    path: str | os.PathLike,
    rows_per_shard: int,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
) -> list[Shard]:
    """The shard plan of a source file (what the Snakefile expands its per-shard targets over)."""
    return plan_shards(count_source_rows(path, cache_dir), rows_per_shard)

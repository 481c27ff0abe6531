"""The files of one regenerated shard: a row journal, the rows file and the manifest.

`regenerated/rows_{start}-{end}/` (docs/CONTRACTS.md, "Regenerated shards"):

- `journal.jsonl`: one line per finished row, appended and fsynced as the row finishes:
  `{"key": ..., "row": <row record>}`. `key` hashes the shard's provenance and the engine; a
  rerun keeps the rows journalled under the current key and drops the others, so a killed job
  loses no finished row and a rerun with other settings starts over.
- `rows.jsonl`: every source row of the shard, in row-id order, one row record per line
  (canonical JSON), written atomically once every row is done. A row record is
  `{"row_id", "messages", "regenerated_turns", "length_limited_turns", "turns_dropped",
  "output_tokens"}`, or `{"row_id", "bad": {"reason", "detail"}}` for a row that could not be
  regenerated (kept under `dataset.bad_rows: skip`).
- `manifest.json`: written last, atomically: the shard is done only when it exists. It holds
  the rows file's size and xxh3-128, counts, provenance and timing (`REGENERATED_MANIFEST`).
- `writer.lock`, `failed.json`: as in a hidden-state shard (`shard_store`);
  `manifest.invalid.json`: a manifest `eaglepipe verify` set aside (its rows file was damaged
  and the journal could not restore it), removed when the shard is regenerated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..core.atomic import atomic_write_bytes, atomic_write_json
from ..core.errors import PipelineError
from ..core.fingerprint import hash_bytes, hash_file
from ..core.journal import append_journal_line, journal_line
from ..core.manifest import MANIFEST_NAME, ManifestShape, read_manifest

FORMAT_VERSION = 1
ROWS_NAME = "rows.jsonl"
JOURNAL_NAME = "journal.jsonl"
INVALID_MANIFEST_NAME = "manifest.invalid.json"
REGENERATED_MANIFEST = ManifestShape(
    what="regenerated shard manifest",
    keys=("shard", "row_start", "row_end", "rows_file", "bytes", "xxh3_128", "provenance"),
    missing="does not exist: run snakemake",
)


def row_line(record: dict) -> bytes:
    """One row record as its canonical JSON line (the same record, the same bytes)."""
    return (
        json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n"
    ).encode()


def append_row(shard_dir: str | os.PathLike, key: str, record: dict) -> None:
    """Journal a finished row; durable before the call returns."""
    append_journal_line(Path(shard_dir) / JOURNAL_NAME, {"key": key, "row": record})


def journalled_rows(shard_dir: str | os.PathLike, key: str, row_ids: Iterable[int]) -> dict:
    """`{row_id: record}` of the rows finished under `key`; the journal is rewritten to hold
    only them (entries of other settings, other rows and a torn last line are dropped)."""
    shard_dir = Path(shard_dir)
    wanted = set(row_ids)
    kept: dict[int, dict] = {}
    try:
        text = (shard_dir / JOURNAL_NAME).read_text()
    except FileNotFoundError:
        return kept
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            record = entry["row"]
            row_id = record["row_id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line torn by a kill mid-append
        if entry.get("key") == key and row_id in wanted:
            kept[row_id] = record
    lines = b"".join(journal_line({"key": key, "row": kept[r]}) for r in sorted(kept))
    atomic_write_bytes(shard_dir / JOURNAL_NAME, lines)
    return kept


def write_rows(shard_dir: str | os.PathLike, records: list[dict]) -> tuple[int, str]:
    """Write `rows.jsonl` atomically; returns its size and xxh3-128."""
    data = b"".join(row_line(r) for r in records)
    atomic_write_bytes(Path(shard_dir) / ROWS_NAME, data)
    return len(data), hash_bytes(data)


def write_manifest(shard_dir: str | os.PathLike, manifest: dict) -> Path:
    path = Path(shard_dir) / MANIFEST_NAME
    atomic_write_json(path, manifest)
    return path


def rows_problem(manifest_path: str | os.PathLike, manifest: dict | None = None) -> str | None:
    """Why a finished shard's rows file does not match its manifest (missing, another size or
    checksum), or None when it does."""
    manifest_path = Path(manifest_path)
    manifest = (
        manifest if manifest is not None else read_manifest(manifest_path, REGENERATED_MANIFEST)[0]
    )
    rows_path = manifest_path.parent / manifest["rows_file"]
    try:
        size = rows_path.stat().st_size
    except FileNotFoundError:
        return f"{rows_path} is missing"
    if size != manifest["bytes"]:
        return f"{rows_path} is {size} bytes, its manifest lists {manifest['bytes']}"
    digest = hash_file(rows_path)
    if digest != manifest["xxh3_128"]:
        return (
            f"{rows_path} re-hashes to xxh3-128 {digest}, its manifest lists {manifest['xxh3_128']}"
        )
    return None


def restore_rows_from_journal(manifest_path: str | os.PathLike) -> bool:
    """Rewrite a damaged rows file from the shard's journal, when the journalled rows make
    exactly the bytes its manifest lists (the journal holds every finished row of the run that
    wrote the manifest). Returns whether it did; nothing is written otherwise."""
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path, REGENERATED_MANIFEST)[0]
    rows: dict[int, dict] = {}
    try:
        text = (manifest_path.parent / JOURNAL_NAME).read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return False
    for line in text.splitlines():
        try:
            record = json.loads(line)["row"]
            rows[record["row_id"]] = record
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn line
    wanted = range(manifest["row_start"], manifest["row_end"])
    if any(row_id not in rows for row_id in wanted):
        return False
    data = b"".join(row_line(rows[row_id]) for row_id in wanted)
    if len(data) != manifest["bytes"] or hash_bytes(data) != manifest["xxh3_128"]:
        return False
    atomic_write_bytes(manifest_path.parent / manifest["rows_file"], data)
    return True


def set_aside_manifest(manifest_path: str | os.PathLike, reason: str) -> Path:
    """Move a damaged shard's manifest to `manifest.invalid.json` (with the reason): the shard
    is not done, and the next run regenerates it, keeping its journalled rows."""
    manifest_path = Path(manifest_path)
    record = manifest_path.parent / INVALID_MANIFEST_NAME
    atomic_write_json(
        record,
        {"reason": reason, "manifest": read_manifest(manifest_path, REGENERATED_MANIFEST)[0]},
    )
    manifest_path.unlink()
    return record


def check_rows(manifest_path: str | os.PathLike, manifest: dict) -> None:
    """Refuse, in one line naming the file, a rows file that no longer matches its manifest."""
    problem = rows_problem(manifest_path, manifest)
    if problem:
        raise PipelineError(
            f"{problem}: run `eaglepipe verify`, which restores it from its journal (or sets the "
            "shard aside for `snakemake --cores N` to regenerate, keeping its journalled rows)"
        )


def iter_regenerated_rows(manifest_path: str | os.PathLike) -> Iterator[dict]:
    """The row records of a finished regenerated shard, checked against its manifest: the rows
    file's size and checksum, and one record per source row of the range, in order."""
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path, REGENERATED_MANIFEST)[0]
    rows_path = manifest_path.parent / manifest["rows_file"]
    check_rows(manifest_path, manifest)
    expected = manifest["row_start"]
    with open(rows_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record.get("row_id") != expected:
                raise PipelineError(
                    f"{rows_path}: row {record.get('row_id')} where row {expected} was expected"
                )
            expected += 1
            yield record
    if expected != manifest["row_end"]:
        raise PipelineError(
            f"{rows_path} stops before row {expected}; its shard ends at row "
            f"{manifest['row_end'] - 1}"
        )

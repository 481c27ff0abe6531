"""A shard's files besides its chunks: the journal (one line per finished chunk, the basis of
intra-shard resume), the manifest (written last and atomically: the shard is done only when it
exists; read by `core.manifest.read_manifest` in the shape `HIDDEN_STATES_MANIFEST`), setting a
damaged shard aside, and reading a finished shard row by row."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.atomic import atomic_write_bytes, atomic_write_json, fsync_dir
from ..core.errors import PipelineError
from ..core.fingerprint import hash_file
from ..core.hidden_store import BF16_STORE, HiddenStore
from ..core.journal import append_journal_line, journal_line
from ..core.jsonio import read_json_object
from ..core.manifest import MANIFEST_NAME, ManifestShape, read_manifest
from .chunk_file import CHUNK_PATTERN, FORMAT_VERSION, ChunkRecord, chunk_file_name, open_chunk

if TYPE_CHECKING:
    import torch

# A damaged shard's manifest, set aside by `invalidate_shard` (the shard is extracted again).
INVALID_MANIFEST_NAME = "manifest.invalid.json"
JOURNAL_NAME = "journal.jsonl"
HIDDEN_STATES_MANIFEST = ManifestShape(
    what="shard manifest",
    keys=(
        "format_version",
        "shard",
        "row_start",
        "row_end",
        "hidden_size",
        "num_aux_layers",
        "aux_layer_ids",
        "dtype",
        "num_rows",
        "num_tokens",
        "num_bytes",
        "chunks",
        "provenance",
        "timing",
    ),
    missing="does not exist: the shard has not finished extraction",
    format_version=FORMAT_VERSION,
    entries="chunks",
    entry_keys=("file", "bytes", "xxh3_128", "row_ids", "num_tokens"),
)


# ---------------------------------------------------------------------------------------------
# Journal and resume


def append_journal(
    shard_dir: str | os.PathLike, record: ChunkRecord, digest: str, extra: dict | None = None
) -> None:
    """Record a finished (renamed) chunk; durable before the next chunk starts.

    `extra` holds facts kept with the chunk (e.g. the engine that computed it).
    """
    entry = {**(extra or {}), **record.manifest_entry(), "plan_digest": digest}
    append_journal_line(Path(shard_dir) / JOURNAL_NAME, entry)


def read_journal(shard_dir: str | os.PathLike) -> dict[str, dict]:
    """The last journal entry per chunk file. A torn last line (a kill mid-append) is ignored."""
    entries: dict[str, dict] = {}
    try:
        text = (Path(shard_dir) / JOURNAL_NAME).read_text()
    except FileNotFoundError:
        return entries
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            entries[entry["file"]] = entry
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return entries


def verified_chunks(
    shard_dir: str | os.PathLike, chunks: list[list[int]], digest: str
) -> dict[int, ChunkRecord]:
    """Chunks of the plan that are finished and intact; everything else in the shard is cleared.

    A planned chunk counts as done only when the journal has an entry for it under the same
    plan digest and row ids, and the file exists with the journalled size and re-hashes to the
    journalled checksum. Unverifiable chunk files, chunk files outside the plan and stray temp
    files are deleted; the journal is rewritten to the verified entries.
    """
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        return {}
    journal = read_journal(shard_dir)
    done: dict[int, ChunkRecord] = {}
    for index, row_ids in enumerate(chunks):
        name = chunk_file_name(index)
        path = shard_dir / name
        entry = journal.get(name)
        if (
            entry is not None
            and entry.get("plan_digest") == digest
            and entry.get("row_ids") == row_ids
            and path.is_file()
            and path.stat().st_size == entry.get("bytes")
            and hash_file(path) == entry.get("xxh3_128")
        ):
            done[index] = ChunkRecord(
                file=name,
                bytes=int(entry["bytes"]),
                xxh3_128=entry["xxh3_128"],
                row_ids=list(row_ids),
                num_tokens=int(entry["num_tokens"]),
            )
    keep = {chunk_file_name(i) for i in done}
    for path in shard_dir.iterdir():
        stray_tmp = path.name.endswith(".tmp")
        unverified_chunk = path.match(CHUNK_PATTERN) and path.name not in keep
        if stray_tmp or unverified_chunk:
            path.unlink(missing_ok=True)
    lines = b"".join(
        journal_line({**journal[r.file], "plan_digest": digest}) for r in done.values()
    )
    atomic_write_bytes(shard_dir / JOURNAL_NAME, lines)
    return done


def journalled_bytes(shard_dir: str | os.PathLike, chunks: list[list[int]], digest: str) -> int:
    """Bytes of chunk files the journal vouches for (by size only: a cheap preflight estimate)."""
    shard_dir = Path(shard_dir)
    journal = read_journal(shard_dir)
    total = 0
    for index, row_ids in enumerate(chunks):
        entry = journal.get(chunk_file_name(index))
        path = shard_dir / chunk_file_name(index)
        if (
            entry
            and entry.get("plan_digest") == digest
            and entry.get("row_ids") == row_ids
            and path.is_file()
            and path.stat().st_size == entry.get("bytes")
        ):
            total += int(entry["bytes"])
    return total


# ---------------------------------------------------------------------------------------------
# Manifest


def build_manifest(
    *,
    shard: str,
    row_start: int,
    row_end: int,
    hidden_size: int,
    aux_layer_ids: list[int],
    records: Sequence[ChunkRecord],
    provenance: dict,
    timing: dict,
    store: HiddenStore = BF16_STORE,
) -> dict:
    """`dtype` is what readers get (bf16 values, dequantized from an FP8 store);
    `stored_dtypes` what the chunks hold, per hidden-state tensor."""
    return {
        "format_version": FORMAT_VERSION,
        "shard": shard,
        "row_start": int(row_start),
        "row_end": int(row_end),
        "hidden_size": int(hidden_size),
        "num_aux_layers": len(aux_layer_ids),
        "aux_layer_ids": list(aux_layer_ids),
        "dtype": "bfloat16",
        "stored_dtypes": store.manifest_dtypes(),
        "num_rows": sum(len(r.row_ids) for r in records),
        "num_tokens": sum(r.num_tokens for r in records),
        "num_bytes": sum(r.bytes for r in records),
        "chunks": [r.manifest_entry() for r in records],
        "provenance": provenance,
        "timing": timing,
    }


def write_manifest(shard_dir: str | os.PathLike, manifest: dict) -> Path:
    path = Path(shard_dir) / MANIFEST_NAME
    atomic_write_json(path, manifest)
    return path


def invalidate_shard(shard_dir: str | os.PathLike, reason: str) -> Path:
    """Set a damaged shard's manifest aside, so that the workflow extracts the shard again.

    A shard without `manifest.json` is not done: the next `snakemake --cores N` re-extracts it,
    and the journal check keeps every chunk that still verifies, so only the damaged chunks are
    computed again. The manifest is kept, with the reason, in `manifest.invalid.json` (written
    first: a crash in between leaves the shard as it was). A manifest that is itself the damage
    (torn, not JSON) is kept as its text.
    """
    shard_dir = Path(shard_dir)
    kept: dict
    try:
        kept = {"manifest": read_json_object(shard_dir / MANIFEST_NAME, what="shard manifest")}
    except PipelineError:
        raw = (shard_dir / MANIFEST_NAME).read_bytes()
        kept = {"manifest_text": raw.decode("utf-8", errors="replace")}
    record = shard_dir / INVALID_MANIFEST_NAME
    atomic_write_json(
        record, {"reason": reason, "invalidated_at": datetime.now(UTC).isoformat(), **kept}
    )
    (shard_dir / MANIFEST_NAME).unlink(missing_ok=True)
    fsync_dir(shard_dir)
    return record


def iter_rows(shard_dir: str | os.PathLike) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(row_id, tensors) for every row of a finished shard, in row-id order."""
    shard_dir = Path(shard_dir)
    manifest, _ = read_manifest(shard_dir, HIDDEN_STATES_MANIFEST)
    for chunk in manifest["chunks"]:
        with open_chunk(shard_dir / chunk["file"]) as reader:
            for i, row_id in enumerate(reader.row_ids):
                yield row_id, reader.row(i)

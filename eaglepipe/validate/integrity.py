"""integrity: every chunk the manifest lists present with its size and checksum, no unlisted
chunk in the shard directory (the manifest itself is read by `core.manifest.read_manifest`; one
that cannot be read fails `schema`)."""

from __future__ import annotations

from pathlib import Path

from ..core.fingerprint import hash_file
from .checks import CHUNK_GLOB, ValidationFailure


def _row_span(entry: dict) -> str:
    rows = entry["row_ids"]
    return f"rows {rows[0]}..{rows[-1]}" if rows else "no rows"


def check_chunk_file(shard_dir: Path, shard: str, entry: dict) -> Path:
    """The listed chunk exists with its listed byte size."""
    path = shard_dir / entry["file"]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ValidationFailure.in_chunk(
            shard,
            "integrity",
            f"{path} is listed in the manifest ({_row_span(entry)}) but missing",
            entry,
        ) from None
    if size != entry["bytes"]:
        raise ValidationFailure.in_chunk(
            shard,
            "integrity",
            f"{path} has {size} bytes, the manifest lists {entry['bytes']} ({_row_span(entry)})",
            entry,
        )
    return path


def check_chunk_checksum(shard_dir: Path, shard: str, entry: dict) -> None:
    """The chunk re-hashes (xxh3-128, streamed) to the manifest's checksum."""
    path = shard_dir / entry["file"]
    digest = hash_file(path)
    if digest != entry["xxh3_128"]:
        raise ValidationFailure.in_chunk(
            shard,
            "integrity",
            f"{path} re-hashes to xxh3-128 {digest}, the manifest lists {entry['xxh3_128']} "
            f"(corrupt chunk holding {_row_span(entry)})",
            entry,
        )


def check_no_stray_chunks(shard_dir: Path, shard: str, manifest: dict) -> None:
    """No chunk file on disk that the manifest does not list (a leftover or a copy mistake)."""
    listed = {entry["file"] for entry in manifest["chunks"]}
    stray = sorted(p.name for p in shard_dir.glob(CHUNK_GLOB) if p.name not in listed)
    if stray:
        raise ValidationFailure(
            shard,
            "integrity",
            f"{shard_dir / stray[0]} is not listed in the manifest "
            f"({len(stray)} unlisted chunk file(s): {', '.join(stray[:5])})",
            chunk=stray[0],
        )

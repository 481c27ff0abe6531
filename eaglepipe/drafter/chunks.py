"""The chunks a drafter stage reads, each checked against its manifest before it is opened.

Validation vouches for a shard's manifest, but a chunk's bytes can still change afterwards (a
flipped bit, a truncated copy, a file edited by hand). So training and evaluation list the
chunks they need from the manifests (`list_chunks`), re-hash each one against the size and
xxh3-128 checksum its manifest lists (`check_chunk`: streamed, once per chunk per process) and
stop before reading any data if one differs (`damage_error`), naming the chunk, its shard and
the repair. xxh3 runs far faster than a disk reads, so a check costs one sequential read of the
chunks. Under torchrun the ranks of a node split the checking between them (drafter/train.py).

Repair: `eaglepipe verify` sets the damaged shards' manifests aside, and the next `snakemake`
extracts and validates those shards again; extraction re-hashes every journalled chunk and redoes
only those that no longer verify.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import PipelineError
from ..core.fingerprint import hash_file
from ..core.hidden_store import HiddenStore
from ..core.manifest import read_manifest
from ..core.space import format_bytes
from ..extract.shard_files import HIDDEN_STATES_MANIFEST

INTACT, MISSING, WRONG_SIZE, WRONG_CHECKSUM, UNREADABLE = range(5)
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class Chunk:
    """One chunk file as its shard's manifest lists it."""

    path: str
    shard: str
    manifest: str
    bytes: int
    xxh3_128: str
    row_ids: tuple[int, ...]


def list_chunks(
    manifest_paths: Sequence[str | os.PathLike], row_ids: set[int] | None = None
) -> tuple[list[Chunk], dict]:
    """Chunks of the listed shards holding any of `row_ids` (all when None), and the facts the
    shards must share (`hidden_size`, `aux_layer_ids`, `stored_dtypes`)."""
    chunks: list[Chunk] = []
    facts: dict | None = None
    for manifest_path in manifest_paths:
        manifest, _ = read_manifest(manifest_path, HIDDEN_STATES_MANIFEST)
        these = {
            "hidden_size": manifest["hidden_size"],
            "aux_layer_ids": manifest["aux_layer_ids"],
            # One store for every shard read (the gate accepts only the configured one).
            "stored_dtypes": HiddenStore.from_manifest(manifest).manifest_dtypes(),
        }
        if facts is None:
            facts = these
        elif these != facts:
            raise PipelineError(
                f"shard manifest {manifest_path} has hidden_size/aux_layer_ids/stored_dtypes "
                f"{these}, other shards have {facts}"
            )
        shard_dir = Path(manifest_path).parent
        for entry in manifest["chunks"]:
            ids = tuple(int(i) for i in entry["row_ids"])
            if row_ids is None or not row_ids.isdisjoint(ids):
                chunks.append(
                    Chunk(
                        path=str(shard_dir / entry["file"]),
                        shard=shard_dir.name,
                        manifest=str(manifest_path),
                        bytes=int(entry["bytes"]),
                        xxh3_128=str(entry["xxh3_128"]),
                        row_ids=ids,
                    )
                )
    if facts is None:
        raise PipelineError("no shard manifests were given")
    return chunks, facts


_intact: set[Chunk] = set()  # chunks this process has checked


def check_chunk(chunk: Chunk) -> int:
    """INTACT when the file has the manifest's size and checksum, else what is wrong."""
    if chunk in _intact:
        return INTACT
    try:
        if os.path.getsize(chunk.path) != chunk.bytes:
            return WRONG_SIZE
        if hash_file(chunk.path) != chunk.xxh3_128:
            return WRONG_CHECKSUM
    except FileNotFoundError:
        return MISSING
    except OSError:
        return UNREADABLE
    _intact.add(chunk)
    return INTACT


def check_chunks(chunks: Sequence[Chunk], log: Callable[[str], None]) -> list[int]:
    """`check_chunk` of each chunk, logging progress every half minute of a long check."""
    began = last = time.monotonic()
    done_bytes = 0
    statuses = []
    for i, chunk in enumerate(chunks, start=1):
        statuses.append(check_chunk(chunk))
        done_bytes += chunk.bytes
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            rate = format_bytes(done_bytes / max(now - began, 1e-9))
            log(f"checked {i}/{len(chunks)} chunks ({format_bytes(done_bytes)}, {rate}/s)")
    if chunks:
        seconds = time.monotonic() - began
        log(f"checked {len(chunks)} chunks ({format_bytes(done_bytes)}) in {seconds:.1f}s")
    return statuses


def _problem(chunk: Chunk, status: int) -> str:
    if status == WRONG_SIZE:
        try:
            size = os.path.getsize(chunk.path)
        except OSError:
            return "changed size"
        return f"is {size} bytes, its manifest lists {chunk.bytes}"
    return {
        MISSING: "is missing",
        WRONG_CHECKSUM: "does not match its manifest's xxh3-128 checksum",
        UNREADABLE: "cannot be read",
    }[status]


def damage_error(chunks: Sequence[Chunk], statuses: Sequence[int]) -> PipelineError | None:
    """One line naming the first damaged chunk, its shard and the repair; None if all intact."""
    damaged = [(c, s) for c, s in zip(chunks, statuses, strict=True) if s != INTACT]
    if not damaged:
        return None
    first, status = damaged[0]
    shards = sorted({c.shard for c, _ in damaged})
    also = ""
    if len(damaged) > 1:
        also = f" ({len(damaged) - 1} more damaged chunk(s); damaged shards: {', '.join(shards)})"
    return PipelineError(
        f"chunk {first.path} of shard {first.shard} {_problem(first, status)}{also}: its bytes "
        "changed after extraction; repair: `eaglepipe verify` sets the damaged shards aside, "
        "then `snakemake --cores N` re-extracts their damaged chunks (intact chunks are kept)"
    )


def require_intact(chunks: Sequence[Chunk], log: Callable[[str], None]) -> None:
    """Check every chunk in this process; raise `damage_error` if any is damaged."""
    error = damage_error(chunks, check_chunks(chunks, log))
    if error is not None:
        raise error

"""The shard store: packed, checksummed chunk files plus a journal and a manifest per shard.

A shard directory `hidden_states/rows_{start}-{end}/` holds (docs/CONTRACTS.md, "Shard store"):

- `chunk-NNNNN.safetensors`: rows packed end to end in row-id order; membership planned up
  front from token counts (`plan_chunks`), so the layout depends only on the shard's inputs.
- `journal.jsonl`: one line per finished chunk (file, bytes, xxh3-128, row ids, tokens, plan
  digest), appended after the chunk's rename. A rerun trusts a chunk only if the journal vouches
  for it and the file still re-hashes to the journal's checksum (`verified_chunks`).
- `manifest.json`: written last and atomically; the shard is done only when it exists.
- `writer.lock`: flock held by the one process writing the shard, naming its PID and host.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors import safe_open

from .atomic import atomic_write_bytes, atomic_write_json, fsync_dir
from .errors import PipelineError
from .fingerprint import hash_bytes, hash_file, hash_json
from .jsonio import read_json_object, read_json_object_bytes

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# A damaged shard's manifest, set aside by `invalidate_shard` (the shard is extracted again).
INVALID_MANIFEST_NAME = "manifest.invalid.json"
# Why the shard's last extraction attempt failed (read by `eaglepipe status`); removed when an
# attempt starts, and with the shard directory.
FAILURE_NAME = "failed.json"
JOURNAL_NAME = "journal.jsonl"
LOCK_NAME = "writer.lock"
CHUNK_PATTERN = "chunk-*.safetensors"
BF16_BYTES = 2
# Per-token bytes besides the hidden states: input_ids int32 + loss_mask uint8.
TOKEN_ID_BYTES = 4 + 1
# Per-row bytes: one row_ids int64 and one offsets int64.
ROW_INDEX_BYTES = 16
# Tensor order inside a chunk: 8-byte types first, then bf16, then int32, then uint8, so every
# tensor starts on a boundary aligned for its dtype (bf16 sections are multiples of 8 bytes).
TENSOR_ORDER = (
    "row_ids",
    "offsets",
    "aux_hidden_states",
    "final_hidden_states",
    "input_ids",
    "loss_mask",
)
_SAFETENSORS_DTYPE = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bfloat16: "BF16",
}
_MANIFEST_KEYS = (
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
)


def chunk_file_name(index: int) -> str:
    return f"chunk-{index:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# Planning and sizes


def expected_bytes(num_tokens: int, hidden_size: int, num_aux_layers: int = 3) -> int:
    """Bytes of hidden states for `num_tokens` tokens: tokens x (aux + final) x H x bf16."""
    return int(num_tokens) * (num_aux_layers + 1) * int(hidden_size) * BF16_BYTES


def estimated_chunk_bytes(
    num_tokens: Sequence[int], hidden_size: int, num_aux_layers: int = 3
) -> int:
    """Estimated file size of a chunk holding rows of these token counts (header excluded)."""
    tokens = int(sum(num_tokens))
    return (
        expected_bytes(tokens, hidden_size, num_aux_layers)
        + tokens * TOKEN_ID_BYTES
        + len(num_tokens) * ROW_INDEX_BYTES
        + 8
    )


def plan_chunks(
    row_ids: Sequence[int],
    num_tokens: Sequence[int],
    hidden_size: int,
    num_aux_layers: int = 3,
    *,
    max_chunk_bytes: int,
) -> list[list[int]]:
    """Group rows into chunks, greedily in row-id order, each at most `max_chunk_bytes`.

    A row larger than the bound gets a chunk of its own. The result depends only on the inputs,
    so a rerun (or another machine) plans the same layout.
    """
    if len(row_ids) != len(num_tokens):
        raise ValueError("row_ids and num_tokens differ in length")
    if max_chunk_bytes <= 0:
        raise PipelineError(f"shards.chunk_max_bytes must be positive, got {max_chunk_bytes}")
    order = sorted(range(len(row_ids)), key=lambda i: int(row_ids[i]))
    per_token = (num_aux_layers + 1) * hidden_size * BF16_BYTES + TOKEN_ID_BYTES
    chunks: list[list[int]] = []
    current: list[int] = []
    current_bytes = 8
    for i in order:
        row_bytes = int(num_tokens[i]) * per_token + ROW_INDEX_BYTES
        if current and current_bytes + row_bytes > max_chunk_bytes:
            chunks.append(current)
            current, current_bytes = [], 8
        current.append(int(row_ids[i]))
        current_bytes += row_bytes
    if current:
        chunks.append(current)
    return chunks


def plan_digest(chunks: list[list[int]], content_key: dict) -> str:
    """Digest of a chunk plan together with what determines chunk content.

    `content_key` carries the shard's input hash, model, layer ids and hidden size: a chunk
    journalled under another digest was computed from other inputs and is never reused.
    """
    return hash_json({"chunks": chunks, "content": content_key})


def plan_bytes(num_tokens: Iterable[int], hidden_size: int, num_aux_layers: int = 3) -> int:
    """Expected bytes of hidden states for a whole plan (e.g. every shard still to extract)."""
    return expected_bytes(sum(int(t) for t in num_tokens), hidden_size, num_aux_layers)


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def free_bytes(directory: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds `directory` (or would hold it once created)."""
    return shutil.disk_usage(_existing_ancestor(Path(directory))).free


def check_free_space(needed_bytes: int, directory: str | os.PathLike, what: str) -> None:
    """Raise PipelineError when `needed_bytes` cannot fit on the filesystem of `directory`."""
    free = free_bytes(directory)
    if needed_bytes > free:
        raise PipelineError(
            f"{what} needs {format_bytes(needed_bytes)} but only {format_bytes(free)} is free "
            f"on the filesystem of {_existing_ancestor(Path(directory))}: free space or point "
            "the output elsewhere"
        )


def space_summary(needed_bytes: int, directory: str | os.PathLike) -> str:
    """One line for the workflow start: what the remaining plan needs against what is free."""
    free = free_bytes(directory)
    verdict = "fits" if needed_bytes <= free else "DOES NOT FIT"
    return (
        f"remaining extraction needs {format_bytes(needed_bytes)}; "
        f"{format_bytes(free)} free on {_existing_ancestor(Path(directory))}: {verdict}"
    )


# ---------------------------------------------------------------------------------------------
# Writing a chunk


@dataclass
class RowTensors:
    """One row as it goes into a chunk."""

    row_id: int
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux_hidden_states: torch.Tensor  # bf16 [T, 3H]
    final_hidden_states: torch.Tensor  # bf16 [T, H]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (
                self.input_ids,
                self.loss_mask,
                self.aux_hidden_states,
                self.final_hidden_states,
            )
        )


@dataclass(frozen=True)
class ChunkRecord:
    """A finished chunk, as the journal and the manifest list it."""

    file: str
    bytes: int
    xxh3_128: str
    row_ids: list[int]
    num_tokens: int

    def manifest_entry(self) -> dict:
        return {
            "file": self.file,
            "bytes": self.bytes,
            "xxh3_128": self.xxh3_128,
            "row_ids": self.row_ids,
            "num_tokens": self.num_tokens,
        }


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    tensor = tensor.detach().contiguous()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _check_row(row: RowTensors, hidden_size: int, num_aux_layers: int) -> None:
    t = row.num_tokens
    expected = {
        "input_ids": (row.input_ids, torch.int32, (t,)),
        "loss_mask": (row.loss_mask, torch.uint8, (t,)),
        "aux_hidden_states": (
            row.aux_hidden_states,
            torch.bfloat16,
            (t, num_aux_layers * hidden_size),
        ),
        "final_hidden_states": (row.final_hidden_states, torch.bfloat16, (t, hidden_size)),
    }
    for name, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise PipelineError(
                f"row {row.row_id}: {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                f"expected {dtype} {shape}"
            )


def _chunk_header(rows: Sequence[RowTensors], hidden_size: int, num_aux_layers: int) -> bytes:
    n = len(rows)
    total = sum(r.num_tokens for r in rows)
    shapes = {
        "row_ids": (torch.int64, [n]),
        "offsets": (torch.int64, [n + 1]),
        "aux_hidden_states": (torch.bfloat16, [total, num_aux_layers * hidden_size]),
        "final_hidden_states": (torch.bfloat16, [total, hidden_size]),
        "input_ids": (torch.int32, [total]),
        "loss_mask": (torch.uint8, [total]),
    }
    header: dict = {"__metadata__": {"format_version": str(FORMAT_VERSION)}}
    offset = 0
    for name in TENSOR_ORDER:
        dtype, shape = shapes[name]
        size = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    # The format pads the header with spaces so the data section starts 8-byte aligned.
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_chunk(
    shard_dir: str | os.PathLike,
    index: int,
    rows: Sequence[RowTensors],
    *,
    hidden_size: int,
    num_aux_layers: int = 3,
) -> ChunkRecord:
    """Write `rows` (in row-id order) as chunk `index`; returns its record (not yet journalled).

    The safetensors file is written by hand rather than with `safetensors.torch.save_file`:
    that function builds the whole file in memory (a second copy of a GiB-sized chunk) and
    its checksum would need a second pass over the written file. Here the header is computed
    from the known shapes, then each tensor's bytes are streamed row by row straight from the
    row tensors into the file and the xxh3-128 hasher, so the checksum is computed while
    writing and no concatenated copy is made. The result is a standard safetensors file.
    """
    shard_dir = Path(shard_dir)
    row_list = list(rows)
    if not row_list:
        raise ValueError("a chunk needs at least one row")
    ids = [r.row_id for r in row_list]
    if ids != sorted(ids) or len(set(ids)) != len(ids):
        raise ValueError(f"chunk rows must be in increasing row-id order, got {ids}")
    for row in row_list:
        _check_row(row, hidden_size, num_aux_layers)

    name = chunk_file_name(index)
    final_path = shard_dir / name
    tmp_path = shard_dir / f".{name}.tmp"
    offsets = np.zeros(len(row_list) + 1, dtype=np.int64)
    np.cumsum([r.num_tokens for r in row_list], out=offsets[1:])
    sections = {
        "row_ids": lambda: [memoryview(np.asarray(ids, dtype=np.int64))],
        "offsets": lambda: [memoryview(offsets)],
        "aux_hidden_states": lambda: (_as_bytes(r.aux_hidden_states) for r in row_list),
        "final_hidden_states": lambda: (_as_bytes(r.final_hidden_states) for r in row_list),
        "input_ids": lambda: (_as_bytes(r.input_ids) for r in row_list),
        "loss_mask": lambda: (_as_bytes(r.loss_mask) for r in row_list),
    }
    hasher = xxhash.xxh3_128()
    written = 0
    try:
        with open(tmp_path, "wb", buffering=0) as f:

            def emit(buf: bytes | memoryview) -> None:
                nonlocal written
                hasher.update(buf)
                view = memoryview(buf).cast("B")
                while view:
                    n = f.write(view)
                    view = view[n:]
                    written += n

            emit(_chunk_header(row_list, hidden_size, num_aux_layers))
            for section in TENSOR_ORDER:
                for buf in sections[section]():
                    emit(buf)
            os.fsync(f.fileno())
        os.replace(tmp_path, final_path)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise PipelineError(
                f"no space left on the filesystem of {shard_dir} while writing {name} "
                f"(rows {ids[0]}..{ids[-1]}): free space, then rerun to resume"
            ) from None
        raise
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    fsync_dir(shard_dir)
    return ChunkRecord(
        file=name,
        bytes=written,
        xxh3_128=hasher.hexdigest(),
        row_ids=ids,
        num_tokens=int(offsets[-1]),
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
    line = json.dumps(entry, sort_keys=True) + "\n"
    fd = os.open(Path(shard_dir) / JOURNAL_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


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
    lines = "".join(
        json.dumps({**journal[r.file], "plan_digest": digest}, sort_keys=True) + "\n"
        for r in done.values()
    )
    atomic_write_bytes(shard_dir / JOURNAL_NAME, lines.encode())
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
# One writer per shard


class ShardLock:
    """An exclusive flock on `<shard>/writer.lock`, recording the holder's PID, host and start.

    flock is released by the kernel when the holder dies (kill -9 included), so a stale lock
    file never blocks a rerun; a live holder makes a second writer fail naming its PID.
    """

    def __init__(self, shard_dir: str | os.PathLike):
        self.path = Path(shard_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> ShardLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder(fd)
            os.close(fd)
            raise PipelineError(
                f"shard {self.path.parent} is being written by another process "
                f"(PID {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
                f"since {holder.get('started_at', '?')}): stop it or wait for it to finish"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    @staticmethod
    def _read_holder(fd: int) -> dict:
        # The holder writes its details right after locking; give it a moment if it just did.
        for _ in range(20):
            raw = os.pread(fd, 4096, 0)
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                time.sleep(0.05)
        return {}

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ShardLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


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
) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "shard": shard,
        "row_start": int(row_start),
        "row_end": int(row_end),
        "hidden_size": int(hidden_size),
        "num_aux_layers": len(aux_layer_ids),
        "aux_layer_ids": list(aux_layer_ids),
        "dtype": "bfloat16",
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


def record_failure(shard_dir: str | os.PathLike, message: str) -> None:
    """Record why this attempt at the shard failed (its first line; the log has the rest)."""
    atomic_write_json(
        Path(shard_dir) / FAILURE_NAME,
        {"error": (message.splitlines() or [""])[0], "failed_at": datetime.now(UTC).isoformat()},
    )


def read_failure(shard_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(shard_dir) / FAILURE_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None


def invalidate_shard(shard_dir: str | os.PathLike, reason: str) -> Path:
    """Set a damaged shard's manifest aside, so that the workflow extracts the shard again.

    A shard without `manifest.json` is not done: the next `snakemake --cores N` re-extracts it,
    and the journal check keeps every chunk that still verifies, so only the damaged chunks are
    computed again. The manifest is kept, with the reason, in `manifest.invalid.json` (written
    first: a crash in between leaves the shard as it was).
    """
    shard_dir = Path(shard_dir)
    manifest = read_json_object(shard_dir / MANIFEST_NAME, what="shard manifest")
    record = shard_dir / INVALID_MANIFEST_NAME
    atomic_write_json(
        record,
        {"reason": reason, "invalidated_at": datetime.now(UTC).isoformat(), "manifest": manifest},
    )
    (shard_dir / MANIFEST_NAME).unlink(missing_ok=True)
    fsync_dir(shard_dir)
    return record


def read_manifest(path: str | os.PathLike) -> dict:
    """Load a shard manifest (the file, or its shard directory), checking its shape."""
    return read_manifest_and_hash(path)[0]


def read_manifest_and_hash(path: str | os.PathLike) -> tuple[dict, str]:
    """`read_manifest` and the xxh3-128 of the very bytes it parsed (a report that records the
    hash then describes exactly the manifest it checked, even if the file is replaced)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    manifest, raw = read_json_object_bytes(
        path, missing="does not exist: the shard has not finished extraction"
    )
    missing = [k for k in _MANIFEST_KEYS if k not in manifest]
    if missing:
        raise PipelineError(f"{path} lacks key(s) {', '.join(missing)}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise PipelineError(
            f"{path} has format_version {manifest['format_version']}, "
            f"this eaglepipe reads {FORMAT_VERSION}"
        )
    for i, chunk in enumerate(manifest["chunks"]):
        absent = [
            k for k in ("file", "bytes", "xxh3_128", "row_ids", "num_tokens") if k not in chunk
        ]
        if absent:
            raise PipelineError(f"{path}: chunks[{i}] lacks key(s) {', '.join(absent)}")
    return manifest, hash_bytes(raw)


# ---------------------------------------------------------------------------------------------
# Reading chunks


class ChunkReader:
    """A memory-mapped chunk: row index up front, per-row tensors sliced on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._file = safe_open(str(self.path), framework="pt")
        except FileNotFoundError:
            raise PipelineError(f"chunk {self.path} does not exist") from None
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise PipelineError(
                f"chunk {self.path} is not a readable safetensors file: {exc}"
            ) from exc
        missing = set(TENSOR_ORDER) - set(self._file.keys())
        if missing:
            raise PipelineError(f"chunk {self.path} lacks tensor(s) {', '.join(sorted(missing))}")
        self.row_ids: list[int] = self._file.get_tensor("row_ids").tolist()
        self.offsets: list[int] = self._file.get_tensor("offsets").tolist()

    def __len__(self) -> int:
        return len(self.row_ids)

    def tensor(self, name: str) -> torch.Tensor:
        return self._file.get_tensor(name)

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """Tensors of the i-th row of this chunk (not the row id)."""
        start, end = self.offsets[i], self.offsets[i + 1]
        return {
            name: self._file.get_slice(name)[start:end]
            for name in ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states")
        }

    def close(self) -> None:
        self._file = None

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_chunk(path: str | os.PathLike) -> ChunkReader:
    return ChunkReader(path)


def iter_rows(shard_dir: str | os.PathLike) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(row_id, tensors) for every row of a finished shard, in row-id order."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir / MANIFEST_NAME)
    for chunk in manifest["chunks"]:
        with open_chunk(shard_dir / chunk["file"]) as reader:
            for i, row_id in enumerate(reader.row_ids):
                yield row_id, reader.row(i)

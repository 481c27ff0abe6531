"""The chunk file: rows packed end to end in one safetensors file, written with its checksum.

A shard directory `hidden_states/rows_{start}-{end}/` holds (docs/CONTRACTS.md, "Shard store"):

- `chunk-NNNNN.safetensors` (this module): rows packed end to end in row-id order; membership
  planned up front from token counts (`plan_chunks`), so the layout depends only on the shard's
  inputs; the xxh3-128 is computed while writing, not by re-reading.
- `journal.jsonl` and `manifest.json`: `shard_files.py`. A rerun trusts a chunk only if the
  journal vouches for it and the file still re-hashes to the journal's checksum.
- `writer.lock`: `core/shard_job.py`, the flock held by the one process writing the shard.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash
from safetensors import safe_open

from ..core.atomic import Writeback, fsync_dir
from ..core.errors import PipelineError
from ..core.fingerprint import hash_json
from ..core.tensor_bytes import (
    RawTensor,
    byte_view,
    dtype_name,
    dtype_text,
    itemsize,
    nbytes,
    torch_dtype_text,
)

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
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


# ---------------------------------------------------------------------------------------------
# Writing a chunk


@dataclass
class RowTensors:
    """One row as it goes into a chunk: torch tensors, or (without torch) numpy arrays for the
    ids and mask and RawTensors for the hidden states (core/tensor_bytes.py)."""

    row_id: int
    input_ids: torch.Tensor | np.ndarray  # int32 [T]
    loss_mask: torch.Tensor | np.ndarray  # uint8 [T]
    aux_hidden_states: torch.Tensor | RawTensor  # bf16 [T, 3H]
    final_hidden_states: torch.Tensor | RawTensor  # bf16 [T, H]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(
            nbytes(t)
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


def _check_row(row: RowTensors, hidden_size: int, num_aux_layers: int) -> None:
    t = row.num_tokens
    expected = {
        "input_ids": (row.input_ids, "I32", (t,)),
        "loss_mask": (row.loss_mask, "U8", (t,)),
        "aux_hidden_states": (row.aux_hidden_states, "BF16", (t, num_aux_layers * hidden_size)),
        "final_hidden_states": (row.final_hidden_states, "BF16", (t, hidden_size)),
    }
    for name, (tensor, dtype, shape) in expected.items():
        if dtype_name(tensor) != dtype or tuple(tensor.shape) != shape:
            raise PipelineError(
                f"row {row.row_id}: {name} is {dtype_text(tensor)} {tuple(tensor.shape)}, "
                f"expected {torch_dtype_text(dtype)} {shape}"
            )


def _chunk_header(rows: Sequence[RowTensors], hidden_size: int, num_aux_layers: int) -> bytes:
    n = len(rows)
    total = sum(r.num_tokens for r in rows)
    shapes = {
        "row_ids": ("I64", [n]),
        "offsets": ("I64", [n + 1]),
        "aux_hidden_states": ("BF16", [total, num_aux_layers * hidden_size]),
        "final_hidden_states": ("BF16", [total, hidden_size]),
        "input_ids": ("I32", [total]),
        "loss_mask": ("U8", [total]),
    }
    header: dict = {"__metadata__": {"format_version": str(FORMAT_VERSION)}}
    offset = 0
    for name in TENSOR_ORDER:
        dtype, shape = shapes[name]
        size = int(np.prod(shape)) * itemsize(dtype)
        header[name] = {
            "dtype": dtype,
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
    writeback_bytes: int | None = None,
) -> ChunkRecord:
    """Write `rows` (in row-id order) as chunk `index`; returns its record (not yet journalled).

    Every `writeback_bytes` written (None: `WRITEBACK_STEP`, 64 MiB) are handed to the disk at
    once (`eaglepipe.core.atomic.Writeback`); 0 leaves that to the kernel.

    The safetensors file is written by hand rather than with `safetensors.torch.save_file`:
    that function builds the whole file in memory (a second copy of a GiB-sized chunk) and
    its checksum would need a second pass over the written file. Here the header is computed
    from the known shapes, then each tensor's bytes are streamed row by row straight from the
    row tensors into the file and, in a thread beside the writes, the xxh3-128 hasher, so the
    checksum is computed while writing and no concatenated copy is made. The result is a
    standard safetensors file.
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
        "aux_hidden_states": lambda: (byte_view(r.aux_hidden_states) for r in row_list),
        "final_hidden_states": lambda: (byte_view(r.final_hidden_states) for r in row_list),
        "input_ids": lambda: (byte_view(r.input_ids) for r in row_list),
        "loss_mask": lambda: (byte_view(r.loss_mask) for r in row_list),
    }
    hasher = xxhash.xxh3_128()
    written = 0
    # The hash runs beside the writes: xxhash and the file writes both release the GIL, and
    # one thread takes the updates in order. The rows outlive every update (waited for below).
    hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-hash")
    updates = []
    try:
        with open(tmp_path, "wb", buffering=0) as f:
            writeback = Writeback(f.fileno(), step=writeback_bytes)

            def emit(buf: bytes | memoryview) -> None:
                nonlocal written
                updates.append(hashing.submit(hasher.update, buf))
                view = memoryview(buf).cast("B")
                while view:
                    n = f.write(view)
                    view = view[n:]
                    written += n
                writeback.advance(written)

            emit(_chunk_header(row_list, hidden_size, num_aux_layers))
            for section in TENSOR_ORDER:
                for buf in sections[section]():
                    emit(buf)
            os.fsync(f.fileno())
        for update in updates:
            update.result()
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
    finally:
        hashing.shutdown(wait=True)  # no update may outlive the rows it reads
    fsync_dir(shard_dir)
    return ChunkRecord(
        file=name,
        bytes=written,
        xxh3_128=hasher.hexdigest(),
        row_ids=ids,
        num_tokens=int(offsets[-1]),
    )


# ---------------------------------------------------------------------------------------------
# Reading chunks


class ChunkReader:
    """A memory-mapped chunk: row index up front, per-row torch tensors sliced on demand."""

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

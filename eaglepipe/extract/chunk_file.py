"""The chunk file: rows packed end to end in one safetensors file, written with its checksum.

A shard directory `hidden_states/rows_{start}-{end}/` holds (docs/CONTRACTS.md, "Shard store"):

- `chunk-NNNNN.safetensors` (this module): rows packed end to end in row-id order; membership
  planned up front from token counts (`plan_chunks`), so the layout depends only on the shard's
  inputs; the xxh3-128 is computed while writing, not by re-reading. The hidden states are
  stored as `extract.store` says (core/hidden_store.py): bf16, or e4m3 with a float32
  `<name>_scale` [T, k] each, the store also named in the file's metadata. `ChunkReader` is the
  one reader of chunks (extraction, validation, training and evaluation), and dequantizes.
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
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ..core.atomic import Writeback, fsync_dir
from ..core.errors import PipelineError
from ..core.fingerprint import hash_json
from ..core.hidden_store import (
    AUX_KEY,
    BF16_STORE,
    FINAL_KEY,
    HIDDEN_KEYS,
    SCALE_DTYPE,
    HiddenStore,
    dequantize,
    scale_key,
)
from ..core.tensor_bytes import (
    RawTensor,
    byte_view,
    dtype_name,
    dtype_text,
    itemsize,
    nbytes,
    read_safetensors,
    torch_dtype_text,
)

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
CHUNK_PATTERN = "chunk-*.safetensors"
# Per-token bytes besides the hidden states: input_ids int32 + loss_mask uint8.
TOKEN_ID_BYTES = 4 + 1
# Per-row bytes: one row_ids int64 and one offsets int64.
ROW_INDEX_BYTES = 16
# The tensors of an all-bf16 chunk in file order (`HiddenStore.tensor_order`: each starts
# aligned for its dtype); an FP8 store adds its scales.
TENSOR_ORDER = BF16_STORE.tensor_order()
ROW_TENSORS = ("input_ids", "loss_mask", AUX_KEY, FINAL_KEY)
# The chunk's metadata key naming its store (FP8 chunks only: bf16 chunks are what they were).
STORE_METADATA_KEY = "store"


def chunk_file_name(index: int) -> str:
    return f"chunk-{index:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# Planning and sizes


def expected_bytes(
    num_tokens: int, hidden_size: int, num_aux_layers: int = 3, store: HiddenStore = BF16_STORE
) -> int:
    """Bytes of hidden states for `num_tokens` tokens as `store` keeps them (values and scales):
    with bf16, tokens x (aux + final) x H x 2."""
    return int(num_tokens) * store.token_bytes(hidden_size, num_aux_layers)


def token_bytes(hidden_size: int, num_aux_layers: int = 3, store: HiddenStore = BF16_STORE) -> int:
    """Bytes a token costs in a chunk: its hidden states as stored, its id and loss mask."""
    return store.token_bytes(hidden_size, num_aux_layers) + TOKEN_ID_BYTES


def estimated_chunk_bytes(
    num_tokens: Sequence[int],
    hidden_size: int,
    num_aux_layers: int = 3,
    store: HiddenStore = BF16_STORE,
) -> int:
    """Estimated file size of a chunk holding rows of these token counts (header excluded)."""
    tokens = int(sum(num_tokens))
    return (
        tokens * token_bytes(hidden_size, num_aux_layers, store)
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
    store: HiddenStore = BF16_STORE,
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
    per_token = token_bytes(hidden_size, num_aux_layers, store)
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


def plan_bytes(
    num_tokens: Iterable[int],
    hidden_size: int,
    num_aux_layers: int = 3,
    store: HiddenStore = BF16_STORE,
) -> int:
    """Expected bytes of hidden states for a whole plan (e.g. every shard still to extract)."""
    return expected_bytes(sum(int(t) for t in num_tokens), hidden_size, num_aux_layers, store)


# ---------------------------------------------------------------------------------------------
# Writing a chunk


@dataclass
class RowTensors:
    """One row as it goes into a chunk: torch tensors, or (without torch) numpy arrays for the
    ids and mask and RawTensors for the hidden states (core/tensor_bytes.py)."""

    row_id: int
    input_ids: torch.Tensor | np.ndarray  # int32 [T]
    loss_mask: torch.Tensor | np.ndarray  # uint8 [T]
    aux_hidden_states: torch.Tensor | RawTensor  # bf16 or e4m3 [T, 3H]
    final_hidden_states: torch.Tensor | RawTensor  # bf16 or e4m3 [T, H]
    # float32 [T, k] beside each e4m3 one, by scale name (`<name>_scale`).
    scales: dict[str, torch.Tensor | RawTensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def section(self, name: str):
        """The row's tensor `name` (a scale too)."""
        return self.scales[name] if name in self.scales else getattr(self, name)

    @property
    def nbytes(self) -> int:
        tensors = (self.input_ids, self.loss_mask, self.aux_hidden_states, self.final_hidden_states)
        return sum(nbytes(t) for t in (*tensors, *self.scales.values()))


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


def _tensor_shapes(
    tokens: int, hidden_size: int, num_aux_layers: int, store: HiddenStore
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of every token tensor of `tokens` tokens as `store` keeps them."""
    shapes = {
        "input_ids": ("I32", (tokens,)),
        "loss_mask": ("U8", (tokens,)),
        AUX_KEY: (store.dtype(AUX_KEY), (tokens, num_aux_layers * hidden_size)),
        FINAL_KEY: (store.dtype(FINAL_KEY), (tokens, hidden_size)),
    }
    for name, layers in ((AUX_KEY, num_aux_layers), (FINAL_KEY, 1)):
        if store.quantized(name):
            shapes[scale_key(name)] = (SCALE_DTYPE, (tokens, layers))
    return shapes


def _check_row(row: RowTensors, hidden_size: int, num_aux_layers: int, store: HiddenStore) -> None:
    expected = _tensor_shapes(row.num_tokens, hidden_size, num_aux_layers, store)
    extra = set(row.scales) - set(expected)
    if extra:
        raise PipelineError(
            f"row {row.row_id}: {', '.join(sorted(extra))} beside a {store.label()} store"
        )
    for name, (dtype, shape) in expected.items():
        tensor = row.scales.get(name) if name.endswith("_scale") else row.section(name)
        if tensor is None:
            raise PipelineError(f"row {row.row_id}: {name} is missing ({store.label()} store)")
        if dtype_name(tensor) != dtype or tuple(tensor.shape) != shape:
            raise PipelineError(
                f"row {row.row_id}: {name} is {dtype_text(tensor)} {tuple(tensor.shape)}, "
                f"expected {torch_dtype_text(dtype)} {shape}"
            )


def chunk_metadata(store: HiddenStore) -> dict[str, str]:
    """The chunk file's own metadata: its format and, for an FP8 store, the store and where
    each e4m3 tensor's scales are."""
    metadata = {"format_version": str(FORMAT_VERSION)}
    if not store.is_default:
        described = {name: store.dtype(name) for name in HIDDEN_KEYS}
        described["scales"] = {
            name: {"tensor": scale_key(name), "dtype": SCALE_DTYPE, "per": "token and layer"}
            for name in store.scaled_keys
        }
        metadata[STORE_METADATA_KEY] = json.dumps(described, sort_keys=True)
    return metadata


def _chunk_header(
    rows: Sequence[RowTensors], hidden_size: int, num_aux_layers: int, store: HiddenStore
) -> bytes:
    n = len(rows)
    total = sum(r.num_tokens for r in rows)
    shapes = {"row_ids": ("I64", [n]), "offsets": ("I64", [n + 1])}
    shapes |= {
        name: (dtype, list(shape))
        for name, (dtype, shape) in _tensor_shapes(
            total, hidden_size, num_aux_layers, store
        ).items()
    }
    header: dict = {"__metadata__": chunk_metadata(store)}
    offset = 0
    for name in store.tensor_order():
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
    store: HiddenStore = BF16_STORE,
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
        _check_row(row, hidden_size, num_aux_layers, store)

    name = chunk_file_name(index)
    final_path = shard_dir / name
    tmp_path = shard_dir / f".{name}.tmp"
    offsets = np.zeros(len(row_list) + 1, dtype=np.int64)
    np.cumsum([r.num_tokens for r in row_list], out=offsets[1:])
    fixed = {
        "row_ids": [memoryview(np.asarray(ids, dtype=np.int64))],
        "offsets": [memoryview(offsets)],
    }

    def section(tensor_name: str):
        if tensor_name in fixed:
            return fixed[tensor_name]
        return (byte_view(r.section(tensor_name)) for r in row_list)

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

            emit(_chunk_header(row_list, hidden_size, num_aux_layers, store))
            for tensor_name in store.tensor_order():
                for buf in section(tensor_name):
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
    """A chunk mapped from its file (core/tensor_bytes.py: private, copy-on-write, no copy
    made): the one reader of chunks, for extraction, validation, training and evaluation.

    Opening it needs no torch. `raw(name)` is a tensor's bytes as stored; `stored(name, a, b)`
    the torch views of rows a:b of a hidden-state tensor and of its scales (None for bf16), for
    a caller that dequantizes on its device (`core.hidden_store.dequantize`); `hidden(name, a,
    b, dtype)` and `row(i)` the values dequantized here, on the CPU.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.metadata, self._tensors = read_safetensors(self.path)
        except FileNotFoundError:
            raise PipelineError(f"chunk {self.path} does not exist") from None
        except (ValueError, OSError) as exc:
            raise PipelineError(
                f"chunk {self.path} is not a readable safetensors file: {exc}"
            ) from None

    def names(self) -> set[str]:
        return set(self._tensors)

    def require(self, names=TENSOR_ORDER) -> None:
        missing = set(names) - self.names()
        if missing:
            raise PipelineError(f"chunk {self.path} lacks tensor(s) {', '.join(sorted(missing))}")

    def raw(self, name: str) -> RawTensor:
        self.require([name])
        return self._tensors[name]

    def __len__(self) -> int:
        return len(self.row_ids)

    @cached_property
    def row_ids(self) -> list[int]:
        return self.raw("row_ids").data.tolist()

    @cached_property
    def offsets(self) -> list[int]:
        return self.raw("offsets").data.tolist()

    @cached_property
    def store(self) -> HiddenStore:
        """The store the chunk's hidden-state dtypes make (and the scales it must hold)."""
        try:
            store = HiddenStore.from_dtypes(self.raw(AUX_KEY).dtype, self.raw(FINAL_KEY).dtype)
        except ValueError as exc:
            raise PipelineError(f"chunk {self.path}: {exc}") from None
        self.require(scale_key(name) for name in store.scaled_keys)
        return store

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as stored, as a torch view of the mapped file."""
        return self.raw(name).to_torch()

    def stored(self, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows start:end of hidden-state tensor `name` as stored, and its scales (or None)."""
        values = self.raw(name).rows(start, end).to_torch()
        if not self.store.quantized(name):
            return values, None
        return values, self.raw(scale_key(name)).rows(start, end).to_torch()

    def hidden(self, name: str, start: int, end: int, dtype) -> torch.Tensor:
        """Rows start:end of hidden-state tensor `name` as `dtype` values (dequantized)."""
        values, scale = self.stored(name, start, end)
        return values.to(dtype) if scale is None else dequantize(values, scale, dtype)

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """Tensors of the i-th row of this chunk (not the row id), hidden states as bf16."""
        import torch

        start, end = self.offsets[i], self.offsets[i + 1]
        out = {name: self.raw(name).rows(start, end).to_torch() for name in ROW_TENSORS[:2]}
        for name in HIDDEN_KEYS:
            out[name] = self.hidden(name, start, end, torch.bfloat16)
        return out

    def close(self) -> None:
        self._tensors = {}

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_chunk(path: str | os.PathLike) -> ChunkReader:
    return ChunkReader(path)

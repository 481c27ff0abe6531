"""Streaming training batches out of the shard store.

Nothing is loaded whole: an index of (chunk, row, token range) is built from each chunk's
small `row_ids`/`offsets` tensors (chunks already checked against their manifests: chunks.py),
and a batch reads only its rows' slices through the chunk's memory map (`ChunkReader`). The
hidden states stay as stored: an FP8 store's e4m3 bytes and float32 scales go to the device as
they are, where `train.to_device` dequantizes them. Batches are planned
per epoch from a seed (shuffle, then length-sorted windows so padding stays small, then a
shuffled batch order), each holding at most `batch_tokens` padded tokens; a background thread
reads the next batches while the GPU trains on the current one.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.errors import PipelineError
from ..core.hidden_store import AUX_KEY, FINAL_KEY, HIDDEN_KEYS, scale_key
from ..extract.chunk_file import ChunkReader
from ..prepare.table import load_prepared
from .chunks import Chunk

SORT_WINDOW_BATCHES = 32
OPEN_CHUNKS = 64


@dataclass(frozen=True)
class RowRef:
    row_id: int
    chunk: str  # chunk file path
    start: int  # token offsets inside the chunk
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def split_row_ids(table_path: str | os.PathLike, split: str) -> set[int]:
    """Row ids of the prepared table whose `split` column equals `split`."""
    table = load_prepared(table_path, columns=["row_id", "split"])
    return set(table.loc[table["split"] == split, "row_id"].astype(int).tolist())


def index_rows(chunks: Sequence[Chunk], row_ids: set[int] | None = None) -> list[RowRef]:
    """Every row of the chunks (restricted to `row_ids`); check the chunks first (chunks.py)."""
    refs: list[RowRef] = []
    for chunk in chunks:
        with ChunkReader(chunk.path) as f:
            ids, offsets = f.row_ids, f.offsets
        for i, row_id in enumerate(ids):
            if row_ids is None or row_id in row_ids:
                refs.append(RowRef(row_id, chunk.path, offsets[i], offsets[i + 1]))
    return refs


def plan_batches(
    rows: Sequence[RowRef], batch_tokens: int, max_len: int, seed: int, epoch: int
) -> list[list[RowRef]]:
    """This epoch's batches: seeded, length-bucketed, each within `batch_tokens` padded tokens."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(rows))
    window = max(1, SORT_WINDOW_BATCHES * max(1, batch_tokens // max(1, max_len)))
    batches: list[list[RowRef]] = []
    for start in range(0, len(order), window):
        members = sorted((rows[i] for i in order[start : start + window]), key=lambda r: r.length)
        current: list[RowRef] = []
        for row in members:
            padded = (len(current) + 1) * min(row.length, max_len)
            if current and padded > batch_tokens:
                batches.append(current)
                current = []
            current.append(row)
        if current:
            batches.append(current)
    return [batches[i] for i in rng.permutation(len(batches))]


class ChunkCache:
    """A bounded set of open (memory-mapped) chunk files."""

    def __init__(self, capacity: int = OPEN_CHUNKS):
        self.capacity = capacity
        self._open: OrderedDict[str, ChunkReader] = OrderedDict()

    def get(self, path: str) -> ChunkReader:
        handle = self._open.pop(path, None)
        if handle is None:
            handle = ChunkReader(path)
            if len(self._open) >= self.capacity:
                self._open.popitem(last=False)
        self._open[path] = handle
        return handle


def load_batch(refs: Sequence[RowRef], max_len: int, cache: ChunkCache) -> dict:
    """Right-padded tensors of one batch; rows longer than `max_len` keep their first tokens.

    The hidden states as stored (bf16, or e4m3 with `<name>_scale` [B, S, k] float32 beside;
    padding is zero either way), for `train.to_device` to dequantize on the device."""
    lengths = [min(r.length, max_len) for r in refs]
    width = max(lengths)
    first = cache.get(refs[0].chunk)
    store = first.store
    b = len(refs)
    batch = {
        "input_ids": torch.zeros(b, width, dtype=torch.int64),
        "loss_mask": torch.zeros(b, width, dtype=torch.uint8),
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "row_ids": torch.tensor([r.row_id for r in refs], dtype=torch.int64),
    }
    for name in HIDDEN_KEYS:
        values, scale = first.stored(name, 0, 0)
        batch[name] = torch.zeros(b, width, values.shape[1], dtype=values.dtype)
        if scale is not None:
            batch[scale_key(name)] = torch.zeros(b, width, scale.shape[1], dtype=scale.dtype)
    for i, (ref, n) in enumerate(zip(refs, lengths, strict=True)):
        f = cache.get(ref.chunk)
        if f.store != store:
            raise PipelineError(
                f"chunk {ref.chunk} holds a {f.store.label()} store, chunk {refs[0].chunk} a "
                f"{store.label()} one: one training run reads one store"
            )
        start, end = ref.start, ref.start + n
        for name in ("input_ids", "loss_mask"):
            batch[name][i, :n] = f.raw(name).rows(start, end).to_torch()
        for name in (AUX_KEY, FINAL_KEY):
            values, scale = f.stored(name, start, end)
            batch[name][i, :n] = values
            if scale is not None:
                batch[scale_key(name)][i, :n] = scale
    return batch


class BatchStream:
    """Iterates loaded batches for a plan, reading ahead on a thread; counts time spent waiting."""

    def __init__(
        self,
        plans: Sequence[Sequence[RowRef]],
        max_len: int,
        prefetch: int = 4,
        pin_memory: bool = False,
    ):
        self.plans = plans
        self.max_len = max_len
        # Pinned host memory lets the trainer's copy to the GPU run asynchronously.
        self.pin_memory = pin_memory
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        cache = ChunkCache()
        try:
            for refs in self.plans:
                batch = load_batch(refs, self.max_len, cache)
                if self.pin_memory:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(None)
        except BaseException as exc:  # handed to the consumer, raised there
            self._queue.put(exc)

    def __iter__(self) -> Iterator[dict]:
        while True:
            began = time.perf_counter()
            item = self._queue.get()
            self.wait_seconds += time.perf_counter() - began
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

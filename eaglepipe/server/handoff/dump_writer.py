"""The dump writer, shared by the reference server and the SGLang forward hook.

The forward thread hands it a whole batch (real tokens only, packed in request order); on CUDA it
starts one asynchronous device-to-host copy into a reusable pinned buffer and returns, and a
background thread waits for the copy and writes the files (a few threads in parallel), so the
forward pass never waits on the disk. With an FP8 store (`extract.store`) the batch is quantized
on its device before the copy (core/hidden_store.py), so the copy, the pinned memory and the
files all hold half the bytes. The pinned memory it holds is bounded; `submit` blocks
(backpressure) when the writer thread falls behind by more than that bound. The file format and
the temp-name-then-rename handoff are `dumps.py`'s.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...core.errors import PipelineError
from ...core.hidden_store import BF16_STORE, HiddenStore, store_tensors
from .dumps import FINAL_KEY, dump_path, mark_dump_failed, temp_dump_path
from .request_ids import is_pipeline_rid

DEFAULT_MAX_PINNED_BYTES = 2 << 30
DEFAULT_FILE_THREADS = 4

OnDone = Callable[[str, BaseException | None], None]


# ----------------------------------------------------------------------------- memory


def _capacity_for(nbytes: int, limit: int) -> int:
    """Round up to a power of two (>= 1 MiB) so buffers get reused across batch sizes."""
    capacity = max(1 << 20, 1 << max(nbytes - 1, 1).bit_length())
    return capacity if capacity <= limit else nbytes


def _without(buffers: list[torch.Tensor], buffer: torch.Tensor) -> list[torch.Tensor]:
    return [b for b in buffers if b is not buffer]


class _HostBufferPool:
    """Reusable host buffers (pinned when `pin`), at most `limit_bytes` allocated at once.

    `acquire` blocks until the request fits. A request larger than the whole limit is still
    served, alone, once every other buffer has been returned: one oversized batch must not
    deadlock the server.
    """

    def __init__(self, limit_bytes: int, *, pin: bool):
        self.limit = int(limit_bytes)
        self.pin = pin
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._in_use = 0
        self._closed = False
        self.peak_bytes = 0

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def acquire(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        with self._cond:
            while True:
                if self._closed:
                    raise PipelineError("dump writer is closed")
                buffers = self._try_take(sizes)
                if buffers is not None:
                    return buffers
                self._cond.wait()

    def _try_take(self, sizes: Sequence[int]) -> list[torch.Tensor] | None:
        # Buffers are compared by identity throughout: `==` on tensors is elementwise.
        chosen: dict[int, torch.Tensor] = {}
        free = sorted(self._free, key=lambda b: b.numel())
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            fit = next((b for b in free if b.numel() >= sizes[index]), None)
            if fit is not None:
                free = _without(free, fit)
                chosen[index] = fit
        new_caps = {
            i: _capacity_for(size, self.limit) for i, size in enumerate(sizes) if i not in chosen
        }
        need = sum(new_caps.values())
        evictable = sum(b.numel() for b in free)
        fits = self._allocated - evictable + need <= self.limit
        alone = self._in_use == 0
        if not fits and not alone:
            return None
        # Drop unused free buffers, largest first, until the new allocations fit.
        for buffer in sorted(free, key=lambda b: -b.numel()):
            if self._allocated + need <= self.limit:
                break
            self._free = _without(self._free, buffer)
            self._allocated -= buffer.numel()
        for buffer in chosen.values():
            self._free = _without(self._free, buffer)
        for index, capacity in new_caps.items():
            chosen[index] = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)
            self._allocated += capacity
        self.peak_bytes = max(self.peak_bytes, self._allocated)
        taken = [chosen[i] for i in range(len(sizes))]
        self._in_use += sum(b.numel() for b in taken)
        return taken

    def release(self, buffers: Sequence[torch.Tensor]) -> None:
        with self._cond:
            for buffer in buffers:
                self._in_use -= buffer.numel()
                if self._closed:
                    self._allocated -= buffer.numel()
                else:
                    self._free.append(buffer)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._allocated -= sum(b.numel() for b in self._free)
            self._free.clear()
            self._cond.notify_all()


class _ByteBudget:
    """Bytes held by queued CPU batches; `take` blocks while over the limit (backpressure)."""

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self._cond = threading.Condition()
        self._held = 0

    def take(self, nbytes: int) -> None:
        with self._cond:
            # An oversized batch goes through alone rather than never.
            while self._held and self._held + nbytes > self.limit:
                self._cond.wait()
            self._held += nbytes

    def give(self, nbytes: int) -> None:
        with self._cond:
            self._held -= nbytes
            self._cond.notify_all()


# ----------------------------------------------------------------------------- writer


@dataclass
class _Batch:
    rids: list[str]
    token_counts: list[int]
    on_done: OnDone | None
    # The hidden states as stored, packed over the batch: {name: [T_total, ...]} on the host.
    tensors: dict[str, torch.Tensor] | None = None
    ready: torch.cuda.Event | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    budget_bytes: int = 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class DumpWriter:
    """Writes each request's slice of a batch's captured hidden states to its own dump file.

    `submit(rids, token_counts, aux, final, on_done)` takes aux [T_total, 3H] and final
    [T_total, H], packed over the batch's requests in order (real tokens only), and writes them
    as `store` says (bf16, or e4m3 with per-token, per-layer scales). It returns once
    the data is safe to reuse on the caller's side: on CUDA after the device-to-host copy has
    been queued on a side stream (the source tensors are kept alive until it finishes), on CPU
    at once (the caller must not modify the tensors afterwards). `on_done(rid, error)` is called
    once per rid from a writer thread (the rids of one batch are written by `file_threads`
    threads in parallel, so calls may come concurrently): after the rename for a dumped rid, or
    with error None and no file for a rid without the prefix. Write errors go to `on_done` and
    are raised again by the next `flush()` or `close()`.
    """

    def __init__(
        self,
        dump_dir: str | os.PathLike,
        prefix: str,
        *,
        aux_layer_ids: Sequence[int],
        store: HiddenStore = BF16_STORE,
        max_pinned_bytes: int = DEFAULT_MAX_PINNED_BYTES,
        file_threads: int = DEFAULT_FILE_THREADS,
        fsync: bool = False,
    ):
        # fsync is off by default: the handoff dir is a tmpfs and dumps are transient (a crash
        # loses the run's nonce anyway); the rename alone keeps readers from partial files.
        self.dump_dir = Path(dump_dir)
        self.prefix = prefix
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.store = store
        self.max_pinned_bytes = int(max_pinned_bytes)
        self.fsync = fsync
        self._pinned_pool: _HostBufferPool | None = None
        self._cpu_budget = _ByteBudget(self.max_pinned_bytes)
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._queue: queue.Queue[_Batch | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self._errors_lock = threading.Lock()
        self._closed = False
        self.files_written = 0
        self.bytes_written = 0
        self._file_pool = (
            ThreadPoolExecutor(file_threads, thread_name_prefix="eaglepipe-dump-file")
            if file_threads > 1
            else None
        )
        self._thread = threading.Thread(target=self._run, name="eaglepipe-dump-writer", daemon=True)
        self._thread.start()

    # -- producer side (forward thread)

    def submit(
        self,
        rids: Sequence[str],
        token_counts: Sequence[int],
        aux: torch.Tensor,
        final: torch.Tensor,
        on_done: OnDone | None = None,
    ) -> None:
        if self._closed:
            raise PipelineError("dump writer is closed")
        rids, token_counts = list(rids), [int(n) for n in token_counts]
        total = sum(token_counts)
        hidden = final.shape[-1] if final.dim() == 2 else -1
        num_aux = len(self.aux_layer_ids)
        if (
            len(rids) != len(token_counts)
            or final.dim() != 2
            or aux.dim() != 2
            or aux.shape[0] != total
            or final.shape[0] != total
            or aux.shape[1] != num_aux * hidden
        ):
            raise PipelineError(
                f"dump batch of {len(rids)} rids / {len(token_counts)} token counts (sum {total}) "
                f"does not match aux {list(aux.shape)} and final {list(final.shape)} "
                f"for {num_aux} aux layers"
            )
        batch = _Batch(rids, token_counts, on_done)
        if any(is_pipeline_rid(r, self.prefix) for r in rids):
            # Quantized where the batch is (the GPU, with SGLang): what leaves it is the store.
            with torch.no_grad():
                stored = store_tensors(self.store, aux.detach(), final.detach(), num_aux)
            if aux.is_cuda:
                self._stage_cuda(batch, stored)
            else:
                # Non-CUDA devices (and CPU) go through a plain blocking copy to host memory.
                batch.tensors = {name: t.to("cpu") for name, t in stored.items()}
                batch.budget_bytes = sum(_nbytes(t) for t in batch.tensors.values())
                self._cpu_budget.take(batch.budget_bytes)
        self._queue.put(batch)

    def _stage_cuda(self, batch: _Batch, stored: dict[str, torch.Tensor]) -> None:
        if self._pinned_pool is None:
            self._pinned_pool = _HostBufferPool(self.max_pinned_bytes, pin=True)
        names = list(stored)
        sources = [stored[name].contiguous() for name in names]
        device = sources[0].device
        sizes = [_nbytes(t) for t in sources]
        # Separate buffers: safetensors refuses to save two tensors that share storage.
        batch.buffers = self._pinned_pool.acquire(sizes)
        batch.tensors = {
            name: buf[:size].view(src.dtype).view(src.shape)
            for name, buf, size, src in zip(names, batch.buffers, sizes, sources, strict=True)
        }
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for name, src in zip(names, sources, strict=True):
                batch.tensors[name].copy_(src, non_blocking=True)
            batch.ready = torch.cuda.Event()
            batch.ready.record(stream)
        # The caching allocator must not hand these to the next forward before the copy ends.
        for src in sources:
            src.record_stream(stream)

    def flush(self) -> None:
        """Wait until every submitted batch is written; raise the errors seen since last flush."""
        self._queue.join()
        with self._errors_lock:
            errors, self._errors = self._errors, []
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise PipelineError(f"{errors[0]}{more}") from errors[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._queue.put(None)
            self._thread.join()
            if self._file_pool is not None:
                self._file_pool.shutdown()
            if self._pinned_pool is not None:
                self._pinned_pool.close()

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held now (free buffers included)."""
        return self._pinned_pool.allocated_bytes if self._pinned_pool else 0

    @property
    def pinned_peak_bytes(self) -> int:
        return self._pinned_pool.peak_bytes if self._pinned_pool else 0

    # -- writer thread

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                self._write_batch(batch)
            finally:
                self._queue.task_done()

    def _write_batch(self, batch: _Batch) -> None:
        copy_error: BaseException | None = None
        if batch.ready is not None:
            try:
                batch.ready.synchronize()
            except Exception as exc:  # a CUDA error poisons the whole batch
                copy_error = exc
        try:
            jobs, offset = [], 0
            for rid, count in zip(batch.rids, batch.token_counts, strict=True):
                jobs.append((rid, offset, count))
                offset += count
            if len(jobs) > 1 and self._file_pool is not None:
                # The file writes release the GIL, so a batch's files go out in parallel.
                list(self._file_pool.map(lambda job: self._finish(batch, *job, copy_error), jobs))
            else:
                for job in jobs:
                    self._finish(batch, *job, copy_error)
        finally:
            batch.tensors = None
            if batch.buffers and self._pinned_pool is not None:
                self._pinned_pool.release(batch.buffers)
            if batch.budget_bytes:
                self._cpu_budget.give(batch.budget_bytes)

    def _finish(
        self, batch: _Batch, rid: str, offset: int, count: int, copy_error: BaseException | None
    ) -> None:
        """Write one request's file (if its rid is the pipeline's), then call on_done."""
        error = None
        if is_pipeline_rid(rid, self.prefix):
            try:
                if copy_error is not None:
                    raise copy_error
                self._write_one(rid, batch, offset, count)
            except Exception as exc:
                error = PipelineError(f"dump of request {rid} to {self.dump_dir} failed: {exc}")
                with self._errors_lock:
                    self._errors.append(error)
                # SGLang answered the request already: tell its reader now, not after a timeout.
                mark_dump_failed(self.dump_dir, rid, str(error))
        self._notify(batch.on_done, rid, error)

    def _write_one(self, rid: str, batch: _Batch, offset: int, count: int) -> None:
        final_path = dump_path(self.dump_dir, rid)
        temp_path = temp_dump_path(self.dump_dir, rid)
        tensors = {
            name: tensor[offset : offset + count].contiguous()
            for name, tensor in batch.tensors.items()
        }
        metadata = {
            "rid": rid,
            "num_tokens": str(count),
            "hidden_size": str(tensors[FINAL_KEY].shape[1]),
            "aux_layer_ids": ",".join(str(i) for i in self.aux_layer_ids),
            # The whole forward pass, foreign requests included: what tells a request computed
            # alone (the spot check's premise) from one batched with others, on every engine.
            "batch_requests": str(len(batch.rids)),
            "batch_tokens": str(sum(batch.token_counts)),
        }
        try:
            save_file(tensors, str(temp_path), metadata=metadata)
            if self.fsync:
                fd = os.open(temp_path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(temp_path, final_path)
        except BaseException:
            temp_path.unlink(missing_ok=True)
            raise
        with self._errors_lock:
            self.files_written += 1
            self.bytes_written += sum(_nbytes(t) for t in tensors.values())

    @staticmethod
    def _notify(on_done: OnDone | None, rid: str, error: BaseException | None) -> None:
        if on_done is None:
            return
        try:
            on_done(rid, error)
        except Exception as exc:  # a broken callback must not stop the writer thread
            print(f"dump writer: on_done callback for {rid} raised {exc!r}", file=sys.stderr)

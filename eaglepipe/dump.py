"""The dump handoff: one safetensors file per request, written by the server, read by the client.

For each request whose id starts with `<prefix>-` the server writes
`<dump_dir>/<rid>.safetensors` holding `aux_hidden_states` (bf16 [T, 3H], the aux layers
concatenated in id order) and `final_hidden_states` (bf16 [T, H]), with string metadata `rid`,
`num_tokens`, `hidden_size`, `aux_layer_ids`, and `batch_requests` / `batch_tokens`: how many
requests (any prefix, health checks included) and real tokens the forward pass that computed the
request held. The file is written under the dot-prefixed temp name `.<rid>.safetensors.tmp` and
renamed into place, so a reader never sees a partial dump: a dump is complete exactly when its
final name exists, and `await_dump` / `wait_for_dump` are the one way the pipeline waits for that
(the SGLang hook writes from a background thread, so its dump can land after the HTTP answer).

`DumpWriter` is shared by the reference server and the SGLang forward hook. The forward thread
hands it a whole batch (real tokens only, packed in request order); on CUDA it starts one
asynchronous device-to-host copy into a reusable pinned buffer and returns, and a background
thread waits for the copy and writes the files (a few threads in parallel), so the forward pass
never waits on the disk.
The pinned memory it holds is bounded; `submit` blocks (backpressure) when the writer thread
falls behind by more than that bound.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import queue
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import PipelineError

AUX_KEY = "aux_hidden_states"
FINAL_KEY = "final_hidden_states"
DUMP_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".safetensors.tmp"
NONCE_HEX_CHARS = 12
DEFAULT_MAX_PINNED_BYTES = 2 << 30
DEFAULT_FILE_THREADS = 4
# How long a reader waits for the dump of an answered request. The reference server answers
# after the rename; SGLang answers when the forward is done and its hook's writer thread renames
# the file a little later (longer behind a backlog of large batches).
DUMP_WAIT_S = 60.0
DUMP_POLL_S = 0.005

_RID_RE = re.compile(r"^([A-Za-z][A-Za-z0-9]*)-([0-9a-f]{12})-([0-9]+)-([0-9]+)$")
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")
# A request id becomes a file name: no separators, no leading dot (temp names start with one).
_SAFE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

OnDone = Callable[[str, BaseException | None], None]


# ----------------------------------------------------------------------------- request ids


def make_rid(prefix: str, nonce: str, row_id: int, attempt: int) -> str:
    """`<prefix>-<nonce>-<row_id>-<attempt>`; every part is checked so `parse_rid` inverts it."""
    if not _PREFIX_RE.match(prefix):
        raise PipelineError(f"request prefix {prefix!r} must be a letter, then letters/digits")
    if not re.fullmatch(r"[0-9a-f]{12}", nonce):
        raise PipelineError(f"request nonce {nonce!r} must be {NONCE_HEX_CHARS} lowercase hex")
    if row_id < 0 or attempt < 0:
        raise PipelineError(f"row id {row_id} and attempt {attempt} must be non-negative")
    return f"{prefix}-{nonce}-{int(row_id)}-{int(attempt)}"


def parse_rid(rid: str) -> tuple[str, str, int, int]:
    """Split a pipeline request id into (prefix, nonce, row_id, attempt)."""
    match = _RID_RE.match(rid) if isinstance(rid, str) else None
    if match is None:
        raise PipelineError(f"request id {rid!r} is not <prefix>-<12 hex nonce>-<row id>-<attempt>")
    prefix, nonce, row_id, attempt = match.groups()
    return prefix, nonce, int(row_id), int(attempt)


def is_pipeline_rid(rid: str, prefix: str) -> bool:
    """Whether `rid` is one the pipeline asked for (so is dumped): it starts with `<prefix>-`."""
    return isinstance(rid, str) and rid.startswith(f"{prefix}-")


def dump_path(dump_dir: str | os.PathLike, rid: str) -> Path:
    if not isinstance(rid, str) or not _SAFE_NAME_RE.match(rid):
        raise PipelineError(f"request id {rid!r} cannot name a dump file")
    return Path(dump_dir) / f"{rid}{DUMP_SUFFIX}"


def temp_dump_path(dump_dir: str | os.PathLike, rid: str) -> Path:
    dump_path(dump_dir, rid)
    return Path(dump_dir) / f".{rid}{TEMP_SUFFIX}"


# ----------------------------------------------------------------------------- directory


def prepare_dump_dir(
    path: str | os.PathLike, *, what: str = "dump directory", refuse_open_mode: bool = False
) -> Path:
    """Create the dump directory with mode 0700 (missing parents too), or check an existing one.

    An existing directory must be a real directory owned by this user, since the handoff dir
    usually lives in a shared tmpfs where another user could otherwise read or plant dumps: a
    wrong owner or a symlink is refused. Any other mode than 0700 is fixed (the directory is
    ours), except that with `refuse_open_mode` (the handoff root, a predictable path that may
    have sat open for a while) one writable by group or others is refused.
    """
    path = Path(path).absolute()
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass  # created concurrently by another process; checked below
        except OSError as exc:
            raise PipelineError(f"cannot create {what} {directory}: {exc}") from None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise PipelineError(f"{what} {path} is a symlink; refusing to write through it")
    if not stat.S_ISDIR(info.st_mode):
        raise PipelineError(f"{what} {path} exists but is not a directory")
    if info.st_uid != os.getuid():
        raise PipelineError(
            f"{what} {path} is owned by {_user_name(info.st_uid)}, not by this user "
            f"({_user_name(os.getuid())}): another user could read or plant dumps there; remove "
            "it or choose another server.dump_root"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and refuse_open_mode:
        raise PipelineError(
            f"{what} {path} has mode {mode:o} (writable by group or others): check what is in "
            f"it, then `chmod 700 {path}`, or choose another server.dump_root"
        )
    if mode != 0o700:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise PipelineError(f"cannot set mode 0700 on {what} {path}: {exc}") from None
    return path


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


# ----------------------------------------------------------------------------- completion


class DumpNotWritten(PipelineError):
    """The server answered a request but its dump did not appear in time."""


async def await_dump(path: str | os.PathLike, within_s: float = DUMP_WAIT_S) -> Path:
    """Wait until the dump at `path` is complete (its final name exists); return the path.

    Raises DumpNotWritten after `within_s` seconds. The writer renames a finished temp file into
    place, so existence of the final name is completeness; nothing else needs to be polled.
    """
    path = Path(path)
    deadline = time.monotonic() + within_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise DumpNotWritten(
                f"the server answered request {path.name.removesuffix(DUMP_SUFFIX)} but wrote "
                f"no dump {path} within {within_s:g}s"
            )
        await asyncio.sleep(DUMP_POLL_S)
    return path


def wait_for_dump(path: str | os.PathLike, within_s: float = DUMP_WAIT_S) -> Path:
    """`await_dump` for synchronous callers (the validation spot check)."""
    return asyncio.run(await_dump(path, within_s))


# ----------------------------------------------------------------------------- reading


def read_dump(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Load one complete dump: (aux bf16 [T, 3H], final bf16 [T, H], metadata with ints decoded).

    The tensors map the file rather than copy it (safetensors), so no copy is made on the
    client's hot path; deleting the file frees its space only once the tensors are gone."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = f.metadata() or {}
            keys = set(f.keys())
            missing = {AUX_KEY, FINAL_KEY} - keys
            if missing:
                raise PipelineError(f"dump {path} lacks tensor(s) {', '.join(sorted(missing))}")
            aux = f.get_tensor(AUX_KEY)
            final = f.get_tensor(FINAL_KEY)
    except FileNotFoundError:
        raise PipelineError(f"dump {path} does not exist") from None
    except PipelineError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise PipelineError(f"dump {path} is unreadable: {exc}") from None
    try:
        meta = {
            "rid": raw_meta["rid"],
            "num_tokens": int(raw_meta["num_tokens"]),
            "hidden_size": int(raw_meta["hidden_size"]),
            "aux_layer_ids": [int(i) for i in raw_meta["aux_layer_ids"].split(",")],
            "batch_requests": int(raw_meta["batch_requests"]),
            "batch_tokens": int(raw_meta["batch_tokens"]),
        }
    except (KeyError, ValueError) as exc:
        raise PipelineError(f"dump {path} has bad or missing metadata ({exc})") from None
    tokens, hidden = meta["num_tokens"], meta["hidden_size"]
    num_aux = len(meta["aux_layer_ids"])
    for name, tensor, shape in (
        (AUX_KEY, aux, (tokens, num_aux * hidden)),
        (FINAL_KEY, final, (tokens, hidden)),
    ):
        if tensor.dtype != torch.bfloat16 or tuple(tensor.shape) != shape:
            raise PipelineError(
                f"dump {path}: {name} is {tensor.dtype} {list(tensor.shape)}, "
                f"expected torch.bfloat16 {list(shape)}"
            )
    return aux, final, meta


def concat_aux(aux_hidden_states: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """The packed [T, k*H] layout from a list of per-layer [T, H] tensors (or pass one through).

    Engines hand aux states over either way (SGLang as a list or already concatenated).
    """
    if isinstance(aux_hidden_states, torch.Tensor):
        return aux_hidden_states
    return torch.cat(list(aux_hidden_states), dim=-1)


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
    aux: torch.Tensor | None
    final: torch.Tensor | None
    on_done: OnDone | None
    ready: torch.cuda.Event | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    budget_bytes: int = 0


def _bf16_bytes(*shape: int) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * 2


class DumpWriter:
    """Writes each request's slice of a batch's captured hidden states to its own dump file.

    `submit(rids, token_counts, aux, final, on_done)` takes aux [T_total, 3H] and final
    [T_total, H], packed over the batch's requests in order (real tokens only). It returns once
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
        max_pinned_bytes: int = DEFAULT_MAX_PINNED_BYTES,
        file_threads: int = DEFAULT_FILE_THREADS,
        fsync: bool = False,
    ):
        # fsync is off by default: the handoff dir is a tmpfs and dumps are transient (a crash
        # loses the run's nonce anyway); the rename alone keeps readers from partial files.
        self.dump_dir = Path(dump_dir)
        self.prefix = prefix
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
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
        batch = _Batch(rids, token_counts, None, None, on_done)
        if any(is_pipeline_rid(r, self.prefix) for r in rids):
            if aux.is_cuda:
                self._stage_cuda(batch, aux, final)
            else:
                # Non-CUDA devices (and CPU) go through a plain blocking copy to host memory.
                batch.aux, batch.final = aux.detach().to("cpu"), final.detach().to("cpu")
                batch.budget_bytes = _bf16_bytes(total, (num_aux + 1) * hidden)
                self._cpu_budget.take(batch.budget_bytes)
        self._queue.put(batch)

    def _stage_cuda(self, batch: _Batch, aux: torch.Tensor, final: torch.Tensor) -> None:
        if self._pinned_pool is None:
            self._pinned_pool = _HostBufferPool(self.max_pinned_bytes, pin=True)
        device = aux.device
        aux = aux.detach().to(torch.bfloat16).contiguous()
        final = final.detach().to(torch.bfloat16).contiguous()
        aux_bytes, final_bytes = aux.numel() * 2, final.numel() * 2
        # Separate buffers: safetensors refuses to save two tensors that share storage.
        aux_buf, final_buf = self._pinned_pool.acquire([aux_bytes, final_bytes])
        batch.buffers = [aux_buf, final_buf]
        batch.aux = aux_buf[:aux_bytes].view(torch.bfloat16).view(aux.shape)
        batch.final = final_buf[:final_bytes].view(torch.bfloat16).view(final.shape)
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            batch.aux.copy_(aux, non_blocking=True)
            batch.final.copy_(final, non_blocking=True)
            batch.ready = torch.cuda.Event()
            batch.ready.record(stream)
        # The caching allocator must not hand these to the next forward before the copy ends.
        aux.record_stream(stream)
        final.record_stream(stream)

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
            batch.aux = batch.final = None
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
        self._notify(batch.on_done, rid, error)

    def _write_one(self, rid: str, batch: _Batch, offset: int, count: int) -> None:
        final_path = dump_path(self.dump_dir, rid)
        temp_path = temp_dump_path(self.dump_dir, rid)
        aux = batch.aux[offset : offset + count].to(torch.bfloat16).contiguous()
        final = batch.final[offset : offset + count].to(torch.bfloat16).contiguous()
        metadata = {
            "rid": rid,
            "num_tokens": str(count),
            "hidden_size": str(final.shape[1]),
            "aux_layer_ids": ",".join(str(i) for i in self.aux_layer_ids),
            # The whole forward pass, foreign requests included: what tells a request computed
            # alone (the spot check's premise) from one batched with others, on every engine.
            "batch_requests": str(len(batch.rids)),
            "batch_tokens": str(sum(batch.token_counts)),
        }
        try:
            save_file({AUX_KEY: aux, FINAL_KEY: final}, str(temp_path), metadata=metadata)
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
            self.bytes_written += (aux.numel() + final.numel()) * 2

    @staticmethod
    def _notify(on_done: OnDone | None, rid: str, error: BaseException | None) -> None:
        if on_done is None:
            return
        try:
            on_done(rid, error)
        except Exception as exc:  # a broken callback must not stop the writer thread
            print(f"dump writer: on_done callback for {rid} raised {exc!r}", file=sys.stderr)

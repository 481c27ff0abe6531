"""The extraction client: prefill-only requests to the hidden-state server, dumps collected.

Many requests are kept in flight so the server can batch them. Each row's request id is
`<prefix>-<nonce>-<row_id>-<attempt>` with a fresh nonce per client process, so a retry, a
re-extraction and a request left queued by a dead client never share a dump name. For every
answered request the client reads `<dump_dir>/<rid>.safetensors`, checks it against the
request, deletes it and hands the tensors to the caller: as the server stored them (bf16, or
e4m3 with their scales under an FP8 `extract.store`), never converted.

Two bounds: `max_inflight_requests` requests at the server (sent and not yet answered), and
`max_inflight_bytes` of dumps requested but not yet read and deleted, which keeps the handoff
directory (a tmpfs, usually) from filling. A request's slot is freed when the server answers,
not when its dump has been read: SGLang's hook writes the dump after the answer, and a slot
held through that wait and the read left the server's queue that much shorter than the slots
(BENCHMARKS.md, "Throughput at scale"). A liveness watchdog runs beside the requests, so a
server that dies or hangs fails the shard within seconds instead of after the per-request
timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from ..core.errors import PipelineError, ServerLost
from ..core.hidden_store import AUX_KEY, BF16_STORE, FINAL_KEY, HiddenStore
from ..core.run import RunSpec
from ..core.shard_job import process_age_s
from ..core.space import format_bytes, free_bytes
from ..core.tensor_bytes import RawTensor
from ..server.handoff.dumps import (
    DUMP_SUFFIX,
    DUMP_WAIT_S,
    FAILED_SUFFIX,
    DumpNotWritten,
    await_dump,
    read_dump_raw,
    take_dump_failure,
)
from ..server.handoff.request_ids import is_pipeline_rid, make_rid, new_nonce, parse_rid
from ..server.lifecycle.watch import (
    BACKOFF_BASE_S,
    BACKOFF_MAX_S,
    TransientError,
    liveness_check,
    watch_server,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RowRequest:
    row_id: int
    input_ids: Sequence[int]


@dataclass
class ExtractedRow:
    """One answered row. The client gives the dump's bytes as RawTensors (no torch: the job
    only moves them); `RawTensor.to_torch()` views them as torch tensors."""

    row_id: int
    aux_hidden_states: RawTensor | torch.Tensor  # bf16 or e4m3 [T, 3H]
    final_hidden_states: RawTensor | torch.Tensor  # bf16 or e4m3 [T, H]
    dump_bytes: int
    # The float32 scales [T, k] of the e4m3 ones, by tensor name (core/hidden_store.py).
    scales: dict[str, RawTensor | torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientSettings:
    request_prefix: str
    max_inflight_requests: int
    max_inflight_bytes: int
    retries: int
    request_timeout_s: float
    hidden_size: int
    num_aux_layers: int = 3
    store: HiddenStore = BF16_STORE

    @classmethod
    def from_run(
        cls, run: RunSpec, hidden_size: int, dump_dir: Path, server_info: dict
    ) -> ClientSettings:
        extract = run.extract
        max_bytes = extract.max_inflight_bytes
        if max_bytes is None:
            max_bytes = max(1, free_bytes(dump_dir) // 4)
        return cls(
            request_prefix=extract.request_prefix,
            max_inflight_requests=extract.inflight_requests("extract", server_info),
            max_inflight_bytes=int(max_bytes),
            retries=int(extract.retries),
            request_timeout_s=float(extract.request_timeout_s),
            hidden_size=hidden_size,
            store=extract.store,
        )

    def dump_bytes(self, num_tokens: int) -> int:
        return expected_dump_bytes(num_tokens, self.hidden_size, self.num_aux_layers, self.store)


@dataclass
class ClientStats:
    nonce: str
    requests_sent: int = 0
    retries: int = 0
    stale_dumps_swept: int = 0
    dump_bytes_ingested: int = 0
    failures: list[str] = field(default_factory=list)
    # Where the client's time goes (summed over concurrent requests where they overlap):
    # waiting for room in the in-flight bounds (of it, in the dump-bytes bound), for a dump to
    # appear after the answer, and reading dumps (in worker threads).
    budget_wait_s: float = 0.0
    bytes_wait_s: float = 0.0
    dump_wait_s: float = 0.0
    read_dump_s: float = 0.0
    # Seconds from the process's start to its first request (core.shard_job.process_age_s).
    first_request_s: float | None = None

    def timing(self) -> dict:
        return {
            "first_request_s": self.first_request_s,
            "budget_wait_s": round(self.budget_wait_s, 3),
            "bytes_wait_s": round(self.bytes_wait_s, 3),
            "dump_wait_s": round(self.dump_wait_s, 3),
            "read_dump_s": round(self.read_dump_s, 3),
        }


def expected_dump_bytes(
    num_tokens: int, hidden_size: int, num_aux_layers: int = 3, store: HiddenStore = BF16_STORE
) -> int:
    return num_tokens * store.token_bytes(hidden_size, num_aux_layers)


def require_handoff_room(
    dump_dir: Path,
    requests: Sequence[RowRequest],
    hidden_size: int,
    store: HiddenStore = BF16_STORE,
) -> None:
    """Refuse, before any request, a shard whose longest row's dump is larger than the whole
    file system of the handoff (a container's 64 MB /dev/shm against a large target): it could
    never be written, and each attempt would only end in the writer's ENOSPC. Space that is
    merely in use (other jobs' dumps) is not judged here: it frees as they are read."""
    if not requests:
        return
    longest = max(requests, key=lambda r: len(r.input_ids))
    need = expected_dump_bytes(len(longest.input_ids), hidden_size, store=store)
    total = shutil.disk_usage(dump_dir).total
    if need > total:
        raise PipelineError(
            f"row {longest.row_id}: its dump ({len(longest.input_ids)} tokens, "
            f"{format_bytes(need)}) cannot fit in the handoff {dump_dir}, whose file system "
            f"holds {format_bytes(total)} in all: give the server's dumps more room "
            "(server.dump_root on a larger file system, or a container's /dev/shm: "
            "docker run --shm-size)"
        )


class RequestSlot:
    """One row's place among the requests at the server: taken before each attempt is sent,
    given back as soon as the server answers it (or the attempt fails)."""

    def __init__(self, slots: asyncio.Semaphore, held: bool = False):
        self._slots = slots
        self._held = held

    async def take(self) -> None:
        if not self._held:
            await self._slots.acquire()
            self._held = True

    def give_back(self) -> None:
        if self._held:
            self._held = False
            self._slots.release()


class ByteBudget:
    """An async counting limit on bytes; one request larger than the cap runs alone."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_use = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_use == 0 or self.in_use + n <= self.capacity)
            self.in_use += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.in_use -= n
            self._cond.notify_all()


def sweep_stale_dumps(dump_dir: Path, prefix: str, nonce: str, row_ids: set[int]) -> int:
    """Delete dumps (temp dumps, failure notes) of these rows left by other client runs; never
    read them.

    Only rows of this shard are touched: other shards' clients share the handoff dir.
    """
    swept = 0
    for path in Path(dump_dir).iterdir():
        name = path.name
        if name.endswith(".tmp"):
            name = name.removeprefix(".").removesuffix(".tmp")
        if not name.endswith((DUMP_SUFFIX, FAILED_SUFFIX)):
            continue
        rid = name.removesuffix(DUMP_SUFFIX).removesuffix(FAILED_SUFFIX)
        if not is_pipeline_rid(rid, prefix):
            continue
        try:
            _prefix, their_nonce, row_id, _attempt = parse_rid(rid)
        except PipelineError:
            continue  # not a row request of ours (e.g. a hand-made rid): not ours to judge
        if row_id in row_ids and their_nonce != nonce:
            path.unlink(missing_ok=True)
            swept += 1
    return swept


def check_dump(aux, final, row: RowRequest, rid: str, settings: ClientSettings) -> None:
    """The dump must answer exactly this request: token count and layer widths (the tensors
    are RawTensors or torch tensors; `read_dump_raw` has checked their dtypes against the
    configured store)."""
    t = len(row.input_ids)
    h = settings.hidden_size
    where = f"row {row.row_id} (request {rid})"
    if aux.shape[0] != t or final.shape[0] != t:
        raise PipelineError(
            f"{where}: the server's dump holds {aux.shape[0]} tokens, the request had {t}"
        )
    if aux.shape[1] != settings.num_aux_layers * h:
        raise PipelineError(
            f"{where}: aux_hidden_states width {aux.shape[1]}, "
            f"expected {settings.num_aux_layers} x {h}"
        )
    if final.shape[1] != h:
        raise PipelineError(f"{where}: final_hidden_states width {final.shape[1]}, expected {h}")


class ExtractionClient:
    """One shard's worth of requests against one server; see `extract_rows`."""

    def __init__(
        self,
        url: str,
        dump_dir: Path,
        settings: ClientSettings,
        is_alive: Callable[[], bool] | None = None,
        nonce: str | None = None,
        log: Callable[[str], None] | None = None,
        gate=None,
    ):
        """`is_alive()` returns False or raises when the server process is gone; `gate` (the
        lifecycle's ServerHandle) lets a validation spot check in between requests."""
        self.url = url.rstrip("/")
        self.gate = gate
        self._in_flight = 0
        self._drained: asyncio.Condition | None = None
        self.dump_dir = Path(dump_dir)
        self.settings = settings
        self.is_alive = is_alive
        self.stats = ClientStats(nonce=nonce or new_nonce())
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))

    async def run(
        self,
        rows: Sequence[RowRequest],
        on_row: Callable[[ExtractedRow], Awaitable[None]],
        may_send: Callable[[int], Awaitable[None]] | None = None,
    ) -> ClientStats:
        s = self.settings
        swept = sweep_stale_dumps(
            self.dump_dir, s.request_prefix, self.stats.nonce, {r.row_id for r in rows}
        )
        self.stats.stale_dumps_swept = swept
        if swept:
            self.log(f"swept {swept} stale dump(s) of this shard's rows left by earlier runs")
        budget = ByteBudget(s.max_inflight_bytes)
        slots = asyncio.Semaphore(s.max_inflight_requests)
        connector = aiohttp.TCPConnector(limit=s.max_inflight_requests)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                async with asyncio.TaskGroup() as group:
                    watchdog = group.create_task(self._watchdog())
                    row_tasks = []
                    self._drained = asyncio.Condition()
                    for row in rows:
                        if may_send is not None:
                            await may_send(row.row_id)
                        await self._yield_to_exclusive_user()
                        size = s.dump_bytes(len(row.input_ids))
                        waiting_since = time.monotonic()
                        await budget.acquire(size)
                        self.stats.bytes_wait_s += time.monotonic() - waiting_since
                        await slots.acquire()
                        self.stats.budget_wait_s += time.monotonic() - waiting_since
                        slot = RequestSlot(slots, held=True)
                        row_tasks.append(
                            group.create_task(
                                self._one_row(session, row, size, budget, slot, on_row)
                            )
                        )
                    await asyncio.gather(*row_tasks)
                    watchdog.cancel()
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            self._remove_own_dumps()
        return self.stats

    async def _yield_to_exclusive_user(self) -> None:
        """A spot check waits for exclusive use of the server: drain, let it run, go on."""
        if self.gate is None or not self.gate.exclusive_waiting():
            return
        async with self._drained:
            await self._drained.wait_for(lambda: self._in_flight == 0)
        self.log("pausing requests: a validation spot check has the server")
        await asyncio.to_thread(self.gate.yield_to_exclusive)

    async def _one_row(self, session, row, size, budget, slot: RequestSlot, on_row) -> None:
        self._in_flight += 1
        try:
            extracted = await self._request_with_retries(session, row, slot)
        finally:
            slot.give_back()
            await budget.release(size)
            async with self._drained:
                self._in_flight -= 1
                self._drained.notify_all()
        await on_row(extracted)

    async def _request_with_retries(
        self, session, row: RowRequest, slot: RequestSlot
    ) -> ExtractedRow:
        s = self.settings
        last_error = ""
        for attempt in range(s.retries + 1):
            rid = make_rid(s.request_prefix, self.stats.nonce, row.row_id, attempt)
            await slot.take()
            try:
                return await self._request_once(session, row, rid, slot)
            except TransientError as exc:
                last_error = str(exc)
                self._remove_dump(rid)
                # A dead server is not worth retrying; is_alive raises its detailed error.
                if self.is_alive is not None and not await asyncio.to_thread(self.is_alive):
                    raise ServerLost(f"the server at {self.url} died during extraction") from None
                if attempt == s.retries:
                    break
                self.stats.retries += 1
                delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt)
                self.log(f"row {row.row_id}: {last_error}; retry {attempt + 1} in {delay:.2f}s")
                await asyncio.sleep(delay)
        if self.is_alive is not None:
            await asyncio.to_thread(self.is_alive)  # name a dead server rather than the row
        raise PipelineError(
            f"row {row.row_id} failed after {s.retries + 1} attempt(s): {last_error}"
        )

    async def _request_once(
        self, session, row: RowRequest, rid: str, slot: RequestSlot
    ) -> ExtractedRow:
        payload = {
            "input_ids": [int(t) for t in row.input_ids],
            "rid": rid,
            "sampling_params": {"max_new_tokens": 0},
        }
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s)
        if not self.stats.requests_sent:
            self.stats.first_request_s = process_age_s()
        self.stats.requests_sent += 1
        try:
            async with session.post(f"{self.url}/generate", json=payload, timeout=timeout) as resp:
                body = await resp.text()
                if resp.status >= 500:
                    # The reference server answers a failed dump write with a 500 (and, like
                    # SGLang's hook, leaves the writer's note): name it in full.
                    failure = take_dump_failure(
                        self.dump_dir / f"{rid}{DUMP_SUFFIX}", _error_message(body)
                    )
                    raise TransientError(failure or f"server answered {resp.status}: {body[:200]}")
                if resp.status != 200:
                    raise PipelineError(
                        f"row {row.row_id}: server refused request {rid} with {resp.status}: "
                        f"{body[:300]}"
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransientError(f"request {rid} failed: {type(exc).__name__} {exc}") from exc
        finally:
            slot.give_back()  # answered (or failed): the next request may go to the server
        path = self.dump_dir / f"{rid}.safetensors"
        answered = time.monotonic()
        try:
            # SGLang's hook writes after the answer: wait for the complete dump, as validation does.
            await await_dump(path, DUMP_WAIT_S)
        except DumpNotWritten as exc:
            raise TransientError(str(exc)) from None
        finally:
            self.stats.dump_wait_s += time.monotonic() - answered
        try:
            reading_since = time.monotonic()
            tensors, _meta = await asyncio.to_thread(read_dump_raw, path, self.settings.store)
            self.stats.read_dump_s += time.monotonic() - reading_since
            aux, final = tensors.pop(AUX_KEY), tensors.pop(FINAL_KEY)
            check_dump(aux, final, row, rid, self.settings)
        except PipelineError as exc:
            message = str(exc)
            if not message.startswith(f"row {row.row_id} "):
                message = f"row {row.row_id}: {message}"
            raise PipelineError(message) from None
        finally:
            path.unlink(missing_ok=True)
        size = self.settings.dump_bytes(len(row.input_ids))
        self.stats.dump_bytes_ingested += size
        return ExtractedRow(
            row_id=row.row_id,
            aux_hidden_states=aux,
            final_hidden_states=final,
            dump_bytes=size,
            scales=tensors,
        )

    async def _watchdog(self) -> None:
        await watch_server(self.url, self.is_alive, self.gate)

    def _remove_dump(self, rid: str) -> None:
        (self.dump_dir / f"{rid}.safetensors").unlink(missing_ok=True)

    def _remove_own_dumps(self) -> None:
        """Leave no dump of this run behind (requests cancelled by a failure may have landed)."""
        marker = f"-{self.stats.nonce}-"
        with contextlib.suppress(FileNotFoundError):
            for path in self.dump_dir.iterdir():
                if marker in path.name and path.name.endswith((DUMP_SUFFIX, FAILED_SUFFIX)):
                    path.unlink(missing_ok=True)


def _error_message(body: str) -> str | None:
    """`error.message` of a JSON error answer (the reference server's, SGLang's), else None."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error to report from a task group: a PipelineError (one clear line) if any."""
    chosen = group.subgroup(PipelineError) or group
    leaf: BaseException = chosen
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def _gate_of(handle):
    return handle if hasattr(handle, "exclusive_waiting") else None


def extract_rows(
    handle,
    rows: Sequence[RowRequest],
    on_row: Callable[[ExtractedRow], Awaitable[None]],
    settings: ClientSettings,
    *,
    may_send: Callable[[int], Awaitable[None]] | None = None,
    is_alive: Callable[[], bool] | None = None,
    log: Callable[[str], None] | None = None,
) -> ClientStats:
    """Request every row from the server behind `handle`; `on_row` gets each checked row.

    `may_send(row_id)` is awaited before each request (the caller's memory back-pressure).
    Raises PipelineError naming the row when a row keeps failing or a dump is wrong, and when
    the server dies or stops answering.
    """
    if is_alive is None:
        is_alive = liveness_check(handle)
    client = ExtractionClient(
        handle.url, Path(handle.dump_dir), settings, is_alive, log=log, gate=_gate_of(handle)
    )
    return asyncio.run(client.run(rows, on_row, may_send))


__all__ = [
    "ClientSettings",
    "ClientStats",
    "ExtractedRow",
    "ExtractionClient",
    "RowRequest",
    "check_dump",
    "expected_dump_bytes",
    "extract_rows",
    "new_nonce",
    "sweep_stale_dumps",
]

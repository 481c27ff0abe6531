"""One shard's extraction: prepared rows -> server -> checksummed chunks -> manifest.

`extract_shard(run, "rows_0-64")` (`run`: the run description, eaglepipe/core/run.py):

1. loads the shard's prepared rows and plans its chunks from their token counts;
2. checks the output filesystem has room for what is still to write (nothing is created
   when it has not);
3. takes the shard's writer lock and keeps every chunk the journal vouches for and that still
   re-hashes; everything else in the shard directory is cleared;
4. holds a server lease and requests only the rows of unfinished chunks; arriving rows are
   buffered and each chunk is written, in row order, as soon as all its rows are in. Rows are
   requested ahead of the chunk being written up to `extract.lookahead_bytes` (rows of the
   next two chunks always), so the server keeps computing while chunks are written, and
   memory stays bounded by the look-ahead plus the dumps in flight;
5. writes `manifest.json` last, with provenance and timing.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import xxhash

from .. import __version__
from ..core.config import HIDDEN_STATES_DIR, PREPARED_SUMMARY, PREPARED_TABLE
from ..core.errors import PipelineError
from ..core.hidden_store import BF16_STORE, HiddenStore
from ..core.jsonio import read_json_object
from ..core.layers import CONVENTION, FINAL_CONVENTION
from ..core.progress import Progress
from ..core.run import RunSpec
from ..core.shard_job import ShardLock, process_age_s, run_shard_job
from ..core.space import check_free_space, format_bytes, free_bytes
from ..plan.provenance import shard_provenance
from ..plan.shard_plan import parse_shard_name
from ..server.lifecycle.identity import chunk_reuse_key, engine_identity
from ..server.lifecycle.watch import liveness_check
from .chunk_file import (
    ChunkRecord,
    RowTensors,
    estimated_chunk_bytes,
    plan_chunks,
    plan_digest,
    write_chunk,
)
from .client import (
    ClientSettings,
    ExtractedRow,
    ExtractionClient,
    RowRequest,
    expected_dump_bytes,
    require_handoff_room,
)
from .shard_files import (
    INVALID_MANIFEST_NAME,
    MANIFEST_NAME,
    append_journal,
    build_manifest,
    journalled_bytes,
    verified_chunks,
    write_manifest,
)

PROGRESS_INTERVAL_S = 2.0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class ShardRows:
    """The prepared rows of one shard, in row-id order."""

    row_ids: list[int]
    input_ids: list[np.ndarray]  # int32 per row
    loss_masks: list[np.ndarray]  # uint8 per row

    @property
    def num_tokens(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]


def load_shard_rows(table_path: Path, start: int, end: int) -> ShardRows:
    from ..prepare.table import read_token_rows

    # Only this shard's row group is read: a job's start-up must not grow with the dataset.
    row_ids, input_ids, loss_masks = read_token_rows(table_path, start, end)
    return ShardRows(row_ids=row_ids, input_ids=input_ids, loss_masks=loss_masks)


def shard_inputs_hash(rows: ShardRows) -> str:
    """xxh3-128 over the shard's row ids, input ids and loss masks, in row order."""
    hasher = xxhash.xxh3_128()
    for row_id, ids, mask in zip(rows.row_ids, rows.input_ids, rows.loss_masks, strict=True):
        hasher.update(np.asarray([row_id, len(ids)], dtype=np.int64).tobytes())
        hasher.update(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
        hasher.update(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
    return hasher.hexdigest()


def _summary_provenance(summary_path: Path) -> dict:
    summary = read_json_object(summary_path, missing="is missing: run the prepare step first")
    return summary.get("provenance", summary)


def _tokenizer_fingerprint(run: RunSpec, summary: dict) -> str:
    recorded = summary.get("tokenizer_fingerprint")
    return recorded if recorded else run.model.tokenizer_fingerprint


def check_server_info(
    info: dict, aux_ids: list[int], hidden_size: int, url: str, store: HiddenStore = BF16_STORE
) -> None:
    """The server must capture the configured layers of a model of this width, and write the
    configured store."""
    if info.get("capture") is False:
        raise PipelineError(
            f"the server at {url} is a generation-only server (no capture): stop it "
            "(eaglepipe server stop) so a capturing one starts"
        )
    served_ids = [int(i) for i in info.get("aux_layer_ids", [])]
    if served_ids != aux_ids:
        raise PipelineError(
            f"the server at {url} captures aux layers {served_ids}, the config asks for "
            f"{aux_ids}: stop that server (eaglepipe server stop) so one with these layers starts"
        )
    served_hidden = int(info.get("hidden_size", -1))
    if served_hidden != hidden_size:
        raise PipelineError(
            f"the server at {url} serves hidden size {served_hidden}, the model in the config "
            f"has {hidden_size}: it is serving another model"
        )
    served_store = HiddenStore(**(info.get("store") or {}))
    if served_store != store:
        raise PipelineError(
            f"the server at {url} writes a {served_store.label()} store, the config's "
            f"extract.store is {store.label()}: stop that server (eaglepipe server stop) so one "
            "with this store starts"
        )


def check_server_engine(info: dict, engine: dict, url: str) -> None:
    """The leased server is the engine this job's chunks will be credited to."""
    for key in ("engine", "engine_version"):
        reported = info.get(key)
        if reported is not None and reported != engine[key]:
            raise PipelineError(
                f"the server at {url} reports {key} {reported!r}, but this job's environment "
                f"has {engine[key]!r}: run the workflow and the server in one environment"
            )


class ChunkAssembler:
    """Buffers arriving rows and writes each planned chunk, in order, once it is complete."""

    def __init__(
        self,
        shard_dir: Path,
        chunks: list[list[int]],
        todo: list[int],
        rows: ShardRows,
        digest: str,
        hidden_size: int,
        engine: dict,
        progress: Progress,
        log: Callable[[str], None],
        lookahead_bytes: int,
        writeback_bytes: int,
        store: HiddenStore = BF16_STORE,
    ):
        self.engine = engine
        self.store = store
        self.lookahead_bytes = lookahead_bytes
        self.writeback_bytes = writeback_bytes
        self.shard_dir = shard_dir
        self.chunks = chunks
        self.todo = todo
        self.digest = digest
        self.hidden_size = hidden_size
        self.progress = progress
        self.log = log
        self.chunk_of = {r: i for i, ids in enumerate(chunks) for r in ids}
        self.position = {chunk: pos for pos, chunk in enumerate(todo)}
        self.prepared = {
            r: (ids, mask)
            for r, ids, mask in zip(rows.row_ids, rows.input_ids, rows.loss_masks, strict=True)
        }
        self.row_bytes = {
            r: expected_dump_bytes(len(ids), hidden_size, store=store)
            for r, ids in zip(rows.row_ids, rows.input_ids, strict=True)
        }
        self.outstanding_bytes = 0  # rows requested whose chunk is not written yet
        self.buffer: dict[int, ExtractedRow] = {}
        self.next_pos = 0  # index into `todo` of the next chunk to write
        self.records: dict[int, ChunkRecord] = {}
        # Seconds requests were held back by the look-ahead bound, and spent writing chunks.
        self.lookahead_wait_s = 0.0
        self.write_s = 0.0
        self._write_lock = asyncio.Lock()
        self._advanced = asyncio.Condition()

    def _may_send_now(self, row_id: int) -> bool:
        pos = self.position[self.chunk_of[row_id]]
        within = self.outstanding_bytes + self.row_bytes[row_id] <= self.lookahead_bytes
        return pos <= self.next_pos + 1 or within

    async def may_send(self, row_id: int) -> None:
        """Hold back a row while the rows requested for unwritten chunks exceed the look-ahead
        bytes, unless its chunk is the next to write or the one after (progress is certain)."""
        if not self._may_send_now(row_id):
            waiting_since = time.monotonic()
            async with self._advanced:
                await self._advanced.wait_for(lambda: self._may_send_now(row_id))
            self.lookahead_wait_s += time.monotonic() - waiting_since
        self.outstanding_bytes += self.row_bytes[row_id]

    async def on_row(self, row: ExtractedRow) -> None:
        self.buffer[row.row_id] = row
        self.progress.advance(tokens=int(row.aux_hidden_states.shape[0]), bytes=row.dump_bytes)
        async with self._write_lock:
            while self.next_pos < len(self.todo):
                index = self.todo[self.next_pos]
                if any(r not in self.buffer for r in self.chunks[index]):
                    return
                rows = [self._row_tensors(self.buffer.pop(r)) for r in self.chunks[index]]
                writing_since = time.monotonic()
                record = await asyncio.to_thread(self._write, index, rows)
                self.write_s += time.monotonic() - writing_since
                self.records[index] = record
                async with self._advanced:
                    self.outstanding_bytes -= sum(self.row_bytes[r] for r in self.chunks[index])
                    self.next_pos += 1
                    self._advanced.notify_all()

    def _write(self, index: int, rows: list[RowTensors]) -> ChunkRecord:
        record = write_chunk(
            self.shard_dir,
            index,
            rows,
            hidden_size=self.hidden_size,
            writeback_bytes=self.writeback_bytes,
            store=self.store,
        )
        append_journal(self.shard_dir, record, self.digest, extra=self.engine)
        self.log(
            f"wrote {record.file}: {len(record.row_ids)} rows, {record.num_tokens} tokens, "
            f"{format_bytes(record.bytes)}"
        )
        return record

    def _row_tensors(self, row: ExtractedRow) -> RowTensors:
        ids, mask = self.prepared[row.row_id]
        return RowTensors(
            row_id=row.row_id,
            input_ids=ids,
            loss_mask=mask,
            aux_hidden_states=row.aux_hidden_states,
            final_hidden_states=row.final_hidden_states,
            scales=row.scales,
        )


def _extract_chunks(
    run: RunSpec,
    shard_dir: Path,
    chunks: list[list[int]],
    todo: list[int],
    rows: ShardRows,
    digest: str,
    hidden_size: int,
    aux_ids: list[int],
    engine: dict,
    progress: Progress,
    log: Callable[[str], None],
) -> tuple[dict[int, ChunkRecord], int, dict]:
    """Request the rows of the unfinished chunks and write those chunks as they complete."""
    from ..server.lifecycle.shared_server import server_lease

    wanted = {r for i in todo for r in chunks[i]}
    requests = [
        RowRequest(row_id=r, input_ids=ids.tolist())
        for r, ids in zip(rows.row_ids, rows.input_ids, strict=True)
        if r in wanted
    ]
    lease_asked_s = process_age_s()
    with server_lease(run) as handle:
        leased_s = process_age_s()
        info = dict(handle.info)
        store = run.extract.store
        check_server_info(info, aux_ids, hidden_size, handle.url, store)
        check_server_engine(info, engine, handle.url)
        require_handoff_room(Path(handle.dump_dir), requests, hidden_size, store)
        settings = ClientSettings.from_run(run, hidden_size, Path(handle.dump_dir), info)
        log(
            f"{progress.label}: requesting {len(requests)} rows from {handle.url} "
            f"({info.get('engine')} {info.get('engine_version')}), up to "
            f"{settings.max_inflight_requests} requests and "
            f"{format_bytes(settings.max_inflight_bytes)} of dumps in flight"
        )
        # Dumps are mapped, not copied (eaglepipe.server.handoff.dumps.read_dump), so rows held
        # for the look-ahead keep their handoff space until their chunk is written: by default the
        # look-ahead takes at most a quarter of the handoff's free space, as in-flight dumps do.
        lookahead = run.extract.lookahead_bytes or min(
            4 * run.shards.chunk_max_bytes,
            max(1, free_bytes(handle.dump_dir) // 4),
        )
        assembler = ChunkAssembler(
            shard_dir, chunks, todo, rows, digest, hidden_size, engine, progress, log,
            lookahead_bytes=lookahead,
            writeback_bytes=run.extract.chunk_writeback_mb << 20,
            store=store,
        )  # fmt: skip
        client = ExtractionClient(
            handle.url,
            Path(handle.dump_dir),
            settings,
            liveness_check(handle),
            log=log,
            gate=handle,
        )
        progress.restart_clock()  # rates count from the first request, not the server start
        try:
            asyncio.run(client.run(requests, assembler.on_row, assembler.may_send))
        except BaseException:
            log(
                f"{progress.label}: failed after {client.stats.requests_sent} request(s); "
                f"{len(assembler.records)} new chunk(s) kept for the rerun"
            )
            raise
    breakdown = {
        # The start-up's steps (process ages): the shard's rows read and its chunks planned,
        # then the lease held, and how the lease had the server's info.
        "lease_asked_s": lease_asked_s,
        "leased_s": leased_s,
        "lease_via": handle.joined_via,
        **client.stats.timing(),
        "lookahead_wait_s": round(assembler.lookahead_wait_s, 3),
        "chunk_write_s": round(assembler.write_s, 3),
    }
    return assembler.records, client.stats.requests_sent, breakdown


def extract_shard(
    run: RunSpec,
    shard_name: str,
    *,
    hidden_states_dir: Path = HIDDEN_STATES_DIR,
    prepared_table: Path = PREPARED_TABLE,
    prepared_summary: Path = PREPARED_SUMMARY,
    log: Callable[[str], None] = _log,
) -> dict:
    """Extract one shard (resuming verified chunks) and return its manifest."""
    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    # The start-up's parts, as process ages: here (interpreter, imports), the lease held
    # (`leased_s`), the first request (`first_request_s`).
    entered_s = process_age_s()
    shard = parse_shard_name(shard_name)
    # Up front: it also refuses a shard that is not in the plan before any work is done.
    workflow_stamp = shard_provenance(run, shard_name)
    shard_dir = Path(hidden_states_dir) / shard_name
    rows = load_shard_rows(Path(prepared_table), shard.start, shard.end)
    summary = _summary_provenance(Path(prepared_summary))
    hidden_size = run.model.hidden_size
    aux_ids = run.aux_layer_ids
    inputs_hash = shard_inputs_hash(rows)
    model_hash = run.model.config_hash
    engine = engine_identity(run)
    content_key = chunk_reuse_key(run, shard_inputs_hash=inputs_hash, engine=engine)
    store = run.extract.store
    chunks = plan_chunks(
        rows.row_ids,
        rows.num_tokens,
        hidden_size,
        max_chunk_bytes=run.shards.chunk_max_bytes,
        store=store,
    )
    digest = plan_digest(chunks, content_key)
    tokens_of = dict(zip(rows.row_ids, rows.num_tokens, strict=True))
    planned_bytes = sum(
        estimated_chunk_bytes([tokens_of[r] for r in ids], hidden_size, store=store)
        for ids in chunks
    )
    needed = max(0, planned_bytes - journalled_bytes(shard_dir, chunks, digest))
    check_free_space(needed, shard_dir, f"shard {shard_name}")

    with ShardLock(shard_dir):
        # A manifest left from an earlier run must not vouch for a shard being rewritten; a set
        # aside one has done its job once the shard is being extracted again.
        (shard_dir / MANIFEST_NAME).unlink(missing_ok=True)
        (shard_dir / INVALID_MANIFEST_NAME).unlink(missing_ok=True)
        done = verified_chunks(shard_dir, chunks, digest)
        todo = [i for i in range(len(chunks)) if i not in done]
        done_rows = sum(len(chunks[i]) for i in done)
        if done:
            log(
                f"{shard_name}: {len(done)}/{len(chunks)} chunk(s) verified from an earlier run "
                f"({done_rows} rows), {len(todo)} to extract"
            )
        requests_sent = 0
        breakdown: dict = {}
        progress = Progress(
            shard_name,
            len(rows.row_ids),
            done=done_rows,
            rates=(("tokens", "tokens/s", 1), ("bytes", "MB/s", 1e-6)),
            eta_counter="tokens",
            eta_total=sum(tokens_of[r] for i in todo for r in chunks[i]),
            log=log,
            every_s=PROGRESS_INTERVAL_S,
        )
        records = dict(done)
        # Kept chunks matched the reuse key, engine identity included: every chunk of the
        # shard was computed by `engine`, whether requested now or in an earlier attempt.
        if todo:
            new_records, requests_sent, breakdown = _extract_chunks(
                run,
                shard_dir,
                chunks,
                todo,
                rows,
                digest,
                hidden_size,
                aux_ids,
                engine,
                progress,
                log,
            )
            records.update(new_records)
        seconds = time.monotonic() - t0
        manifest = build_manifest(
            shard=shard_name,
            row_start=shard.start,
            row_end=shard.end,
            hidden_size=hidden_size,
            aux_layer_ids=aux_ids,
            store=store,
            records=[records[i] for i in range(len(chunks))],
            provenance={
                "model_config_hash": model_hash,
                "weights_fingerprint": content_key["weights"],
                "tokenizer_fingerprint": _tokenizer_fingerprint(run, summary),
                "dataset_hash": summary.get("dataset_hash"),
                "shard_inputs_hash": inputs_hash,
                "aux_layer_ids": aux_ids,
                "layer_convention": CONVENTION,
                "final_convention": FINAL_CONVENTION,
                "engine": engine["engine"],
                "engine_version": engine["engine_version"],
                # Device, dtype and layout too: what makes two shards' values comparable.
                "engine_identity": engine,
                # The stored dtypes: part of the shard's identity (the gate accepts only the
                # configured store).
                "stored_dtypes": store.manifest_dtypes(),
                "project_version": __version__,
                # What the workflow's rerun decision compares (eaglepipe.plan).
                "workflow": workflow_stamp,
            },
            timing={
                "started_at": started_at.isoformat(timespec="seconds"),
                "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "seconds": round(seconds, 3),
                "tokens_per_s": round(progress.amount("tokens") / seconds, 1),
                "mb_per_s": round(progress.amount("bytes") / seconds / 1e6, 3),
                "requests_sent": requests_sent,
                "entered_s": entered_s,
                # Where the time went: see ClientStats and ChunkAssembler.
                **breakdown,
            },
        )
        write_manifest(shard_dir, manifest)
    log(
        f"{shard_name}: done, {manifest['num_rows']} rows, {manifest['num_tokens']} tokens, "
        f"{format_bytes(manifest['num_bytes'])} in {len(chunks)} chunk(s), "
        f"{requests_sent} request(s) sent"
    )
    return manifest


def run_extract_job(
    run: RunSpec,
    shard_name: str,
    *,
    hidden_states_dir: Path = HIDDEN_STATES_DIR,
    log: Callable[[str], None] = _log,
) -> dict:
    """A shard job: `extract_shard`, once more with a fresh server if the server was lost."""
    return run_shard_job(
        Path(hidden_states_dir) / shard_name,
        "extraction",
        lambda: extract_shard(run, shard_name, hidden_states_dir=hidden_states_dir, log=log),
        log=log,
        kept="finished chunks are kept",
    )

"""The regenerate stage: one shard's conversations re-answered by the target, before prepare.

`regenerate_shard(run, "rows_0-64")`:

1. reads the shard's source rows (the same row ids and shard plan as everywhere else);
2. takes the shard's writer lock and keeps every row the journal holds under the current
   settings (`regen_store.journalled_rows`): a killed job loses no finished row;
3. holds a server lease (the server extraction uses, started once) and regenerates the other
   rows, up to `extract.max_inflight_requests` at a time, each conversation turn by turn: every
   assistant turn chosen by `dataset.regenerate.turns` is replaced by the target's own reply to
   the conversation so far, so later user turns follow the target's earlier replies; system and
   user turns are kept as they are. Each finished row is journalled at once;
4. writes `rows.jsonl` and then `manifest.json` (checksum, counts, provenance) atomically.

A conversation is regenerated up to `dataset.max_length` tokens: a turn whose prompt already
fills them ends the conversation there (prepare would truncate the rest away), and a reply is
given no more room than is left. A row the target cannot answer (an empty reply, a request the
server refuses, a reply at `max_new_tokens` under `on_length_limit: bad_row`) follows
`dataset.bad_rows`: `error` stops the job naming the row, `skip` records it as a bad row that
prepare counts in `prepared/skipped.json`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import xxhash

from .. import __version__
from ..core.config import REGENERATED_DIR
from ..core.errors import PipelineError
from ..core.fingerprint import hash_json
from ..core.progress import Progress
from ..core.run import RunSpec
from ..core.shard_job import ShardLock, run_shard_job
from ..data.chat_mask import render
from ..data.dataset import BadRow, Conversation, RowProblem, bad_row_error, iter_rows
from ..plan.provenance import (
    model_fingerprint,
    regeneration_provenance,
    shard_source_rows_digest,
)
from ..plan.shard_plan import Shard, parse_shard_name
from ..server.handoff.request_ids import new_nonce
from ..server.lifecycle.identity import GENERATION, engine_identity
from ..server.lifecycle.watch import liveness_check, watch_server
from .client import GenerationClient, GenerationSettings, RowRefused
from .store import (
    INVALID_MANIFEST_NAME,
    MANIFEST_NAME,
    ROWS_NAME,
    append_row,
    journalled_rows,
    write_manifest,
    write_rows,
)

PROGRESS_INTERVAL_S = 2.0

# The fixed reasons a row cannot be regenerated (prepare counts skipped rows per reason).
EMPTY_REPLY = "empty regenerated reply"
REPLY_AT_LENGTH_LIMIT = "regenerated reply hit max_new_tokens"
REGENERATION_REFUSED = "regeneration refused"


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def turn_seed(seed: int, row_id: int, turn: int) -> int:
    """The sampling seed of one turn: fixed by the configured seed, the row and the turn, so a
    resumed or repeated job draws the same way whatever ran before or beside it."""
    return xxhash.xxh3_64_intdigest(f"{seed}:{row_id}:{turn}".encode()) & (2**63 - 1)


def shard_source_rows(run: RunSpec, shard: Shard) -> list[Conversation | BadRow]:
    rows = []
    # The rows as prepare reads them: under turn_order trim, the kept turns only.
    for row in iter_rows(run.dataset.path, run.dataset.format, run.dataset.turn_order):
        if row.row_id >= shard.end:
            break
        if row.row_id >= shard.start:
            rows.append(row)
    if len(rows) != shard.num_rows:
        raise PipelineError(
            f"dataset.path {run.dataset.path} has {len(rows)} rows in {shard.name}, the plan "
            f"{shard.num_rows}: the file changed since the workflow was parsed; run snakemake again"
        )
    return rows


def bad_record(row_id: int, reason: str, detail: str) -> dict:
    return {"row_id": row_id, "bad": {"reason": reason, "detail": detail}}


class ShardRegenerator:
    """Regenerates the conversations of one shard through one server."""

    def __init__(self, run: RunSpec, tokenizer, client: GenerationClient, log):
        self.run = run
        self.settings = run.dataset.regenerate
        self.max_length = run.dataset.max_length
        self.tokenizer = tokenizer
        self.client = client
        self.log = log

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        text = render(self.tokenizer, messages, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _targets(self, messages: list[dict]) -> list[int]:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return turns[-1:] if self.settings.turns == "last" else turns

    async def conversation(self, session, row: Conversation) -> dict:
        """The row record of one conversation, its chosen assistant turns re-answered in order.

        Raises RowProblem when the target cannot answer one of them."""
        s = self.settings
        targets = set(self._targets(row.messages))
        kept: list[dict] = []
        regenerated: list[int] = []
        limited: list[int] = []
        dropped = 0
        tokens = 0
        for i, message in enumerate(row.messages):
            if i not in targets:
                kept.append(message)
                continue
            prompt = self._prompt_ids(kept)
            room = self.max_length - len(prompt)
            if room <= 0:
                dropped = len(row.messages) - i  # beyond max_length: prepare would cut it away
                break
            budget = min(s.max_new_tokens, room)
            try:
                reply = await self.client.generate(
                    session, row.row_id, i, prompt, budget, turn_seed(s.seed, row.row_id, i)
                )
            except RowRefused as exc:
                raise RowProblem(REGENERATION_REFUSED, str(exc)) from None
            tokens += len(reply.output_ids)
            text = self.tokenizer.decode(
                reply.output_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            if not text.strip():
                raise RowProblem(EMPTY_REPLY, f"message {i}: the target's reply is empty")
            kept.append({"role": "assistant", "content": text})
            regenerated.append(i)
            if reply.finish == "length" and budget < s.max_new_tokens:
                dropped = len(row.messages) - i - 1  # the reply filled max_length
                break
            if reply.finish == "length":
                limited.append(i)
                if s.on_length_limit == "bad_row":
                    raise RowProblem(
                        REPLY_AT_LENGTH_LIMIT,
                        f"message {i}: the target's reply reached {s.max_new_tokens} tokens "
                        "(dataset.regenerate.on_length_limit: bad_row)",
                    )
        return {
            "row_id": row.row_id,
            "messages": kept,
            "regenerated_turns": regenerated,
            "length_limited_turns": limited,
            "turns_dropped": dropped,
            "output_tokens": tokens,
        }


async def _regenerate_rows(
    run: RunSpec,
    regenerator: ShardRegenerator,
    rows: list[Conversation],
    on_record: Callable[[dict], None],
    source: str,
    handle,
    inflight: int,
) -> None:
    """Regenerate `rows` concurrently, `inflight` at a time; each finished (or, under skip,
    bad) row goes to `on_record` at once. Under `dataset.bad_rows: error` the first bad row
    stops everything."""
    slots = asyncio.Semaphore(inflight)
    policy = run.dataset.bad_rows

    async def one(session, row: Conversation) -> None:
        async with slots:
            try:
                record = await regenerator.conversation(session, row)
            except RowProblem as problem:
                bad = BadRow(row.row_id, problem.reason, problem.detail, row.line)
                if policy == "error":
                    raise bad_row_error(source, bad) from None
                record = bad_record(row.row_id, problem.reason, problem.detail)
            on_record(record)

    connector = aiohttp.TCPConnector(limit=inflight)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            async with asyncio.TaskGroup() as group:
                watchdog = group.create_task(
                    watch_server(
                        regenerator.client.url,
                        regenerator.client.is_alive,
                        handle,
                        what="regeneration",
                    )
                )
                await asyncio.gather(*(group.create_task(one(session, r)) for r in rows))
                watchdog.cancel()
    except BaseExceptionGroup as group:
        chosen = group.subgroup(PipelineError) or group
        leaf: BaseException = chosen
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise leaf from None


def regenerate_shard(
    run: RunSpec,
    shard_name: str,
    *,
    regenerated_dir: Path = REGENERATED_DIR,
    log: Callable[[str], None] = _log,
) -> dict:
    """Regenerate one shard (keeping journalled rows) and return its manifest."""
    from ..data.tokenizer import load_target_tokenizer, stop_token_ids
    from ..server.lifecycle.shared_server import server_lease

    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    shard = parse_shard_name(shard_name)
    workflow_stamp = regeneration_provenance(run, shard_name)  # refuses a shard not in the plan
    settings = run.dataset.regenerate
    source = run.dataset.path
    rows = shard_source_rows(run, shard)
    loading_since = time.monotonic()
    tokenizer = load_target_tokenizer(run)
    stops = stop_token_ids(tokenizer, run.model.directory)
    # Issue 28's start-up goal is "1 s plus the tokenizer's own load": keep the load apart.
    tokenizer_load_s = round(time.monotonic() - loading_since, 3)
    engine = engine_identity(run)
    # Rows are kept only when made under the same settings and by the same engine.
    key = hash_json({"workflow": workflow_stamp, "engine": engine, "stops": list(stops)})
    shard_dir = Path(regenerated_dir) / shard_name
    with ShardLock(shard_dir):
        (shard_dir / MANIFEST_NAME).unlink(missing_ok=True)
        records = journalled_rows(shard_dir, key, [r.row_id for r in rows])
        todo = [r for r in rows if r.row_id not in records]
        if records:
            log(
                f"{shard_name}: {len(records)}/{len(rows)} rows kept from an earlier run, "
                f"{len(todo)} to regenerate"
            )
        progress = Progress(
            shard_name,
            len(rows),
            done=len(records),
            counts=("turns",),
            rates=(("tokens", "output tokens/s", 1),),
            log=log,
            every_s=PROGRESS_INTERVAL_S,
        )

        def finished(record: dict) -> None:
            append_row(shard_dir, key, record)
            records[record["row_id"]] = record
            progress.advance(
                turns=len(record.get("regenerated_turns", [])),
                tokens=record.get("output_tokens", 0),
            )

        conversations = []
        for row in todo:
            if isinstance(row, BadRow):  # unusable in the source: nothing to ask the target
                if run.dataset.bad_rows == "error":
                    raise bad_row_error(source, row)
                finished(bad_record(row.row_id, row.reason, row.detail))
            else:
                conversations.append(row)
        requests_sent = 0
        first_request_s = None
        if conversations:
            # With SGLang a server of its own: no capture, so its radix cache, chunked prefill
            # and CUDA graphs stay on (identity.py).
            with server_lease(run, purpose=GENERATION) as handle:
                client = GenerationClient(
                    handle.url,
                    GenerationSettings(
                        temperature=settings.temperature,
                        top_p=settings.top_p,
                        stop_token_ids=stops,
                        request_prefix=run.extract.request_prefix,
                        retries=run.extract.retries,
                        request_timeout_s=run.extract.request_timeout_s,
                    ),
                    nonce=new_nonce(),
                    is_alive=liveness_check(handle),
                    log=log,
                )
                inflight = run.extract.inflight_requests("regenerate", handle.info)
                log(
                    f"{shard_name}: regenerating {len(conversations)} rows through {handle.url} "
                    f"({handle.info.get('engine')} {handle.info.get('engine_version')}), up to "
                    f"{inflight} rows at a time"
                )
                progress.restart_clock()
                regenerator = ShardRegenerator(run, tokenizer, client, log)
                try:
                    asyncio.run(
                        _regenerate_rows(
                            run, regenerator, conversations, finished, source, handle, inflight
                        )
                    )
                finally:
                    requests_sent = client.requests_sent
                    first_request_s = client.first_request_s
        ordered = [records[r.row_id] for r in rows]
        size, checksum = write_rows(shard_dir, ordered)
        manifest = _manifest(
            run,
            shard,
            ordered,
            size,
            checksum,
            provenance={
                "model_fingerprint": model_fingerprint(run),
                "model_config_hash": run.model.config_hash,
                "weights_fingerprint": run.model.weights_fingerprint,
                "tokenizer_fingerprint": run.model.tokenizer_fingerprint,
                "source_rows_digest": shard_source_rows_digest(run, shard_name),
                "settings": settings.output_settings(),
                "seed": settings.seed,
                "max_length": run.dataset.max_length,
                "stop_token_ids": list(stops),
                "engine": engine["engine"],
                "engine_version": engine["engine_version"],
                "engine_identity": engine,
                "project_version": __version__,
                # What the workflow's rerun decision compares (eaglepipe.plan).
                "workflow": workflow_stamp,
            },
            timing={
                "started_at": started_at.isoformat(timespec="seconds"),
                "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "seconds": round(time.monotonic() - t0, 3),
                "rows_kept": progress.kept,
                "rows_regenerated": progress.done - progress.kept,
                "requests_sent": requests_sent,
                "first_request_s": first_request_s,
                "tokenizer_load_s": tokenizer_load_s,
                "output_tokens": progress.amount("tokens"),
                "output_tokens_per_s": round(
                    progress.amount("tokens") / max(time.monotonic() - progress.started, 1e-9), 1
                ),
            },
        )
        write_manifest(shard_dir, manifest)
        (shard_dir / INVALID_MANIFEST_NAME).unlink(missing_ok=True)
    log(
        f"{shard_name}: done, {manifest['regenerated_rows']} rows regenerated "
        f"({manifest['turns_regenerated']} turns, {manifest['output_tokens']} output tokens), "
        f"{manifest['bad_rows']} bad, {requests_sent} request(s) sent"
    )
    return manifest


def _manifest(run, shard: Shard, records, size, checksum, *, provenance, timing) -> dict:
    bad = [r for r in records if "bad" in r]
    good = [r for r in records if "bad" not in r]
    return {
        "format_version": 1,
        "shard": shard.name,
        "row_start": shard.start,
        "row_end": shard.end,
        "rows_file": ROWS_NAME,
        "bytes": size,
        "xxh3_128": checksum,
        "num_rows": len(records),
        "regenerated_rows": len(good),
        "bad_rows": len(bad),
        "bad_reasons": dict(sorted(Counter(r["bad"]["reason"] for r in bad).items())),
        "turns_regenerated": sum(len(r["regenerated_turns"]) for r in good),
        "length_limited_replies": sum(len(r["length_limited_turns"]) for r in good),
        "turns_dropped": sum(r["turns_dropped"] for r in good),
        "output_tokens": sum(r["output_tokens"] for r in good),
        "provenance": provenance,
        "timing": timing,
    }


def run_regenerate_job(
    run: RunSpec,
    shard_name: str,
    *,
    regenerated_dir: Path = REGENERATED_DIR,
    log: Callable[[str], None] = _log,
) -> dict:
    """A shard job: `regenerate_shard`, once more with a fresh server if the server was lost."""
    return run_shard_job(
        Path(regenerated_dir) / shard_name,
        "regeneration",
        lambda: regenerate_shard(run, shard_name, regenerated_dir=regenerated_dir, log=log),
        log=log,
        kept="finished rows are kept",
    )

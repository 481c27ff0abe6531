"""The reference hidden-state server: any local Hugging Face causal LM behind SGLang's HTTP API.

It speaks the subset of SGLang's API the clients use (`/health`, `/health_generate`,
`/generate` with `max_new_tokens = 0`, `/model_info`, `/server_info`) and writes each prefixed
request's hidden states through the same `DumpWriter` as the SGLang hook. `/generate` with
`max_new_tokens > 0` generates text instead (greedy or seeded sampling, batched, never dumped:
`generate.py`). Concurrent prefill requests are batched by a token budget in one of two layouts
(`--attention`):

- packed: the requests end to end in one row of `--max-batch-tokens` tokens, each with its own
  positions, attention block-diagonal (flex_attention on CUDA): no padding is computed;
- padded: the oldest waiting request plus those closest to it in length, right-padded with an
  attention mask (causal attention keeps padding out of every real token's result).

`auto` packs on CUDA when torch has flex_attention and pads elsewhere (a CPU would spend minutes
compiling flex kernels). One worker thread runs the forward passes; writer threads write files.

    python -u -m eaglepipe.server.reference.server --model DIR --aux-layer-ids 1,3,4 --host H \
        --port P --dump-dir DIR --request-prefix eaglepipe --device auto --dtype auto \
        --max-batch-tokens N --attention auto --instance-id ID [--trust-remote-code] \
        [--store-aux fp8_e4m3] [--store-final fp8_e4m3]
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from ...core.errors import PipelineError
from ...core.fingerprint import hash_json, model_config_hash
from ...core.hidden_store import BF16, STORE_DTYPES, HiddenStore
from ...core.layers import CONVENTION, FINAL_CONVENTION
from ..handoff.dump_writer import DEFAULT_MAX_PINNED_BYTES, DumpWriter
from ..handoff.dumps import prepare_dump_dir
from ..handoff.request_ids import is_pipeline_rid, parse_rid
from .batching import select_batch
from .continuous_batching import JoinQueue, decode_continuously
from .engine import ReferenceEngine, resolve_dtype
from .faults import DIE_EXIT_CODE, Faults, faults_from_env
from .generate import BadSamplingParams, Generation, SamplingParams
from .settings import ATTENTION_LAYOUTS, DTYPE_NAMES, engine_version, resolve_device
from .startup_checks import check_aux_ids_against_config, check_port_free

ENGINE = "reference"
PROGRESS_INTERVAL_S = 5.0
# After a lone request arrives, wait this long for companions so concurrent clients share a
# forward pass; negligible next to a real prefill.
DEFAULT_BATCH_WINDOW_MS = 10.0


def log(message: str) -> None:
    print(f"[reference] {message}", flush=True)


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    future: asyncio.Future
    generate_ordinal: int | None = None  # 1-based count of /generate requests; None for health
    batch_size: int = 0
    started: float = field(default_factory=time.monotonic)
    sampling: SamplingParams | None = None  # set for text generation (max_new_tokens > 0)
    generation: Generation | None = None  # its result


@dataclass
class _Stats:
    requests: int = 0
    dumped: int = 0
    failed: int = 0
    tokens: int = 0
    batches: int = 0
    last_tokens: int = 0
    last_time: float = field(default_factory=time.monotonic)
    # Where the forward thread's time goes: in forward passes (incl. handing the batch to the
    # dump writer), and idle for want of requests. Idle time means the clients starve the GPU.
    busy_s: float = 0.0
    idle_s: float = 0.0
    padded_tokens: int = 0  # tokens computed, padding included
    last_busy_s: float = 0.0
    last_idle_s: float = 0.0
    generated: int = 0  # text generation requests answered
    generated_tokens: int = 0  # their new tokens
    generation_batches: int = 0

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "dumped": self.dumped,
            "failed": self.failed,
            "tokens": self.tokens,
            "batches": self.batches,
            "busy_s": round(self.busy_s, 3),
            "idle_s": round(self.idle_s, 3),
            "computed_tokens": self.padded_tokens,
            "generated": self.generated,
            "generated_tokens": self.generated_tokens,
            "generation_batches": self.generation_batches,
        }


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class ReferenceServer:
    def __init__(
        self,
        engine: ReferenceEngine,
        writer: DumpWriter,
        *,
        prefix: str,
        max_batch_tokens: int,
        info: dict,
        faults: Faults,
        batch_window_s: float = DEFAULT_BATCH_WINDOW_MS / 1000,
    ):
        self.engine = engine
        self.writer = writer
        self.prefix = prefix
        self.max_batch_tokens = max_batch_tokens
        self.info = info
        self.faults = faults
        self.batch_window_s = batch_window_s
        self.stats = _Stats()
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._waiting = 0
        self._in_flight: set[str] = set()
        self._generate_count = 0
        self._joins = JoinQueue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._tasks: list[asyncio.Task] = []

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/stats", self.server_stats)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app) -> None:
        self._tasks = [
            asyncio.create_task(self._batch_loop()),
            asyncio.create_task(self._progress_loop()),
        ]

    async def _on_cleanup(self, _app) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- HTTP handlers

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def health_generate(self, _request: web.Request) -> web.Response:
        item = self._enqueue(f"health-{uuid.uuid4().hex}", [0])
        try:
            await item.future
        except Exception as exc:
            return _error(503, f"health forward failed: {exc}")
        finally:
            self._in_flight.discard(item.rid)
        return web.Response(text="OK")

    async def model_info(self, _request: web.Request) -> web.Response:
        path = str(self.engine.model_dir)
        return web.json_response(
            {"model_path": path, "tokenizer_path": path, "is_generation": True}
        )

    async def server_info(self, _request: web.Request) -> web.Response:
        return web.json_response(self.info)

    async def server_stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.stats.as_dict())

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not valid JSON")
        self._generate_count += 1
        ordinal = self._generate_count
        if self.faults.dies_at(ordinal):
            log(f"fault die_after:{self.faults.die_after}: exiting on generate request {ordinal}")
            os._exit(DIE_EXIT_CODE)
        problem = self._check_body(body)
        if problem:
            return _error(400, problem)
        rid = body.get("rid") or uuid.uuid4().hex
        if rid in self._in_flight:
            return _error(400, f"rid {rid} is already in flight")
        sampling = self._generation_params(body)
        item = self._enqueue(rid, body["input_ids"], ordinal, sampling)
        if sampling is not None and self.faults.empty_reply_for(rid):
            # The empty_reply fault: the reply is only a stop token (the test of bad rows).
            stop = sampling.stop_token_ids[0] if sampling.stop_token_ids else 0
            item.generation = Generation([stop], "stop", stop)
            item.future.set_result(None)
        try:
            await item.future
        except PipelineError as exc:
            return _error(500, str(exc))
        except Exception as exc:
            return _error(500, f"request {rid} failed: {type(exc).__name__}: {exc}")
        finally:
            self._in_flight.discard(rid)
        tokens = len(item.input_ids)
        generated = item.generation or Generation([], "length")
        return web.json_response(
            {
                "text": "",
                "output_ids": generated.output_ids,
                "meta_info": {
                    "id": rid,
                    "prompt_tokens": tokens,
                    "completion_tokens": len(generated.output_ids),
                    "cached_tokens": 0,
                    "finish_reason": generated.finish_reason(),
                    "e2e_latency": time.monotonic() - item.started,
                    "batch_size": item.batch_size,
                },
            }
        )

    def _generation_params(self, body: dict) -> SamplingParams | None:
        """The sampling parameters of a text generation request (checked), None for prefill."""
        params = body.get("sampling_params") or {}
        if params.get("max_new_tokens", 128) == 0:
            return None
        return SamplingParams.from_request(params, self.engine.vocab_size)

    def _check_body(self, body) -> str | None:
        """The first problem with a /generate body, naming the field, or None."""
        if not isinstance(body, dict):
            return "request body must be a JSON object"
        ids = body.get("input_ids")
        if ids is None:
            if "text" in body:
                return "input_ids is required: this server does not tokenize text"
            return "input_ids is required"
        if not isinstance(ids, list) or not ids:
            return "input_ids must be a non-empty list of token ids"
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            return "input_ids must be a flat list of integers (batched requests are not supported)"
        bad = next((t for t in ids if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            top = self.engine.vocab_size - 1
            return f"input_ids holds token id {bad} outside the vocabulary (0..{top})"
        limit = self.engine.max_positions
        if limit and len(ids) > limit:
            return f"input_ids has {len(ids)} tokens, more than max_position_embeddings {limit}"
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            return "sampling_params must be an object"
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            return "rid must be a string (batched requests are not supported)"
        if params.get("max_new_tokens", 128) != 0:
            # Text generation: never dumped, so never under the extraction prefix.
            if rid is not None and is_pipeline_rid(rid, self.prefix):
                return (
                    f"rid {rid} is an extraction request id ({self.prefix}-...) but "
                    "sampling_params.max_new_tokens is not 0: extraction requests are prefill only"
                )
            try:
                sampling = SamplingParams.from_request(params, self.engine.vocab_size)
            except BadSamplingParams as exc:
                return str(exc)
            if limit and len(ids) + sampling.max_new_tokens > limit:
                return (
                    f"input_ids has {len(ids)} tokens and sampling_params.max_new_tokens is "
                    f"{sampling.max_new_tokens}: more than max_position_embeddings {limit}"
                )
        if rid is not None and is_pipeline_rid(rid, self.prefix):
            try:
                parse_rid(rid)
            except PipelineError as exc:
                return f"rid: {exc}"
        return None

    def _enqueue(
        self,
        rid: str,
        input_ids: list[int],
        ordinal: int | None = None,
        sampling: SamplingParams | None = None,
    ) -> _Request:
        item = _Request(
            rid, input_ids, asyncio.get_running_loop().create_future(), ordinal, sampling=sampling
        )
        self._in_flight.add(rid)
        if item.sampling is None:
            self._joins.hold()  # the running decode batch takes no one new (generation_joins)
            self._queue.put_nowait(item)
        elif not self.faults.empty_reply_for(rid) and not self._joins.offer(item):
            self._queue.put_nowait(item)
        return item

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        pending: list[_Request] = []
        while True:
            if not pending:
                waiting_since = time.monotonic()
                pending.append(await self._queue.get())
                if self.batch_window_s > 0:
                    await asyncio.sleep(self.batch_window_s)
                self.stats.idle_s += time.monotonic() - waiting_since
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            # Requests whose client went away are dropped before they cost a forward pass.
            pending = [r for r in pending if not r.future.done()]
            if not pending:
                self._waiting = 0
                continue
            batch, pending = select_batch(pending, self.engine.layout, self.max_batch_tokens)
            self._waiting = len(pending)  # left for a later pass (new arrivals are queued)
            if any(r.generate_ordinal and self.faults.hangs_at(r.generate_ordinal) for r in batch):
                log(f"fault hang_after:{self.faults.hang_after}: worker stalls")
                await asyncio.Event().wait()
            for item in batch:
                item.batch_size = len(batch)
            started = time.monotonic()
            try:
                await loop.run_in_executor(self._executor, self._run_batch, batch, loop)
            except Exception as exc:
                self.stats.failed += len(batch)
                error = PipelineError(
                    f"forward of batch [{', '.join(r.rid for r in batch)}] failed: "
                    f"{type(exc).__name__}: {exc}"
                )
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(error)
            self.stats.busy_s += time.monotonic() - started
            self.stats.batches += 1

    def _run_batch(self, batch: list[_Request], loop: asyncio.AbstractEventLoop) -> None:
        """Forward thread: one forward, then hand the tensors to the writer (may block on
        backpressure, which stalls only this thread); or a whole batch's text generation."""
        if batch[0].sampling is not None:
            self._run_generation(batch, loop)
            return
        lengths = [len(r.input_ids) for r in batch]
        packed = self.engine.layout == "packed"
        self.stats.padded_tokens += (
            max(sum(lengths), self.max_batch_tokens) if packed else max(lengths) * len(lengths)
        )
        aux, final, counts = self.engine.forward(
            [r.input_ids for r in batch],
            capacity=self.max_batch_tokens,
            shift_layers=self.faults.shift_layer_batched and len(batch) > 1,
            drop_last=self.faults.wrong_token_count,
        )
        by_rid = {r.rid: r for r in batch}

        def on_done(rid: str, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(self._resolve, by_rid[rid], error)

        self.writer.submit([r.rid for r in batch], counts, aux, final, on_done)

    def _run_generation(self, batch: list[_Request], loop: asyncio.AbstractEventLoop) -> None:
        """Forward thread: decode `batch`, with the generation requests that arrive meanwhile
        joining it between steps (`continuous_batching`)."""
        self.stats.generation_batches += 1

        def answered(item: _Request, error: BaseException | None) -> None:
            if error is None:
                self.stats.generated += 1
                self.stats.generated_tokens += len(item.generation.output_ids)
            loop.call_soon_threadsafe(self._resolve, item, error)

        def stall_if_faulted(items: list[_Request]) -> None:
            if any(r.generate_ordinal and self.faults.hangs_at(r.generate_ordinal) for r in items):
                log(f"fault hang_after:{self.faults.hang_after}: worker stalls")
                threading.Event().wait()

        with self.engine.generating() as generator:
            decode_continuously(
                generator,
                batch,
                self._joins,
                max_batch_tokens=self.max_batch_tokens,
                answered=answered,
                requeue=lambda item: loop.call_soon_threadsafe(self._queue.put_nowait, item),
                before_admitting=stall_if_faulted,
            )

    def _resolve(self, item: _Request, error: BaseException | None) -> None:
        if error is not None:
            self.stats.failed += 1
        else:
            self.stats.requests += 1
            self.stats.tokens += len(item.input_ids)
            self.stats.dumped += is_pipeline_rid(item.rid, self.prefix)
        if item.future.done():
            return
        if error is not None:
            item.future.set_exception(error)
        else:
            item.future.set_result(None)

    async def _progress_loop(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            stats, now = self.stats, time.monotonic()
            if stats.tokens == stats.last_tokens:
                continue
            rate = (stats.tokens - stats.last_tokens) / (now - stats.last_time)
            busy = stats.busy_s - stats.last_busy_s
            idle = stats.idle_s - stats.last_idle_s
            share = busy / (busy + idle) if busy + idle > 0 else 0.0
            stats.last_tokens, stats.last_time = stats.tokens, now
            stats.last_busy_s, stats.last_idle_s = stats.busy_s, stats.idle_s
            generated = (
                f", {stats.generated} generated ({stats.generated_tokens} new tokens)"
                if stats.generated
                else ""
            )
            log(
                f"{stats.requests} requests done ({stats.dumped} dumped, {stats.failed} failed"
                f"{generated}), {stats.tokens} tokens, {rate:.0f} tokens/s, {stats.batches} "
                f"batches, forward busy {share:.0%}, {self._queue.qsize() + self._waiting} waiting"
            )


def server_info(args, engine: ReferenceEngine, dump_dir: Path) -> dict:
    dtype = str(engine.dtype).removeprefix("torch.")
    config_hash = model_config_hash(engine.model_dir)
    return {
        "engine": ENGINE,
        "engine_version": engine_version(),
        "model_path": str(engine.model_dir),
        "aux_layer_ids": engine.aux_layer_ids,
        "layer_convention": CONVENTION,
        "final_convention": FINAL_CONVENTION,
        "hidden_size": engine.hidden_size,
        "num_layers": engine.num_layers,
        "dtype": dtype,
        "dump_dir": str(dump_dir),
        "request_prefix": args.request_prefix,
        "instance_id": args.instance_id,
        # The stored dtype of the dumps (the writer quantizes): what the client checks.
        "store": HiddenStore(args.store_aux, args.store_final).as_dict(),
        "fingerprint": hash_json(
            {
                "model_config_hash": config_hash,
                "aux_layer_ids": engine.aux_layer_ids,
                "engine": ENGINE,
                "dtype": dtype,
            }
        ),
        "device": str(engine.device),
        "max_batch_tokens": args.max_batch_tokens,
        "batch_layout": engine.layout,
        "attn_implementation": engine.model.config._attn_implementation,
    }


def parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eaglepipe.server.reference.server", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--aux-layer-ids", required=True, type=parse_layer_ids, help="e.g. 1,3,4")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dump-dir", required=True, help="this instance's handoff directory")
    parser.add_argument("--request-prefix", default="eaglepipe")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES])
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_LAYOUTS,
        help="batch layout: packed (no padding computed), padded, auto (packed on CUDA)",
    )
    parser.add_argument("--instance-id", default="")
    for which in ("aux", "final"):
        parser.add_argument(
            f"--store-{which}",
            default=BF16,
            choices=list(STORE_DTYPES),
            help=f"stored dtype of the {which} states in the dumps (extract.store.{which})",
        )
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=DEFAULT_BATCH_WINDOW_MS,
        help="how long a lone request waits for companions before its forward pass",
    )
    parser.add_argument(
        "--max-pinned-bytes",
        type=int,
        default=DEFAULT_MAX_PINNED_BYTES,
        help="bound on host memory holding batches not yet written (backpressure beyond it)",
    )
    return parser


async def serve(args) -> None:
    if args.max_batch_tokens < 1:
        raise PipelineError(f"--max-batch-tokens {args.max_batch_tokens} must be at least 1")
    faults = faults_from_env()
    check_aux_ids_against_config(args.model, args.aux_layer_ids)
    check_port_free(args.host, args.port)
    dump_dir = prepare_dump_dir(args.dump_dir)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    started = time.monotonic()
    log(f"loading {args.model} on {device} as {dtype} ...")
    engine = await asyncio.to_thread(
        ReferenceEngine,
        args.model,
        args.aux_layer_ids,
        device=device,
        dtype=dtype,
        trust_remote_code=args.trust_remote_code,
        hook_shifted_layers=faults.shift_layer_batched,
        attention=args.attention,
    )
    log(
        f"loaded in {time.monotonic() - started:.1f}s: {engine.num_layers} layers, hidden "
        f"{engine.hidden_size}, aux layers {engine.aux_layer_ids}, dumps to {dump_dir}, "
        f"{engine.layout} batches of {args.max_batch_tokens} tokens "
        f"({engine.model.config._attn_implementation} attention)"
    )
    if engine.attn_implementation == "flex_attention":
        seconds = await asyncio.to_thread(engine.warm_up, args.max_batch_tokens)
        log(f"flex_attention kernels compiled by a warm-up forward in {seconds:.1f}s")
    if faults.active:
        log(f"FAULT INJECTION ACTIVE: {faults.describe()}")
    writer = DumpWriter(
        dump_dir,
        args.request_prefix,
        aux_layer_ids=engine.aux_layer_ids,
        store=HiddenStore(args.store_aux, args.store_final),
        max_pinned_bytes=args.max_pinned_bytes,
    )
    server = ReferenceServer(
        engine,
        writer,
        prefix=args.request_prefix,
        max_batch_tokens=args.max_batch_tokens,
        info=server_info(args, engine, dump_dir),
        faults=faults,
        batch_window_s=args.batch_window_ms / 1000,
    )
    # Handlers still waiting at shutdown (a stalled worker) get 5 s, not aiohttp's 60.
    runner = web.AppRunner(server.make_app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        writer.close()
        if exc.errno == errno.EADDRINUSE:
            raise PipelineError(f"port {args.port} on {args.host} is already in use") from None
        raise PipelineError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    log(f"listening on http://{args.host}:{args.port} (instance {args.instance_id or '-'})")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log("stopping")
    await runner.cleanup()
    writer.close()
    log(f"stopped after {server.stats.requests} requests ({server.stats.dumped} dumped)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(serve(args))
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is closed and written; skip torch/transformers interpreter teardown, which
    # takes seconds and would keep a stopping server around for no reason.
    os._exit(exit_code)

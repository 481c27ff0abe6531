"""The generation client: text generation through the shared server, engine-neutral.

Both engines take SGLang's `/generate` with token ids in and token ids out:

    POST /generate {"input_ids": [...], "rid": "<prefix>.regen-<nonce>-<row>-<turn>-<attempt>",
                    "sampling_params": {"max_new_tokens": N, "temperature": T, "top_p": P,
                                        "stop_token_ids": [...], "sampling_seed": S}}
    -> {"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop", "matched": id}
                                                         | {"type": "length", ...}, ...}}

The prompt is rendered and tokenized by the caller with the target's own tokenizer, and the reply
is decoded by the caller too, so both engines see the same token ids. `sampling_seed` is sent
only when sampling (SGLang validates it and, with `--enable-deterministic-inference`, uses it).

Request ids never start with `<prefix>-`, the extraction prefix: a generation request is never
dumped, by the reference server or by the SGLang hook, even when it shares a batch with
extraction requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from ..core.errors import PipelineError, ServerLost
from ..core.shard_job import process_age_s
from ..server.handoff.request_ids import make_generation_rid
from ..server.lifecycle.watch import BACKOFF_BASE_S, BACKOFF_MAX_S, TransientError


class RowRefused(PipelineError):
    """The server refused or could not answer one row's request (a bad row, not a dead server)."""


@dataclass(frozen=True)
class GenerationSettings:
    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]
    request_prefix: str
    retries: int
    request_timeout_s: float


@dataclass(frozen=True)
class Reply:
    """The new tokens of one reply without its stop token, and why it ended."""

    output_ids: list[int]
    finish: str  # stop | length
    completion_tokens: int  # as the server counted them (the stop token included)


def sampling_params(settings: GenerationSettings, max_new_tokens: int, seed: int) -> dict:
    params = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(settings.temperature),
        "top_p": float(settings.top_p),
        "stop_token_ids": list(settings.stop_token_ids),
    }
    if settings.temperature > 0:
        params["sampling_seed"] = int(seed)
    return params


def parse_reply(body: dict, stop_token_ids: Sequence[int], where: str) -> Reply:
    """A /generate answer as a Reply; raises RowRefused when it holds no usable output."""
    output = body.get("output_ids") if isinstance(body, dict) else None
    if not isinstance(output, list) or not all(isinstance(t, int) for t in output):
        raise RowRefused(f"{where}: the server's answer has no output_ids list")
    meta = body.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in ("stop", "length"):
        message = reason.get("message") if isinstance(reason, dict) else None
        raise RowRefused(f"{where}: generation ended with {kind or reason!r}: {message or ''}")
    ids = list(output)
    if kind == "stop" and ids and ids[-1] in set(stop_token_ids):
        ids = ids[:-1]  # SGLang keeps the matched stop token in output_ids
    completion = meta.get("completion_tokens")
    return Reply(ids, kind, int(completion) if isinstance(completion, int) else len(output))


class GenerationClient:
    """Generation requests to one server, retried on transient failures, failing fast when the
    server dies (the caller runs `client.client.watch_server` beside it)."""

    def __init__(
        self,
        url: str,
        settings: GenerationSettings,
        nonce: str,
        is_alive: Callable[[], bool] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.url = url.rstrip("/")
        self.settings = settings
        self.nonce = nonce
        self.is_alive = is_alive
        self.log = log or (lambda line: None)
        self.requests_sent = 0
        self.retries = 0
        # Seconds from the process's start to its first request (core.shard_job.process_age_s).
        self.first_request_s: float | None = None

    async def generate(
        self,
        session: aiohttp.ClientSession,
        row_id: int,
        turn: int,
        input_ids: Sequence[int],
        max_new_tokens: int,
        seed: int,
    ) -> Reply:
        s = self.settings
        where = f"row {row_id} turn {turn}"
        last_error = ""
        for attempt in range(s.retries + 1):
            rid = make_generation_rid(s.request_prefix, self.nonce, row_id, turn, attempt)
            try:
                return await self._once(session, rid, where, input_ids, max_new_tokens, seed)
            except TransientError as exc:
                last_error = str(exc)
                if self.is_alive is not None and not await asyncio.to_thread(self.is_alive):
                    raise ServerLost(f"the server at {self.url} died during regeneration") from None
                if attempt == s.retries:
                    break
                self.retries += 1
                delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt)
                self.log(f"{where}: {last_error}; retry {attempt + 1} in {delay:.2f}s")
                await asyncio.sleep(delay)
        if self.is_alive is not None:
            await asyncio.to_thread(self.is_alive)  # name a dead server rather than the row
        raise RowRefused(f"{where} failed after {s.retries + 1} attempt(s): {last_error}")

    async def _once(self, session, rid, where, input_ids, max_new_tokens, seed) -> Reply:
        payload = {
            "input_ids": [int(t) for t in input_ids],
            "rid": rid,
            "sampling_params": sampling_params(self.settings, max_new_tokens, seed),
        }
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s)
        if not self.requests_sent:
            self.first_request_s = process_age_s()
        self.requests_sent += 1
        try:
            async with session.post(f"{self.url}/generate", json=payload, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    raise TransientError(f"server answered {resp.status}: {text[:200]}")
                if resp.status != 200:
                    raise RowRefused(
                        f"{where}: server refused request {rid} with {resp.status}: {text[:300]}"
                    )
                try:
                    body = await resp.json(content_type=None)
                except ValueError:
                    raise RowRefused(f"{where}: the server's answer is not JSON") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransientError(f"request {rid} failed: {type(exc).__name__} {exc}") from exc
        return parse_reply(body, self.settings.stop_token_ids, where)

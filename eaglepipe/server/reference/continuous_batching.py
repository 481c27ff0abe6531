"""Continuous batching for the reference server's text generation.

The server's forward thread runs one `generate.DecodeSession` at a time. While it runs, the
event loop hands new generation requests to this queue instead of the server's request queue,
and the forward thread admits them between decode steps, as many as the decode budget allows.
A prefill (hidden-state capture) request that arrives meanwhile holds the queue: the running
batch takes no one new, finishes, and the requests queued in order behind the prefill run after
it, so capture requests never wait on an endless stream of generation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ...core.errors import PipelineError
from .generate import BatchGenerator, DecodeSession

# A decode batch may hold the keys and values of this many prefill batches (max_batch_tokens):
# decoding one token per request costs far less than prefilling as many tokens.
DECODE_BUDGET_FACTOR = 8


class JoinQueue:
    """Thread-safe: `offer` and `hold` from the event loop, the rest from the forward thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list | None = None  # None: no decode batch takes joins now
        self._held = False

    def open(self) -> None:
        with self._lock:
            self._items, self._held = [], False

    def offer(self, item) -> bool:
        """Queue `item` for the running decode batch; False when none takes joins."""
        with self._lock:
            if self._items is None or self._held:
                return False
            self._items.append(item)
            return True

    def hold(self) -> None:
        """A prefill request is waiting: the running batch admits no one new."""
        with self._lock:
            if self._items is not None:
                self._held = True

    def take(self, fits: Callable[[object, int], bool]) -> list:
        """The waiting requests, oldest first, while `fits(request, how_many_taken)`."""
        with self._lock:
            if not self._items or self._held:
                return []
            taken = 0
            while taken < len(self._items) and fits(self._items[taken], taken):
                taken += 1
            chosen, self._items = self._items[:taken], self._items[taken:]
            return chosen

    def close(self) -> list:
        """No more joins; the requests still waiting (for the server's own queue)."""
        with self._lock:
            left, self._items = self._items or [], None
            return left


def decode_continuously(
    generator: BatchGenerator,
    batch: list,
    joins: JoinQueue,
    *,
    max_batch_tokens: int,
    answered: Callable[[object, BaseException | None], None],
    requeue: Callable[[object], None],
    before_admitting: Callable[[list], None],
) -> None:
    """Decode `batch` (requests with `input_ids`, `sampling`, `future`, `generate_ordinal`) and
    whatever joins it, until none is left. Each request gets `generation` and is `answered`
    when it ends; a failed step answers every request still decoding with the error, then
    raises. A joining request is admitted while the batch's keys, padding included, stay
    within DECODE_BUDGET_FACTOR x `max_batch_tokens`; requests still waiting when the batch
    ends are `requeue`d."""
    decoding: dict[int, object] = {}
    session = DecodeSession(generator)
    budget = DECODE_BUDGET_FACTOR * max_batch_tokens

    def admit(items: list) -> None:
        items = [r for r in items if not r.future.done()]  # their clients went away
        before_admitting(items)
        sequences = []
        for item in items:
            index = id(item)
            decoding[index] = item
            sequences.append(generator.sequence(index, item.input_ids, item.sampling))
        session.admit(sequences)
        for item in items:
            item.batch_size = len(session.active)

    def fits(item, already: int) -> bool:
        rows = len(session.active) + already + 1
        return rows * max(session.width, len(item.input_ids)) <= budget

    joins.open()
    try:
        admit(batch)
        while session.active:
            for seq in session.step():
                item = decoding.pop(seq.index)
                item.generation = seq.result
                answered(item, None)
            admit(joins.take(fits))
    except Exception as exc:
        error = PipelineError(
            f"generation of [{', '.join(r.rid for r in decoding.values())}] failed: "
            f"{type(exc).__name__}: {exc}"
        )
        for item in decoding.values():
            answered(item, error)
        raise
    finally:
        for item in joins.close():
            requeue(item)

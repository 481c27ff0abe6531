"""Prepare's work on each row, spread over worker processes: tokenize, mask, count what is lost.

`prepared_rows(rows, ...)` yields one `PreparedRow` per source row, in row-id order. With more
than one worker, rows go to a pool of forked processes in batches, each process loading the
target's tokenizer once; at most a few batches per worker are in flight, so memory does not
grow with the file however fast it is read.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from ..data.chat_mask import tokenize_conversation
from ..data.dataset import ASSISTANT_TRUNCATED, BadRow, Conversation, RowProblem
from ..data.loss_counts import Lost, assistant_texts, count_assistant_tokens

BATCH_ROWS = 32
BATCHES_IN_FLIGHT_PER_WORKER = 4


@dataclass(frozen=True)
class PreparedRow:
    row_id: int
    bad: BadRow | None  # None: kept (its messages dropped, to keep the result small)
    input_ids: np.ndarray | None = None  # int32
    loss_mask: np.ndarray | None = None  # uint8
    truncated: bool = False
    length_limited_turns: tuple[int, ...] = ()
    # What this row lost, per reason: the whole row (a bad row), or turns dropped from it.
    lost: tuple[tuple[str, Lost], ...] = ()


def _lost_of(tokenizer, messages, cap: int, rows: int, count_tokens: bool = True) -> Lost:
    texts = assistant_texts(messages)
    return Lost(
        rows=rows,
        turns=len(messages),
        assistant_turns=len(texts),
        assistant_tokens=count_assistant_tokens(tokenizer, texts, cap) if count_tokens else 0,
    )


def prepare_row(tokenizer, row: Conversation | BadRow, max_length: int) -> PreparedRow:
    """One row's tokens and mask, or why it is a bad row, and what it lost per reason."""
    if isinstance(row, Conversation):
        try:
            tokenized = tokenize_conversation(tokenizer, row.messages, max_length)
        except RowProblem as problem:
            every = list(row.messages) + [m for d in row.dropped for m in d.messages]
            row = BadRow(row.row_id, problem.reason, problem.detail, row.line, tuple(every))
        else:
            lost = tuple(
                (d.reason, _lost_of(tokenizer, d.messages, max_length, rows=0)) for d in row.dropped
            )
            return PreparedRow(
                row.row_id,
                None,
                np.asarray(tokenized.input_ids, dtype=np.int32),
                np.asarray(tokenized.loss_mask, dtype=np.uint8),
                tokenized.truncated,
                row.length_limited_turns,
                lost,
            )
    # A row whose assistant tokens lie beyond max_length loses no position within it.
    lost = _lost_of(
        tokenizer, row.messages, max_length, rows=1, count_tokens=row.reason != ASSISTANT_TRUNCATED
    )
    return PreparedRow(row.row_id, replace(row, messages=()), lost=((row.reason, lost),))


# --- the worker pool --------------------------------------------------------------------------

_WORKER: dict = {}


def _start_worker(load_tokenizer: Callable, max_length: int) -> None:
    # One thread per process: the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["tokenizer"] = load_tokenizer()
    _WORKER["max_length"] = max_length


def _prepare_batch(batch: list) -> list[PreparedRow]:
    tokenizer, max_length = _WORKER["tokenizer"], _WORKER["max_length"]
    return [prepare_row(tokenizer, row, max_length) for row in batch]


def _batches(rows: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepared_rows(
    rows: Iterable[Conversation | BadRow],
    load_tokenizer: Callable,
    max_length: int,
    workers: int = 1,
) -> Iterator[PreparedRow]:
    """`prepare_row` of every row, in order; `load_tokenizer()` gives each process its tokenizer."""
    if workers <= 1:
        tokenizer = load_tokenizer()
        for row in rows:
            yield prepare_row(tokenizer, row, max_length)
        return
    # fork: the workers start in a moment and inherit the loaded library; nothing they share is
    # written after the start.
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, _start_worker, (load_tokenizer, max_length)) as pool:
        pending: deque = deque()
        limit = workers * BATCHES_IN_FLIGHT_PER_WORKER
        for batch in _batches(rows, BATCH_ROWS):
            pending.append(pool.apply_async(_prepare_batch, (batch,)))
            if len(pending) >= limit:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()

"""Which waiting requests share the reference server's next forward pass.

Requests need `input_ids`, `sampling` (None for a prefill) and `started` (arrival time)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Request = TypeVar("Request")


def select_batch(
    pending: Sequence[Request], layout: str, max_batch_tokens: int
) -> tuple[list[Request], list[Request]]:
    """The requests of the next forward pass, and the rest (which wait for the next one).

    Prefill and text generation never share a batch: the oldest request decides which kind
    runs next, and the requests of the other kind wait in order."""
    generating = pending[0].sampling is not None
    same = [r for r in pending if (r.sampling is not None) == generating]
    other = [r for r in pending if (r.sampling is not None) != generating]
    if layout == "packed" and not generating:
        batch, rest = select_packed(same, max_batch_tokens)
    else:
        batch, rest = select_padded(same, max_batch_tokens)
    return batch, sorted(rest + other, key=lambda r: r.started)


def select_packed(
    pending: Sequence[Request], max_batch_tokens: int
) -> tuple[list[Request], list[Request]]:
    """Oldest first, each request that still fits the row's token budget (first fit)."""
    batch, rest, used = [], [], 0
    for item in pending:
        if not batch or used + len(item.input_ids) <= max_batch_tokens:
            batch.append(item)
            used += len(item.input_ids)
        else:
            rest.append(item)
    return batch, rest


def select_padded(
    pending: Sequence[Request], max_batch_tokens: int
) -> tuple[list[Request], list[Request]]:
    """The oldest request plus the waiting ones closest to it in length, within the budget of
    padded tokens."""
    oldest, others = pending[0], list(pending[1:])
    others.sort(key=lambda r: (abs(len(r.input_ids) - len(oldest.input_ids)), r.started))
    batch, longest = [oldest], len(oldest.input_ids)
    rest = []
    for item in others:
        padded = max(longest, len(item.input_ids)) * (len(batch) + 1)
        if padded <= max_batch_tokens:
            batch.append(item)
            longest = max(longest, len(item.input_ids))
        else:
            rest.append(item)
    rest.sort(key=lambda r: r.started)
    return batch, rest

"""What a dataset loses before training, counted per reason, and the limit on it.

Per reason (a bad row's, or a dropped run of turns'): `rows` dropped whole, `turns` dropped
(every message of a dropped row, or the run's), `assistant_turns` among them, and
`assistant_tokens`: the assistant-token positions lost, counted by the target's tokenizer on
the dropped replies' text (each reply's tokens, at most `max_length` per row: the most a row
could have trained on). A row whose assistant tokens all lie beyond `max_length` loses none
within it, and truncation is reported apart (`truncated_rows`).

`dataset.unusable_limit` stops the run when more than a fraction of the source rows, or of the
assistant tokens (kept plus lost), is unusable; its message names the top reasons with counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..core.errors import PipelineError

FIELDS = ("rows", "turns", "assistant_turns", "assistant_tokens")
_TOP_REASONS = 3
# More characters than any tokenizer puts in one token of text, bar pathological ones.
_CHARS_PER_TOKEN = 8


@dataclass(frozen=True)
class Lost:
    rows: int = 0
    turns: int = 0
    assistant_turns: int = 0
    assistant_tokens: int = 0


class LossCounts:
    """Running totals per reason."""

    def __init__(self) -> None:
        self.by_reason: dict[str, dict[str, int]] = {}

    def add(self, reason: str, lost: Lost) -> None:
        counts = self.by_reason.setdefault(reason, dict.fromkeys(FIELDS, 0))
        for name in FIELDS:
            counts[name] += getattr(lost, name)

    def total(self, name: str) -> int:
        return sum(counts[name] for counts in self.by_reason.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {reason: dict(self.by_reason[reason]) for reason in sorted(self.by_reason)}

    def top(self, name: str, n: int = _TOP_REASONS) -> str:
        """`reason: count, ...` of the `n` reasons that lose the most `name`."""
        ranked = sorted(
            ((c[name], reason) for reason, c in self.by_reason.items() if c[name]),
            key=lambda item: (-item[0], item[1]),
        )
        return ", ".join(f"{reason}: {count:,}" for count, reason in ranked[:n])


def assistant_texts(messages) -> list[str]:
    return [m["content"] for m in messages if m.get("role") == "assistant"]


def count_assistant_tokens(tokenizer, texts: list[str], cap: int) -> int:
    """Tokens the target's tokenizer gives the replies' text, at most `cap` (one row's room).

    A reply far longer than the room left is counted on a prefix of `_CHARS_PER_TOKEN` times
    that room: once the prefix alone fills it, the rest cannot matter."""
    from .chat_mask import encode_text

    total = 0
    for text in texts:
        room = cap - total
        if room <= 0:
            break
        if not text:
            continue
        total += len(encode_text(tokenizer, text[: room * _CHARS_PER_TOKEN])[0])
    return min(total, cap)


def _fraction(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "0%"


def check_unusable_rows(
    path: str | os.PathLike, total_rows: int, reasons: dict[str, int], limit
) -> None:
    """Stop when the rows unusable as a whole exceed `limit.rows` of the source rows."""
    bad = sum(reasons.values())
    if total_rows and bad / total_rows > limit.rows:
        counts = LossCounts()
        for reason, n in reasons.items():
            counts.add(reason, Lost(rows=n))
        raise PipelineError(
            f"dataset.path {path}: {bad:,} of {total_rows:,} rows ({_fraction(bad, total_rows)}) "
            f"are unusable, more than dataset.unusable_limit.rows={limit.rows}; most: "
            f"{counts.top('rows')} (check dataset.format and dataset.turn_order, or raise the "
            "limit)"
        )


def check_unusable_tokens(
    path: str | os.PathLike, kept_assistant_tokens: int, counts: LossCounts, limit
) -> None:
    """Stop when the assistant tokens lost exceed `limit.assistant_tokens` of kept plus lost."""
    lost = counts.total("assistant_tokens")
    whole = kept_assistant_tokens + lost
    if whole and lost / whole > limit.assistant_tokens:
        raise PipelineError(
            f"dataset.path {path}: {lost:,} of {whole:,} assistant tokens "
            f"({_fraction(lost, whole)}) are lost, more than "
            f"dataset.unusable_limit.assistant_tokens={limit.assistant_tokens}; most: "
            f"{counts.top('assistant_tokens')} (check dataset.format and dataset.turn_order, or "
            "raise the limit)"
        )

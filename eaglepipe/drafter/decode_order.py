"""Acceptance length in decode order: what a speculative decoder gets on a held-out reply.

A decoder does not start a draft chain at every position. It walks each assistant turn: the
prefill gives the reply's first token; then each verification round drafts a chain of up to
`steps` tokens (top-k 1), accepts the leading ones that equal the target's greedy tokens, and
adds the target's own next token (the bonus). So a round advances by accepted + 1, hard
stretches cost a round per token and easy stretches go by in a few rounds. The figure SGLang
reports is completion tokens / verification rounds (the prefill's token counted, not its
round); this module computes exactly that from the teacher-forced chains.

Positions (the training alignment of loss.py): a turn is a run of loss-masked tokens s..e (e is
its end-of-turn token). `lead[t]` is the number of leading right steps of the chain at base t,
whose step i consumes x[t+1+i] and predicts x[t+2+i]. After the decoder has emitted x[p], the
next round is the chain at base p-1; it may accept at most e-p drafts (nothing past the end of
the turn is decoded).

Headline: pooled over turns weighted by tokens (total completion tokens / total rounds), as a
server's accept length pools its requests and as throughput follows it; the mean of per-turn
figures is reported beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The chain settings the field publishes (steps; draft tokens = steps + 1; top-k 1).
PUBLISHED_STEPS = (3, 7)


def assistant_turns(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """(first, last) position of each run of loss-masked tokens: one per assistant turn."""
    turns: list[tuple[int, int]] = []
    start = None
    for position, masked in enumerate(loss_mask):
        if masked and start is None:
            start = position
        elif not masked and start is not None:
            turns.append((start, position - 1))
            start = None
    if start is not None:
        turns.append((start, len(loss_mask) - 1))
    return turns


def walk_turn(lead: Sequence[int], first: int, last: int, steps: int) -> int:
    """Verification rounds a decoder needs for the turn first..last, chains of `steps` drafts."""
    if first < 1:
        raise ValueError("a turn needs a prompt before it (its first token comes from prefill)")
    emitted, rounds = first, 0
    while emitted < last:
        accepted = min(int(lead[emitted - 1]), steps, last - emitted)
        emitted = min(emitted + accepted + 1, last)
        rounds += 1
    return rounds


@dataclass(frozen=True)
class TurnResult:
    row_id: int
    turn: int  # its ordinal among the row's assistant turns
    first: int  # token position of its first token
    tokens: int  # completion tokens (its first token, from prefill, included)
    rounds: dict[int, int]  # verification rounds per chain length (steps)
    length_limited: bool  # a regenerated reply that hit max_new_tokens

    def record(self) -> dict:
        return {
            "row_id": self.row_id,
            "turn": self.turn,
            "first_position": self.first,
            "tokens": self.tokens,
            "rounds": {str(k): v for k, v in self.rounds.items()},
            "length_limited": self.length_limited,
        }


def walk_row(
    row_id: int,
    lead: Sequence[int],
    loss_mask: Sequence[int],
    steps: Iterable[int],
    length_limited_turns: Iterable[int] = (),
) -> list[TurnResult]:
    """Every assistant turn of one row walked in decode order at each chain length."""
    limited = set(length_limited_turns)
    results = []
    for ordinal, (first, last) in enumerate(assistant_turns(loss_mask)):
        if first < 1:
            continue  # no prompt before it: nothing a decoder is asked to continue
        rounds = {k: walk_turn(lead, first, last, k) for k in steps}
        results.append(
            TurnResult(row_id, ordinal, first, last - first + 1, rounds, ordinal in limited)
        )
    return results


def acceptance(turns: Sequence[TurnResult], steps: int) -> dict:
    """Pooled (tokens / rounds, the headline) and per-turn mean acceptance at `steps`."""
    tokens = sum(t.tokens for t in turns)
    rounds = sum(t.rounds[steps] for t in turns)
    per_turn = [t.tokens / t.rounds[steps] for t in turns if t.rounds[steps]]
    return {
        "turns": len(turns),
        "tokens": tokens,
        "rounds": rounds,
        "acceptance_length": tokens / rounds if rounds else None,
        "per_turn_mean": sum(per_turn) / len(per_turn) if per_turn else None,
    }


def summarize(turns: Sequence[TurnResult], steps_list: Sequence[int]) -> dict:
    """Per chain length: all turns, and without the length-limited ones (reported apart so a
    few repetition loops cannot carry the headline)."""
    limited = [t for t in turns if t.length_limited]
    complete = [t for t in turns if not t.length_limited]
    return {
        str(k): {
            "all_turns": acceptance(turns, k),
            "without_length_limited": acceptance(complete, k),
            "length_limited_only": acceptance(limited, k),
        }
        for k in steps_list
    }

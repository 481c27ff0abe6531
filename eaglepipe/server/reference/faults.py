"""Test-only fault switch for the reference server, read from the EAGLEPIPE_FAULT variable.

The validation and lifecycle tests need a server that is wrong or broken in known ways. The
variable holds a comma-separated list of modes (unset or empty: no fault):

- `shift_layer_batched`: in a forward batch of more than one request, capture the aux layers
  of id + 1 (clamped to the last layer) instead of the configured ids. Requests served alone
  stay correct, the classic bug that only batching exposes.
- `wrong_token_count`: dump one token fewer than the request had (requests of 2+ tokens);
  the response still reports the true `prompt_tokens`.
- `die_after:N`: the process exits at once (`os._exit(DIE_EXIT_CODE)`) when the (N+1)-th
  `/generate` request arrives, answering neither it nor anything in flight.
- `hang`: like `hang_after:0`.
- `hang_after:N`: `/generate` requests after the first N are never answered and the batching
  worker stalls (so `/health_generate` stalls too); `/health` keeps answering, like a wedged
  GPU process whose HTTP thread is alive.
- `empty_reply:ROW`: text generation requests for source row ROW (read from the generation
  request id, `eaglepipe.server.handoff.request_ids`) answer at once with nothing but a stop
  token: a reply the target "could not give", for the tests of the bad-row policy of regeneration.

Example: `EAGLEPIPE_FAULT=shift_layer_batched,die_after:100`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ...core.errors import PipelineError

ENV_VAR = "EAGLEPIPE_FAULT"
DIE_EXIT_CODE = 17


@dataclass(frozen=True)
class Faults:
    shift_layer_batched: bool = False
    wrong_token_count: bool = False
    die_after: int | None = None
    hang_after: int | None = None
    empty_reply_rows: frozenset[int] = frozenset()

    @property
    def active(self) -> bool:
        return self != Faults()

    def describe(self) -> str:
        parts = []
        if self.shift_layer_batched:
            parts.append("shift_layer_batched")
        if self.wrong_token_count:
            parts.append("wrong_token_count")
        if self.die_after is not None:
            parts.append(f"die_after:{self.die_after}")
        if self.hang_after is not None:
            parts.append(f"hang_after:{self.hang_after}")
        parts += [f"empty_reply:{row}" for row in sorted(self.empty_reply_rows)]
        return ",".join(parts) or "none"

    def dies_at(self, generate_ordinal: int) -> bool:
        """Whether the generate request numbered `generate_ordinal` (1-based) kills the server."""
        return self.die_after is not None and generate_ordinal > self.die_after

    def hangs_at(self, generate_ordinal: int) -> bool:
        return self.hang_after is not None and generate_ordinal > self.hang_after

    def empty_reply_for(self, rid: str) -> bool:
        """Whether a text generation request gets the empty reply of the empty_reply fault."""
        if not self.empty_reply_rows:
            return False
        from ..handoff.request_ids import parse_generation_rid

        parsed = parse_generation_rid(rid)
        return parsed is not None and parsed[2] in self.empty_reply_rows


def _count(mode: str, value: str) -> int:
    if not value.isdigit():
        raise PipelineError(f"{ENV_VAR}: {mode} needs a non-negative count, e.g. {mode}:10")
    return int(value)


def parse_faults(text: str | None) -> Faults:
    fields: dict = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        mode, _, value = item.partition(":")
        if mode in ("shift_layer_batched", "wrong_token_count") and not value:
            fields[mode] = True
        elif mode == "die_after":
            fields["die_after"] = _count(mode, value)
        elif mode == "hang" and not value:
            fields["hang_after"] = 0
        elif mode == "hang_after":
            fields["hang_after"] = _count(mode, value)
        elif mode == "empty_reply":
            fields["empty_reply_rows"] = fields.get("empty_reply_rows", frozenset()) | {
                _count(mode, value)
            }
        else:
            raise PipelineError(
                f"{ENV_VAR}: unknown fault {item!r}; modes: shift_layer_batched, "
                "wrong_token_count, die_after:N, hang, hang_after:N, empty_reply:ROW"
            )
    return Faults(**fields)


def faults_from_env(environ: Mapping[str, str] = os.environ) -> Faults:
    return parse_faults(environ.get(ENV_VAR))

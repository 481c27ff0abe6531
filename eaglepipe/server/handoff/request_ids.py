"""Request ids: the one place their formats are made and read.

- Extraction (prefill) requests: `<prefix>-<nonce>-<row id>-<attempt>`. The server dumps the
  hidden states of every request whose id starts with `<prefix>-`; a fresh nonce per client
  process means a retry, a re-extraction and a request left queued by a dead client never share
  a dump name, and dumps of another nonce are stale by definition.
- Generation requests (regeneration): `<prefix>.regen-<nonce>-<row>-<turn>-<attempt>`. Never
  `<prefix>-...`, so neither the reference server nor the SGLang hook dumps one.

Kept apart from the clients so the server's fault injection and the hook can read them without
importing a client.
"""

from __future__ import annotations

import re
import secrets

from ...core.errors import PipelineError

NONCE_HEX_CHARS = 12

_RID_RE = re.compile(r"^([A-Za-z][A-Za-z0-9]*)-([0-9a-f]{12})-([0-9]+)-([0-9]+)$")
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")
_GENERATION_RID_RE = re.compile(r"^([A-Za-z][A-Za-z0-9]*)\.regen-([0-9a-f]{12})-(\d+)-(\d+)-(\d+)$")


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX_CHARS // 2)


def make_rid(prefix: str, nonce: str, row_id: int, attempt: int) -> str:
    """`<prefix>-<nonce>-<row_id>-<attempt>`; every part is checked so `parse_rid` inverts it."""
    if not _PREFIX_RE.match(prefix):
        raise PipelineError(f"request prefix {prefix!r} must be a letter, then letters/digits")
    if not re.fullmatch(r"[0-9a-f]{12}", nonce):
        raise PipelineError(f"request nonce {nonce!r} must be {NONCE_HEX_CHARS} lowercase hex")
    if row_id < 0 or attempt < 0:
        raise PipelineError(f"row id {row_id} and attempt {attempt} must be non-negative")
    return f"{prefix}-{nonce}-{int(row_id)}-{int(attempt)}"


def parse_rid(rid: str) -> tuple[str, str, int, int]:
    """Split a pipeline request id into (prefix, nonce, row_id, attempt)."""
    match = _RID_RE.match(rid) if isinstance(rid, str) else None
    if match is None:
        raise PipelineError(f"request id {rid!r} is not <prefix>-<12 hex nonce>-<row id>-<attempt>")
    prefix, nonce, row_id, attempt = match.groups()
    return prefix, nonce, int(row_id), int(attempt)


def is_pipeline_rid(rid: str, prefix: str) -> bool:
    """Whether `rid` is one the pipeline asked for (so is dumped): it starts with `<prefix>-`."""
    return isinstance(rid, str) and rid.startswith(f"{prefix}-")


def make_generation_rid(prefix: str, nonce: str, row_id: int, turn: int, attempt: int) -> str:
    """`<prefix>.regen-<nonce>-<row>-<turn>-<attempt>`: never `<prefix>-...`, so never dumped."""
    rid = f"{prefix}.regen-{nonce}-{int(row_id)}-{int(turn)}-{int(attempt)}"
    if not _GENERATION_RID_RE.match(rid):
        raise PipelineError(f"cannot make a generation request id from {prefix!r}, {nonce!r}")
    return rid


def parse_generation_rid(rid: str) -> tuple[str, str, int, int, int] | None:
    """(prefix, nonce, row id, turn, attempt) of a generation request id, else None."""
    match = _GENERATION_RID_RE.match(rid) if isinstance(rid, str) else None
    if match is None:
        return None
    prefix, nonce, row_id, turn, attempt = match.groups()
    return prefix, nonce, int(row_id), int(turn), int(attempt)

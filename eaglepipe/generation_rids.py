"""Request ids of generation requests: `<prefix>.regen-<nonce>-<row>-<turn>-<attempt>`.

Never `<prefix>-...`, the extraction prefix, so neither the reference server nor the SGLang hook
dumps a generation request. Kept apart from the client so the server's fault injection can read
them without importing the client.
"""

from __future__ import annotations

import re

from .errors import PipelineError

_RID_RE = re.compile(r"^([A-Za-z][A-Za-z0-9]*)\.regen-([0-9a-f]{12})-(\d+)-(\d+)-(\d+)$")


def make_generation_rid(prefix: str, nonce: str, row_id: int, turn: int, attempt: int) -> str:
    """`<prefix>.regen-<nonce>-<row>-<turn>-<attempt>`: never `<prefix>-...`, so never dumped."""
    rid = f"{prefix}.regen-{nonce}-{int(row_id)}-{int(turn)}-{int(attempt)}"
    if not _RID_RE.match(rid):
        raise PipelineError(f"cannot make a generation request id from {prefix!r}, {nonce!r}")
    return rid


def parse_generation_rid(rid: str) -> tuple[str, str, int, int, int] | None:
    """(prefix, nonce, row id, turn, attempt) of a generation request id, else None."""
    match = _RID_RE.match(rid) if isinstance(rid, str) else None
    if match is None:
        return None
    prefix, nonce, row_id, turn, attempt = match.groups()
    return prefix, nonce, int(row_id), int(turn), int(attempt)

"""Reading the pipeline's JSON files (manifests, reports, summaries) with one clear error each."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import PipelineError


def read_json_object(
    path: str | os.PathLike, *, what: str = "", missing: str = "does not exist"
) -> dict:
    """The JSON object in `path`. Errors read `<what> <path> <missing>`, `... is not valid JSON:
    ...` or `... must hold a JSON object` (`what` names the kind of file, e.g. "shard manifest";
    `missing` can say what to run to make it)."""
    return read_json_object_bytes(path, what=what, missing=missing)[0]


def read_json_object_bytes(
    path: str | os.PathLike, *, what: str = "", missing: str = "does not exist"
) -> tuple[dict, bytes]:
    """`read_json_object`, plus the bytes it was parsed from (to hash exactly what was read)."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except FileNotFoundError:
        raise PipelineError(f"{name} {missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PipelineError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PipelineError(f"{name} must hold a JSON object")
    return data, raw

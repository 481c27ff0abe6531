"""Reading a shard's manifest, the JSON file written last that makes a shard done: one reader
for every per-shard stage (hidden states, regenerated rows), each stage naming its manifest's
shape beside the code that writes it (`extract/shard_files.py`, `regenerate/store.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import PipelineError
from .fingerprint import hash_bytes
from .jsonio import read_json_object_bytes

MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class ManifestShape:
    """What a stage's manifest must hold."""

    what: str  # the kind of file, for messages ("shard manifest")
    keys: tuple[str, ...]
    missing: str  # what a missing manifest means, and what makes it
    format_version: int | None = None
    # A list of entries (a hidden-state shard's chunks), and the keys each entry must hold.
    entries: str | None = None
    entry_keys: tuple[str, ...] = ()


def read_manifest(
    path: str | os.PathLike, shape: ManifestShape, *, shard: str | None = None
) -> tuple[dict, str]:
    """The manifest at `path` (the file, or the shard directory holding it) with its shape
    checked, and the xxh3-128 of the very bytes parsed (a report that records the hash then
    describes exactly the manifest it checked, even if the file is replaced meanwhile).
    With `shard`, a manifest describing another shard is refused too."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    manifest, raw = read_json_object_bytes(path, what=shape.what, missing=shape.missing)
    name = f"{shape.what} {path}"
    absent = [key for key in shape.keys if key not in manifest]
    if absent:
        raise PipelineError(f"{name} lacks key(s) {', '.join(absent)}")
    if shape.format_version is not None and manifest["format_version"] != shape.format_version:
        raise PipelineError(
            f"{name} has format_version {manifest['format_version']}, "
            f"this eaglepipe reads {shape.format_version}"
        )
    if shape.entries is not None:
        entries = manifest[shape.entries]
        if not isinstance(entries, list):
            raise PipelineError(f"{name}: {shape.entries} must be a list")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise PipelineError(f"{name}: {shape.entries}[{i}] must be a JSON object")
            absent = [key for key in shape.entry_keys if key not in entry]
            if absent:
                raise PipelineError(
                    f"{name}: {shape.entries}[{i}] lacks key(s) {', '.join(absent)}"
                )
    if shard is not None and manifest.get("shard") != shard:
        raise PipelineError(f"{name} describes shard {manifest.get('shard')!r}, not {shard}")
    return manifest, hash_bytes(raw)

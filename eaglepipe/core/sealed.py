"""Safetensors files that carry their own checksum, so `eaglepipe verify` can check one alone.

The drafter's files (vocabulary, trained model, each engine's export) have no manifest beside
them. Instead each records, in its own metadata, the xxh3-128 of its data section (every byte
after the JSON header) under `SEAL_KEY`; an export also records its `config.json`'s checksum
under `CONFIG_SEAL_KEY`. Loaders ignore metadata they do not know (safetensors, SGLang and
vLLM alike), so a sealed file loads wherever a plain one does.

    atomic_write_bytes(path, seal(save(tensors, metadata=seal_metadata(meta))))
    seal_problem(path)  # None, or why the file does not match its seal
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

SEAL_KEY = "eaglepipe_data_xxh3_128"
CONFIG_SEAL_KEY = "eaglepipe_config_xxh3_128"
# Stands in for the checksum until the data is serialized; the same length as a checksum, so
# the header keeps its length, and the data section its offset.
_PLACEHOLDER = "0" * 31 + "x"
_BLOCK = 8 << 20


def seal_metadata(metadata: dict | None = None) -> dict:
    """`metadata` with room for the seal: pass it to safetensors' `save`, then `seal` the bytes."""
    return {**(metadata or {}), SEAL_KEY: _PLACEHOLDER}


def seal(data: bytes) -> bytes:
    """Serialized safetensors bytes (saved with `seal_metadata`), the data checksum filled in.

    The metadata is also put in key order: safetensors writes it in hash-map order, so the same
    tensors and metadata would otherwise not always give the same bytes."""
    end = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:end])
    metadata = header.get("__metadata__") or {}
    if metadata.get(SEAL_KEY) != _PLACEHOLDER:
        raise ValueError("seal() needs bytes saved with seal_metadata()")
    metadata[SEAL_KEY] = xxhash.xxh3_128_hexdigest(memoryview(data)[end:])
    header["__metadata__"] = dict(sorted(metadata.items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > end - 8:  # never: the same content, compact, as safetensors writes it
        raise ValueError("the sealed safetensors header does not fit in the original's room")
    # Padded with spaces to the original length, as safetensors pads: the data stays in place.
    return data[:8] + text + b" " * (end - 8 - len(text)) + data[end:]


def read_metadata(path: str | os.PathLike) -> dict:
    """The string metadata of a safetensors file (its header only); ValueError if unreadable."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= 100 << 20:
            raise ValueError(f"header length {size} is not plausible")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header.get("__metadata__") or {}


def data_digest(path: str | os.PathLike) -> str:
    """xxh3-128 of the data section (what `seal` records), streamed."""
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as f:
        f.seek(8 + int.from_bytes(f.read(8), "little"))
        while block := f.read(_BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


def seal_problem(path: str | os.PathLike) -> str | None:
    """Why `path` does not match the checksum it records, or None when it does.

    A file without a seal (written before files were sealed) has nothing to be checked against:
    None as well, once its header reads (`is_sealed` tells the two apart)."""
    path = Path(path)
    try:
        metadata = read_metadata(path)
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{path} is not a readable safetensors file ({exc})"
    recorded = metadata.get(SEAL_KEY)
    if recorded is None:
        return None
    actual = data_digest(path)
    if actual != recorded:
        return f"{path} re-hashes to xxh3-128 {actual}, its header records {recorded}"
    return None


def config_seal_problem(weights: str | os.PathLike, config: str | os.PathLike) -> str | None:
    """Why an export's `config` does not match the checksum its `weights` record, or None
    (also when the weights record none, or the config is missing: a target to build)."""
    from .fingerprint import hash_file

    recorded = read_metadata(weights).get(CONFIG_SEAL_KEY)
    if not recorded or not Path(config).exists():
        return None
    actual = hash_file(config)
    if actual != recorded:
        return f"{config} re-hashes to xxh3-128 {actual}, {weights} records {recorded}"
    return None


def require_intact(*paths: str | os.PathLike) -> None:
    """Stop before a damaged sealed file is used (trained on, evaluated, exported, served), in
    one line naming it and the repair. An export's config.json is checked with its weights."""
    from .errors import PipelineError, set_aside_repair

    for path in paths:
        problem = seal_problem(path)
        if problem is None and Path(path).name == "model.safetensors":
            problem = config_seal_problem(path, Path(path).parent / "config.json")
        if problem is not None:
            raise PipelineError(f"{problem}: {set_aside_repair()}")


def is_sealed(path: str | os.PathLike) -> bool:
    try:
        return SEAL_KEY in read_metadata(path)
    except (OSError, ValueError, UnicodeDecodeError):
        return False

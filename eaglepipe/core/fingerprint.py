"""Content fingerprints used for provenance and rerun decisions.

Hashes are xxh3-128 (fast, non-cryptographic): they detect change and corruption, not attacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from .errors import PipelineError

_BLOCK = 8 << 20

# Everything a tokenizer may load from its directory, including remote code (Kimi's tiktoken).
TOKENIZER_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
    "tokenization_*.py",
)


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
# What `from_pretrained` loads weights from (one file, or the shards its index names).
LOADABLE_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# How a file cloned without git-lfs begins: the pointer text instead of the weights.
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
WEIGHT_SAMPLE_BYTES = 1 << 20


def hash_bytes(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def hash_file(path: str | os.PathLike) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def file_identity(path: str | os.PathLike) -> tuple[int, int, int, int, int]:
    """What a cache of facts about a file is keyed on: device, inode, size, mtime and ctime.

    mtime alone can be carried over by `cp -p`, `rsync -a` or `tar x` of an edited file of the
    same size; ctime cannot be set by a user (every write, rename or copy moves it), so a file
    whose identity is unchanged still has the content the cached facts were computed from.
    """
    stat = os.stat(path)
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def hash_json(obj) -> str:
    return hash_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def model_config_hash(model_dir: str | os.PathLike) -> str:
    """Hash of the model's config.json content (key order does not matter)."""
    path = Path(model_dir) / "config.json"
    try:
        return hash_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise PipelineError(f"model directory {model_dir} has no config.json") from None


def tokenizer_files(model_dir: str | os.PathLike) -> list[Path]:
    model_dir = Path(model_dir)
    found: set[Path] = set()
    for pattern in TOKENIZER_FILE_PATTERNS:
        found.update(p for p in model_dir.glob(pattern) if p.is_file())
    return sorted(found)


def tokenizer_fingerprint(model_dir: str | os.PathLike) -> str:
    """Hash over every tokenizer file's name and content, not only tokenizer.json."""
    files = tokenizer_files(model_dir)
    if not files:
        raise PipelineError(f"model directory {model_dir} holds no tokenizer files")
    return hash_json({p.name: hash_file(p) for p in files})


def weights_fingerprint(directory: Path) -> str:
    """A cheap identity of the model weights: each weight file's name, size, first and last MiB.

    config.json alone cannot tell a base model from its fine-tune (same architecture, same
    config), and hashing a terabyte of weights is out of the question; sampled bytes of every
    file tell them apart. Chunks journalled under other weights are never reused.
    """
    parts = []
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in Path(directory).glob(pattern)})
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(WEIGHT_SAMPLE_BYTES)
            f.seek(max(0, size - WEIGHT_SAMPLE_BYTES))
            tail = f.read(WEIGHT_SAMPLE_BYTES)
        parts.append([path.name, size, hash_bytes(head + tail)])
    return hash_json(parts)


def missing_weights(model_dir: str | os.PathLike) -> str | None:
    """Why `from_pretrained` would find no weights in `model_dir`, or None when it has them:
    no `*.safetensors` / `*.bin` file, an empty one or a Git LFS pointer in its place, or a
    shard its index (`*.index.json`) names is absent."""
    model_dir = Path(model_dir)
    files = sorted(
        p for pattern in LOADABLE_WEIGHT_PATTERNS for p in model_dir.glob(pattern) if p.is_file()
    )
    if not files:
        return "holds no weights (no *.safetensors or *.bin file)"
    for path in files:
        size = path.stat().st_size
        if size == 0:
            return f"has an empty weight file {path.name} (0 bytes: an interrupted copy?)"
        if size < 1024:
            with open(path, "rb") as f:
                if f.read(len(LFS_POINTER)) == LFS_POINTER:
                    return (
                        f"has a Git LFS pointer in place of {path.name}, not its weights (fetch "
                        "them: `git lfs pull` in that directory)"
                    )
    for index in sorted(model_dir.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"has an unreadable weight index {index.name}"
        absent = sorted(name for name in shards if not (model_dir / name).is_file())
        if absent:
            return f"lacks {absent[0]}, a weight file its {index.name} names"
    return None

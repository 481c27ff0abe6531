"""Built toy targets kept per machine, so a second working directory copies the first one's build.

The toy's build is deterministic given its settings, its corpus, one torch thread, the code and
the library releases that train it, and all of those make the key: a changed setting, corpus
row, release or line of `toy_target.py` builds anew. Building the embedded default's toy takes
minutes on a 2-core machine; a copy takes a fraction of a second. An entry appears by rename
once complete, so a build killed half-way is never found, and an entry whose files no longer
match the hashes stored with them is passed over. The cache only saves time: when it
cannot be written (read-only, full), the build goes on without it.

Where: `$EAGLEPIPE_TOY_CACHE`, or `$XDG_CACHE_HOME/eaglepipe/toy-targets` (`~/.cache/...`);
`EAGLEPIPE_TOY_CACHE=off` turns it off.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
from pathlib import Path

from .. import __version__
from ..core.fingerprint import hash_file, hash_json
from ..core.user_cache import user_cache_dir

CACHE_ENV = "EAGLEPIPE_TOY_CACHE"
LIBRARIES = ("torch", "transformers", "tokenizers")


def cache_root() -> Path | None:
    """The cache directory, or None when `EAGLEPIPE_TOY_CACHE=off`."""
    value = os.environ.get(CACHE_ENV, "")
    if value == "off":
        return None
    if value:
        return Path(value)
    return user_cache_dir("toy-targets")


def _library_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_key(toy_settings: dict, corpus: list[list[dict]]) -> str:
    """What decides the build's bytes, hashed: settings, corpus messages, code, releases."""
    return hash_json(
        {
            "toy": toy_settings,
            "eaglepipe": __version__,
            "code": hash_file(Path(__file__).with_name("toy_target.py")),
            "libraries": {name: _library_version(name) for name in LIBRARIES},
            "machine": platform.machine(),
            "corpus": corpus,
        }
    )


MANIFEST = "cache-manifest.json"


def _file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hash_file(p) for p in sorted(directory.iterdir()) if p.name != MANIFEST}


def cached_build(key: str, complete_marker: str) -> Path | None:
    """The cached build for `key`, if one was completed and its files are still the ones
    stored (a damaged entry is passed over: the build runs again)."""
    root = cache_root()
    if root is None:
        return None
    entry = root / key
    if not (entry / complete_marker).is_file():
        return None
    try:
        stored = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return entry if stored == _file_hashes(entry) else None


def copy_build(entry: Path, destination: Path) -> None:
    """Copy a cached build's files (not its manifest) into a new directory."""
    shutil.copytree(entry, destination, ignore=shutil.ignore_patterns(MANIFEST))


def store_build(key: str, build_dir: Path) -> str | None:
    """Copy a finished build into the cache; returns a warning instead of raising."""
    root = cache_root()
    if root is None or (root / key).is_dir():
        return None
    staging = root / f".{key}.tmp-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(build_dir, staging)
        (staging / MANIFEST).write_text(json.dumps(_file_hashes(staging)))
        try:
            os.rename(staging, root / key)
        except OSError:
            if not (root / key).is_dir():  # not a concurrent build of the same key
                raise
    except OSError as exc:
        return f"toy target: not kept in the cache {root} ({exc}); set {CACHE_ENV}=off to silence"
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return None

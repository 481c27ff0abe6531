"""The user's cache directory for what this project keeps between runs on one machine."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(*parts: str) -> Path:
    """`$XDG_CACHE_HOME/eaglepipe/...`, or `~/.cache/eaglepipe/...`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base, "eaglepipe", *parts)

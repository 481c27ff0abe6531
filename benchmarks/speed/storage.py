"""The storage under test: a run's chunk directory pointed at /dev/shm or left on disk, and raw
writes of the same file sizes (what the storage takes without the pipeline)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def chunk_storage(run_dir: Path, storage: str) -> Path | None:
    """Point run_dir/hidden_states at the storage under test; returns a dir to remove after."""
    target = run_dir / "hidden_states"
    if target.is_symlink():
        target.unlink()
    else:
        shutil.rmtree(target, ignore_errors=True)
    if storage == "disk":
        return None
    if storage != "shm":
        raise ValueError(f"storage {storage!r}: choose disk or shm")
    shm_dir = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-chunks-", dir="/dev/shm"))
    target.symlink_to(shm_dir)
    return shm_dir


def raw_write(storage_dir: Path, sizes: list[int], writers: int, *, writeback: bool) -> dict:
    """The same file sizes written by `writers` threads at once, large buffers, fsync each;
    with `writeback`, each file's pages handed to the disk every 64 MiB as chunks' are."""
    from eaglepipe.core.atomic import Writeback

    scratch = Path(tempfile.mkdtemp(prefix="bench-ingest-raw-", dir=storage_dir))
    # A source larger than any CPU cache, as the dumps are: a cache-hot block would measure a
    # faster copy than any real data gets.
    block = os.urandom(64 << 20) * 8

    def write(item) -> int:
        index, size = item
        with open(scratch / f"raw-{index:05d}.bin", "wb", buffering=0) as f:
            pacer = Writeback(f.fileno()) if writeback else None
            left = size
            while left:
                left -= f.write(memoryview(block)[: min(left, len(block))])
                if pacer is not None:
                    pacer.advance(size - left)
            os.fsync(f.fileno())
        return size

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(writers) as pool:
            written = sum(pool.map(write, enumerate(sizes)))
        seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"bytes": written, "seconds": seconds}

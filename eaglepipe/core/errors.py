"""The one exception type for errors a user can cause.

Scripts run their work inside `one_line_errors()`: a `PipelineError` is printed on one line and
the process exits non-zero, so every user-facing failure reads as a sentence naming the row,
file, key, port or process involved.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class PipelineError(Exception):
    """An error the user can fix; the message names what is wrong and where."""


class ServerLost(PipelineError):
    """The shared server died or stopped answering while in use.

    The one failure of a shard job that another attempt can fix (the next lease starts a fresh
    server); every other PipelineError would fail the same way again, so it is not retried.
    """


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn a PipelineError into `error: <message>` on stderr and exit status 1; a full disk
    met where no PipelineError names the file yet, too (its path when the OS gave one)."""
    try:
        yield
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" while writing {exc.filename}" if exc.filename else ""
        print(
            f"error: no space left on device{where}: free space, then rerun (what was finished "
            "is kept)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


def set_aside_repair(remade_by: str = "makes it again") -> str:
    """The repair for a damaged file the pipeline wrote: verify moves it aside, a run remakes it."""
    return f"repair: `eaglepipe verify` sets it aside, then `snakemake --cores N` {remade_by}"

#!/usr/bin/env python3
"""A shard job's start-up read: its own rows from the prepared table, vs the whole table.

Every extraction job starts by loading its shard's prepared rows. The GPU waits for the first
request of a job whenever every running job is starting or finishing at once (BENCHMARKS.md,
"job turnover"), so this read must not grow with the dataset. The prepared table holds one
parquet row group per shard; the timed paths, in the same run and on the same file:

- shard: `eaglepipe.extract.shard.load_shard_rows` (reads the shard's row group only);
- whole table: the whole table read and then sliced to the shard (what a job did before).

    python -u benchmarks/bench_job_start.py --rows 20000 --rows-per-shard 200 --mean-len 2000
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    command_line,
    log,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    timed,
    write_results,
)

from eaglepipe.extract.shard import load_shard_rows  # noqa: E402
from eaglepipe.prepare.table import _parquet_bytes, load_prepared, rows_in_range  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--rows-per-shard", type=int, default=200)
    parser.add_argument("--mean-len", type=int, default=2000, help="mean tokens per row")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many reads")
    parser.add_argument("--dir", default=None, help="scratch parent dir (default: /tmp)")
    parser.add_argument("--out", default=None, help="results JSON (markdown beside it)")
    return parser.parse_args(argv)


def write_table(path: Path, rows: int, rows_per_shard: int, mean_len: int) -> int:
    rng = np.random.default_rng(0)
    lengths = rng.integers(mean_len // 4, 2 * mean_len - mean_len // 4 + 1, rows)
    tokens = [rng.integers(0, 128000, n, dtype=np.int32) for n in lengths]
    masks = [np.ones(n, dtype=np.uint8) for n in lengths]
    path.write_bytes(
        _parquet_bytes(
            list(range(rows)),
            ["train"] * rows,
            tokens,
            masks,
            [False] * rows,
            [()] * rows,
            rows_per_shard,
        )
    )
    return int(lengths.sum())


def best_of(repeat: int, read) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeat):
        with timed() as t:
            count = read()
        best = min(best, t["seconds"])
    return best, count


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-job-start-", dir=args.dir))
    try:
        table = work / "tokenized.parquet"
        total_tokens = write_table(table, args.rows, args.rows_per_shard, args.mean_len)
        size = table.stat().st_size
        log(f"prepared table: {args.rows} rows, {total_tokens:,} tokens, {size / 1e6:.1f} MB")
        # A shard in the middle of the table.
        start = (args.rows // args.rows_per_shard // 2) * args.rows_per_shard
        end = min(start + args.rows_per_shard, args.rows)

        def shard_read() -> int:
            return len(load_shard_rows(table, start, end).row_ids)

        def whole_read() -> int:
            return len(rows_in_range(load_prepared(table), start, end))

        shard_s, shard_rows = best_of(args.repeat, shard_read)
        whole_s, whole_rows = best_of(args.repeat, whole_read)
        if shard_rows != whole_rows or shard_rows != end - start:
            raise SystemExit(f"read {shard_rows} and {whole_rows} rows, expected {end - start}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results = {
        "benchmark": "job_start",
        "command": command_line(),
        "machine": machine_info(),
        "setup": {
            "rows": args.rows,
            "rows_per_shard": args.rows_per_shard,
            "tokens": total_tokens,
            "table_bytes": size,
            "shard": f"rows_{start}-{end}",
        },
        "shard_read_s": round(shard_s, 4),
        "whole_table_read_s": round(whole_s, 4),
        "speedup": ratio(whole_s, shard_s),
    }
    markdown = (
        f"### A shard job's start-up read ({args.rows} rows, {total_tokens:,} tokens, "
        f"{args.rows // args.rows_per_shard} shards)\n\n"
        + markdown_table(
            ["read", f"s (best of {args.repeat})"],
            [
                ["the shard's row group", results["shard_read_s"]],
                ["the whole table, then the shard's rows", results["whole_table_read_s"]],
            ],
        )  # fmt: skip
        + f"\nwhole / shard: {results['speedup']}x  \n"
        f"Machine: {machine_line(results['machine'])}.  \nCommand: `{results['command']}`\n"
    )
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

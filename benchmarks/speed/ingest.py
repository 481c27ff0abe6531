#!/usr/bin/env python3
"""Client ingest throughput: handoff dumps -> checked, checksummed chunk files, in GB/s, against
the storage's raw write rate, with 1..N workers (issue 28, item 4).

Synthetic dumps (the server's exact dump format, written with
eaglepipe.server.handoff.dump_writer.DumpWriter) are placed in a handoff directory on /dev/shm; the
timed part is what an extraction job does per row, with the job's own code and without torch:
read the dump (`read_dump_raw`, mapped), check it against the request, delete it, and write the
rows as planned chunks (streamed xxh3-128, fsync, rename, journal line). Each worker is its own
process with its own dumps and its own shard directory, as concurrent shard jobs are; all start
together and the rate is the bytes of all of them over the time until the last one is done.
Beside each worker count, in the same run and on the same filesystem, the raw sequential write
speed with as many writers: the same bytes in the same file sizes, written with large buffers
and fsynced, no hashing. The ratio says how close ingest gets to the storage. A DeepSeek-V3 /
Kimi-K2.5 node makes about 57 KB per token (H = 7168) at tens of thousands of tokens/s: about
3 GB/s, what the client must keep up with.

    python -u -m benchmarks.speed.ingest --hidden-size 7168 --gb-per-worker 2 \\
        --workers 1,2,4,8,16 --storages shm,disk --out-dir /tmp --out $OUT/ingest.json   # H200
    python -u -m benchmarks.speed.ingest --dry-run --out /tmp/ingest.json             # CPU check

`--store-dtypes bf16,fp8` runs every measurement once per stored dtype (extract.store: dumps of
e4m3 with their scales, written by the same DumpWriter, passed through to the chunks), the same
rows each: ingest of either store against the raw write of its own bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.stores import STORE_VARIANTS

REPO_ROOT = Path(__file__).resolve().parents[2]

NONCE = "0123456789ab"
PREFIX = "eaglepipe"
SHM = Path("/dev/shm")
GOAL = 0.9  # ingest / raw write, at enough workers
NODE_GB_PER_S = 3.0  # an 8-GPU DeepSeek-V3 / Kimi-K2.5 node's hidden states (issue 28)


def with_repository_importable() -> dict:
    """The environment for a worker run as `-m benchmarks.speed.ingest` from any directory."""
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per row")
    parser.add_argument("--rows", type=int, default=None, help="rows per worker")
    parser.add_argument(
        "--gb-per-worker", type=float, default=1.0, help="dump bytes per worker (sets --rows)"
    )
    parser.add_argument("--chunk-mb", type=float, default=1024.0, help="chunk size bound (MB)")
    parser.add_argument("--workers", default="1", help="worker counts to measure, in order")
    parser.add_argument("--storages", default="disk", help="shm and/or disk, in order")
    parser.add_argument("--out-dir", default=".", help="a directory on the disk filesystem")
    parser.add_argument("--handoff-dir", default=None, help="default: /dev/shm if writable")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the best of each is kept")
    parser.add_argument(
        "--writeback",
        default="on",
        help="on: chunks (and the raw writes) hand their pages to the disk every 64 MiB as the "
        "pipeline does (eaglepipe.core.atomic.Writeback); off: the kernel's own timing, as "
        "before 2026-12-05; 'off,on' measures both for each worker count",
    )  # fmt: skip
    parser.add_argument("--deadline-s", type=float, default=540.0, help="whole-run budget")
    parser.add_argument(
        "--store-dtypes", default="bf16",
        help="stored dtypes to measure, a comma list of bf16, fp8 (aux and final in e4m3), "
        "fp8aux (aux only); the same rows each",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes (H 256, 1-2 workers): a CPU check"
    )
    parser.add_argument("--out", default=None, help="results JSON (markdown beside it)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    if args.dry_run:
        args.hidden_size, args.tokens, args.gb_per_worker = 256, 256, 0.02
        args.chunk_mb, args.rows = 4.0, None
        args.workers = "1,2"
    args.workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
    args.writeback = [w.strip() for w in str(args.writeback).split(",") if w.strip()]
    if not args.writeback or not set(args.writeback) <= {"on", "off"}:
        parser.error("--writeback: on and/or off")
    args.storages = [s.strip() for s in args.storages.split(",") if s.strip()]
    if not set(args.storages) <= {"shm", "disk"}:
        parser.error("--storages: shm and/or disk")
    from benchmarks.stores import store_variants

    args.stores = store_variants(parser, "--store-dtypes", args.store_dtypes)
    token_bytes = 4 * args.hidden_size * 2  # the rows: --gb-per-worker of bf16 dumps
    if args.rows is None:
        args.rows = max(1, int(args.gb_per_worker * 1e9 / (token_bytes * args.tokens)))
    return args


# ----------------------------------------------------------------------------- a worker


def make_dumps(handoff: Path, rows: int, tokens: int, hidden: int, store) -> None:
    """`rows` dumps of the server's format; the values are one random block, reused."""
    import torch

    from eaglepipe.server.handoff.dump_writer import DumpWriter
    from eaglepipe.server.handoff.request_ids import make_rid

    generator = torch.Generator().manual_seed(0)
    aux = torch.randn(tokens, 3 * hidden, generator=generator).to(torch.bfloat16)
    final = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    with DumpWriter(handoff, PREFIX, aux_layer_ids=[1, 3, 4], store=store) as writer:
        for row_id in range(rows):
            writer.submit([make_rid(PREFIX, NONCE, row_id, 0)], [tokens], aux, final)


def ingest(
    handoff: Path,
    out: Path,
    rows: int,
    tokens: int,
    hidden: int,
    chunk_bytes: int,
    writeback_bytes: int,
    store,
):
    """The job's per-row path (no torch): returns (chunk bytes written, chunk file sizes);
    `writeback_bytes` as `extract.chunk_writeback_mb` sets it (0: the kernel's timing)."""
    import numpy as np

    from eaglepipe.extract.chunk_file import RowTensors, plan_chunks, plan_digest, write_chunk
    from eaglepipe.extract.client import ClientSettings, RowRequest, check_dump
    from eaglepipe.extract.shard_files import append_journal
    from eaglepipe.server.handoff.dumps import dump_path, read_dump_raw
    from eaglepipe.server.handoff.request_ids import make_rid

    settings = ClientSettings(PREFIX, 1, 1 << 40, 0, 60.0, hidden, store=store)
    ids = np.arange(tokens, dtype=np.int32)
    mask = np.ones(tokens, dtype=np.uint8)
    requests = {r: RowRequest(r, ids) for r in range(rows)}
    chunks = plan_chunks(
        list(requests), [tokens] * rows, hidden, max_chunk_bytes=chunk_bytes, store=store
    )
    digest = plan_digest(chunks, {"bench": True})
    written, sizes = 0, []
    for index, members in enumerate(chunks):
        chunk_rows = []
        for row_id in members:
            rid = make_rid(PREFIX, NONCE, row_id, 0)
            path = dump_path(handoff, rid)
            tensors, _ = read_dump_raw(path, store)
            aux, final = tensors.pop("aux_hidden_states"), tensors.pop("final_hidden_states")
            check_dump(aux, final, requests[row_id], rid, settings)
            path.unlink()
            chunk_rows.append(RowTensors(row_id, ids, mask, aux, final, scales=tensors))
        record = write_chunk(
            out, index, chunk_rows, hidden_size=hidden, writeback_bytes=writeback_bytes,
            store=store,
        )  # fmt: skip
        append_journal(out, record, digest)
        written += record.bytes
        sizes.append(record.bytes)
    return written, sizes


def worker_main(spec: dict) -> int:
    """One worker process: make its dumps, say ready, wait for the go file, ingest, report."""
    from eaglepipe.core.hidden_store import HiddenStore

    handoff, out, go = Path(spec["handoff"]), Path(spec["out"]), Path(spec["go"])
    store = HiddenStore(**spec["store"])
    make_dumps(handoff, spec["rows"], spec["tokens"], spec["hidden"], store)
    # Imports before the clock starts (ingest's own are then lookups).
    import numpy  # noqa: F401

    import eaglepipe.extract.chunk_file  # noqa: F401
    import eaglepipe.extract.client  # noqa: F401
    import eaglepipe.extract.shard_files  # noqa: F401
    import eaglepipe.server.handoff.dumps  # noqa: F401
    from eaglepipe.core.atomic import WRITEBACK_STEP

    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.001)
    written, sizes = ingest(
        handoff, out, spec["rows"], spec["tokens"], spec["hidden"], spec["chunk_bytes"],
        WRITEBACK_STEP if spec["writeback"] else 0, store,
    )  # fmt: skip
    print(json.dumps({"done_at": time.time(), "bytes": written, "sizes": sizes}), flush=True)
    return 0


# ----------------------------------------------------------------------------- the parent


def run_workers(
    count: int, storage_dir: Path, handoff_root: Path, args, *, writeback: bool, store: str
) -> dict:
    """`count` workers at once; the aggregate rate from the go signal to the last one done."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-ingest-", dir=storage_dir))
    handoff = Path(tempfile.mkdtemp(prefix="bench-ingest-handoff-", dir=handoff_root))
    go = scratch / "go"
    procs = []
    try:
        for w in range(count):
            spec = {
                "handoff": str(handoff / f"w{w}"),
                "out": str(scratch / f"w{w}"),
                "go": str(go),
                "rows": args.rows,
                "tokens": args.tokens,
                "hidden": args.hidden_size,
                "chunk_bytes": int(args.chunk_mb * 1e6),
                "writeback": writeback,
                "store": STORE_VARIANTS[store],
            }
            Path(spec["handoff"]).mkdir(mode=0o700)
            Path(spec["out"]).mkdir()
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-u",
                        "-m",
                        "benchmarks.speed.ingest",
                        "--worker",
                        json.dumps(spec),
                    ],
                    stdout=subprocess.PIPE,
                    env=with_repository_importable(),
                    text=True,
                )  # fmt: skip
            )
        for proc in procs:
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"an ingest worker did not start: {line!r}")
        started = time.time()
        go.touch()
        reports = []
        for proc in procs:
            out, _ = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"an ingest worker exited {proc.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        seconds = max(r["done_at"] for r in reports) - started
        written = sum(r["bytes"] for r in reports)
        sizes = [s for r in reports for s in r["sizes"]]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(handoff, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return {"bytes": written, "seconds": seconds, "file_sizes": sizes}


def storage_dirs(args) -> dict[str, Path]:
    dirs = {}
    for storage in args.storages:
        if storage == "shm":
            if not os.access(SHM, os.W_OK):
                raise SystemExit("--storages shm: /dev/shm is not writable here")
            dirs["shm"] = SHM
        else:
            dirs["disk"] = Path(args.out_dir).resolve()
    return dirs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))
    from benchmarks.common import (
        command_line,
        log,
        machine_info,
        markdown_table,
        write_results,
    )
    from benchmarks.speed.storage import raw_write
    from benchmarks.stores import bytes_per_token, bytes_per_token_lines
    from eaglepipe.core.hidden_store import HiddenStore
    from eaglepipe.extract.chunk_file import expected_bytes

    deadline = time.monotonic() + args.deadline_s
    handoff_root = Path(args.handoff_dir or (SHM if os.access(SHM, os.W_OK) else "/tmp"))
    results: dict = {
        "benchmark": "ingest",
        "command": command_line(),
        "machine": machine_info("cpu"),
        "setup": {
            "hidden_size": args.hidden_size,
            "tokens_per_row": args.tokens,
            "rows_per_worker": args.rows,
            "gb_per_worker": round(args.rows * args.tokens * 4 * args.hidden_size * 2 / 1e9, 3),
            "chunk_mb": args.chunk_mb,
            "workers": args.workers,
            "handoff": str(handoff_root),
            "repeat": args.repeat,
            "writeback": args.writeback,
            "store_dtypes": args.stores,
            "cpus": os.cpu_count(),
        },
        "bytes_per_token": bytes_per_token(args.stores),
        "runs": {},
    }
    for line in bytes_per_token_lines(results["bytes_per_token"]):
        log(line)
    for storage, directory in storage_dirs(args).items():
        entries = results["runs"][storage] = []
        runs = [(c, w, st) for st in args.stores for c in args.workers for w in args.writeback]
        for count, writeback, store in runs:
            if time.monotonic() > deadline - 30:
                skipped = "the run's budget is spent"
                entries.append(
                    {"workers": count, "writeback": writeback, "store": store, "skipped": skipped}
                )
                continue
            best_ingest = best_raw = None
            for _ in range(args.repeat):
                # Alternating the two and keeping each one's best: other I/O on the machine then
                # distorts the ratio less.
                paced = writeback == "on"
                done = run_workers(
                    count, directory, handoff_root, args, writeback=paced, store=store
                )
                raw = raw_write(directory, done["file_sizes"], count, writeback=paced)
                if best_ingest is None or done["seconds"] < best_ingest["seconds"]:
                    best_ingest = done
                if best_raw is None or raw["seconds"] < best_raw["seconds"]:
                    best_raw = raw
            ingest_gbs = best_ingest["bytes"] / best_ingest["seconds"] / 1e9
            raw_gbs = best_raw["bytes"] / best_raw["seconds"] / 1e9
            token_bytes = expected_bytes(
                1, args.hidden_size, 3, HiddenStore(**STORE_VARIANTS[store])
            )
            entry = {
                "workers": count,
                "writeback": writeback,
                "store": store,
                "gb": round(best_ingest["bytes"] / 1e9, 3),
                "chunks": len(best_ingest["file_sizes"]),
                "ingest_gb_per_s": round(ingest_gbs, 3),
                "raw_write_gb_per_s": round(raw_gbs, 3),
                "ingest_vs_raw": round(ingest_gbs / raw_gbs, 3),
                "tokens_per_s_at_h": round(ingest_gbs * 1e9 / token_bytes),
            }
            entries.append(entry)
            log(f"{storage}, {store}, {count} worker(s), writeback {writeback}: ingest "
                f"{entry['ingest_gb_per_s']} GB/s, raw {entry['raw_write_gb_per_s']} GB/s, "
                f"ratio {entry['ingest_vs_raw']}")  # fmt: skip
            write_results(args.out, results)
    rows = [
        [storage, e.get("store", "bf16"), e["workers"], e.get("writeback", "off"),
         e.get("ingest_gb_per_s"),
         e.get("raw_write_gb_per_s"), e.get("ingest_vs_raw"), e.get("tokens_per_s_at_h"),
         e.get("skipped", "")]
        for storage, entries in results["runs"].items()
        for e in entries
    ]  # fmt: skip
    setup = results["setup"]
    markdown = (
        f"### Client ingest (H = {setup['hidden_size']}, {setup['tokens_per_row']} tokens per row, "
        f"{setup['gb_per_worker']} GB per worker, chunks <= {setup['chunk_mb']:g} MB)\n\n"
        + markdown_table(
            [
                "storage",
                "stored dtype",
                "workers",
                "writeback every 64 MiB",
                "ingest GB/s",
                "raw write GB/s",
                "ingest / raw",
                "tokens/s at this H",
                "note",
            ],
            rows,
        )  # fmt: skip
        + f"\nGoal: ingest >= {GOAL} x raw once the workers are enough; a node makes about "
        f"{NODE_GB_PER_S:g} GB/s at H = 7168.  \nCommand: `{results['command']}`\n"
    )
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

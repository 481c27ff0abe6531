#!/usr/bin/env python3
"""Extraction through SGLang against SGLang's own bare prefill, in one run (issue 15, item 7).

The target is 8B-shaped (Llama-3.1-8B: hidden 4096, 32 layers, 32/8 heads, vocab 128256) with
random bf16 weights made on the GPU and saved once. Over the same seeded rows (512-4096 tokens):

- bare: SGLang with the launcher's exact command minus the hook and the capture (no
  `--forward-hooks`, no capture flags or capture ids), the rows sent with `max_new_tokens: 0`,
  `--inflight-requests` at a time; tokens/s to the last answer. This is the ceiling.
- bare_capture (`--bare-capture`): the same rows through the launcher's command without the
  hook only, the capture on: what computing the aux hidden states costs, apart from the hook,
  the dumps and the client.
- pipeline: SGLang started by the project's launcher (hook + capture), then the shards as
  `--parallel-shards` concurrent `scripts/extract.py` jobs (what `snakemake --cores N` runs),
  writing checksummed chunks; once with the chunks on /dev/shm, once on disk (the scratch dir).
  Tokens/s from the first job's start to the last manifest (with --verify-delete, to the last
  shard verified and deleted); beside it to the last job's exit (`jobs_span_tokens_per_s`),
  and the run split by how many jobs were alive (`by_jobs_alive`): the steady state, every job
  slot busy, apart from the start-up, turnover and tail. `--inflight-requests 32,64` runs the
  pipeline once per value on the same server.
- raw writes: sequential writes with an fsync to the scratch dir's disk and to /dev/shm,
  `--raw-gb` each, in the same run: what the storage can take.

Reported: the ratios (pipeline on tmpfs / bare, goal >= 0.95, 0.90 at least; pipeline on disk /
min(bare, what the disk can take), goal >= 0.95), the hook's host time per batch (the hook's
own log lines), SGLang's prefill batches and per-batch time in each run (its log), the server's
busy share (GPU utilisation sampled every 200 ms, and the bare per-token time x tokens over the
wall time), and where the rest of the pipeline's time went (the shard jobs' start-up and the
manifests' client breakdown). JSON to --out, a markdown table beside it.

At realistic sizes (issue 28, item 1: >= 1 M tokens per shard, >= 5 M in the run) the hidden
states outgrow the machine (5 M tokens of the 8B shape are 164 GB; the lent H200 has 128 GiB of
/dev/shm and 64 GiB of disk): `--verify-delete` then hands each finished shard to a verifier
thread that runs the validation stage's integrity check (every chunk present, re-hashed against
the manifest, none unlisted) and deletes the shard, as a user would move it to bulk storage,
while the next job runs. `--shard-tokens` bounds a shard by tokens. The results carry a storage
and time plan for the full-size shape (`plan`), also in `--dry-run`, so a command can be checked
against the machine here before a device call.

    python3 -u -m benchmarks.speed.sglang_extraction --out $OUT/sglang_extraction.json   # H200
    python3 -u -m benchmarks.speed.sglang_extraction --tokens 5000000 --shard-tokens 1250000 \
        --parallel-shards 2 --storages shm --verify-delete --out $OUT/scale.json        # H200
    python3 -u -m benchmarks.speed.sglang_extraction --dry-run --sglang-version 0.5.14 \\
        --out /tmp/sglang_extraction.json                                  # CPU: no server

`--store-dtypes bf16,fp8,fp8aux` runs the pipeline once per stored dtype (extract.store: fp8 is
aux and final in e4m3, fp8aux the aux states only; each on its own server, the hook quantizing on
the GPU), against the same bare prefill: variants after the first store are named `shm/fp8`,
`disk/fp8aux`, ... The bytes per token of each store (8B shape and Kimi-K2.5's, from the chunk
file's own byte function) are printed and recorded (`bytes_per_token`), in --dry-run too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    command_line,
    free_port,
    log,
    machine_info,
    markdown_table,
    ratio,
    working_directory,
    write_results,
)
from benchmarks.sglang_runs import (
    SGLANG_EXTRA_ARGS,
    add_engine_options,
    bare_command,
    http_ok,
    log_between,
    max_inflight_bytes,
    pipeline_config,
    prefill_batches,
    shm_free_gb,
    stop_group,
    tail,
)
from benchmarks.speed.shard_runs import BREAKDOWN_KEYS, GpuUtilisation, shard_jobs_in_parallel
from benchmarks.speed.storage import chunk_storage
from benchmarks.stores import STORE_VARIANTS, bytes_per_token, bytes_per_token_lines, store_variants
from benchmarks.toy_targets.llama import SHAPES, random_llama
from benchmarks.toy_targets.rows import seeded_rows, write_prepared
from benchmarks.toy_targets.word_tokenizer import save_word_tokenizer
from eaglepipe.core.run import AUTO_INFLIGHT_REQUESTS  # noqa: E402

GOALS = {"shm_vs_bare": 0.95, "shm_vs_bare_at_least": 0.90, "disk_vs_ceiling": 0.95}
WARMUP_ROWS = 32
HOOK_LINE = re.compile(
    r"eaglepipe dump hook: (\d+) prefill batches dumped \((\d+) requests, (\d+) tokens\); "
    r"in the hook per batch: mean ([0-9.]+) ms, max ([0-9.]+) ms"
)


# Realistic sizes on the lent H200 (issue 28, item 1), one device call each (tools/h200.sh
# perf-scale, perf-scale-disk); `plan` in the results checks them against its storage and call.
# On /dev/shm: >= 1 M tokens per shard and 5 M in the run; 2 jobs x 64 requests in flight (the
# pipeline's GPU default), the bare run 64 (its GPU is busy all the time at 64); 4 shards, 2 waves
# of 2 jobs. On disk (64 GiB, 49 GB at most at once) shards of 0.5 M tokens, the jobs' dumps
# bounded as the pipeline bounds them by default (a quarter of the handoff), each chunk handed
# to the disk every 64 MiB (the default), then left to the kernel (`extract.chunk_writeback_mb:
# 0`): the two disagreed on the H200 of 2026-12-06 (BENCHMARKS.md).
PRESETS = {
    "scale-shm": dict(tokens=5_000_000, shard_tokens=1_250_000, parallel_shards=2,
                      storages="shm", verify_delete=True, bare_fraction=0.5),
    "scale-disk": dict(tokens=3_000_000, shard_tokens=500_000, parallel_shards=2,
                       storages="disk", verify_delete=True, bare_fraction=0.5,
                       inflight_gb="auto", chunk_writeback_mb="64,0"),
}  # fmt: skip


def int_list(parser: argparse.ArgumentParser, option: str, value, minimum: int) -> list[int]:
    """A comma list of integers >= `minimum` (each a variant of the same run), or the parser's
    one-line error naming `option`."""
    try:
        values = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        parser.error(f"{option}: one or more integers >= {minimum}, comma-separated")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None,
        help="a realistic-size run's settings (PRESETS); later options still override them",
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, default=600_000)
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--parallel-shards", type=int, default=4, help="shard jobs at once")
    parser.add_argument("--shard-gb", type=float, default=2.5, help="bound on one shard")
    parser.add_argument(
        "--shard-tokens", type=int, default=None, help="bound on one shard in tokens (not GB)"
    )
    parser.add_argument(
        "--verify-delete",
        action="store_true",
        help="verify each finished shard (integrity: sizes, re-hash, no stray chunk), then "
        "delete it, beside the running jobs: runs larger than the storage",
    )
    parser.add_argument(
        "--model-on", choices=("auto", "shm", "disk"), default="auto",
        help="where the random model is saved (auto: /dev/shm when the plan leaves room)",
    )  # fmt: skip
    parser.add_argument(
        "--assume-bare-tok-s", type=float, default=36000.0,
        help="the plan's bare prefill rate (2026-12-01 on the H200: 35,977 tok/s)",
    )  # fmt: skip
    parser.add_argument("--chunk-mb", type=float, default=1024.0)
    parser.add_argument(
        "--inflight-requests", default=str(AUTO_INFLIGHT_REQUESTS["extract"]["gpu"]),
        help="requests in flight per shard job (default: the pipeline's on a GPU); a comma list "
        "runs the pipeline once per value on the same server (e.g. 32,64)",
    )  # fmt: skip
    parser.add_argument(
        "--inflight-gb", default="2",
        help="GiB of dumps in flight per shard job (extract.max_inflight_bytes), or `auto` for "
        "the pipeline's default (a quarter of the handoff's free space); a comma list runs "
        "each (e.g. 2,auto). 2 keeps a /dev/shm run's dumps, chunks and model within /dev/shm",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-writeback-mb", default="64",
        help="extract.chunk_writeback_mb: each chunk handed to the disk every this many MiB as "
        "it is written, 0 for the kernel's own timing; a comma list runs each (e.g. 64,0)",
    )  # fmt: skip
    parser.add_argument("--bare-inflight", type=int, default=64, help="the bare run's client")
    parser.add_argument(
        "--bare-fraction", type=float, default=1.0,
        help="the bare run sends this leading share of the same rows (a rate: a long run's "
        "steady state needs no more, and the call's 10 minutes are short)",
    )  # fmt: skip
    parser.add_argument(
        "--bare-capture", action="store_true",
        help="also the bare run's rows through SGLang with the capture but without the hook: "
        "what the capture alone costs the prefill, apart from the hook, dumps and client",
    )  # fmt: skip
    parser.add_argument(
        "--store-dtypes", default="bf16",
        help="stored dtypes (extract.store), a comma list of bf16, fp8, fp8aux: the pipeline runs "
        "once per store (its own server), after the same bare prefill",
    )  # fmt: skip
    parser.add_argument("--mem-fraction-static", type=float, default=0.8)
    parser.add_argument("--storages", default="shm,disk", help="where chunks go, in order")
    parser.add_argument("--raw-gb", type=float, default=4.0, help="raw write test size")
    parser.add_argument("--work-root", default=None, help="scratch dir on disk (default /tmp)")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="whole-run budget")
    parser.add_argument("--health-s", type=float, default=300.0)
    parser.add_argument("--out", default=None)
    add_engine_options(
        parser,
        "reference: the pipeline runs only, through the built-in server on CPU with a tiny "
        "model (a check of this script itself)",
    )
    args = parser.parse_args(argv)
    if args.preset:
        parser.set_defaults(**PRESETS[args.preset])
        args = parser.parse_args(argv)
    args.storages = [s.strip() for s in args.storages.split(",") if s.strip()]
    args.inflight_variants = int_list(parser, "--inflight-requests", args.inflight_requests, 1)
    args.inflight_requests = args.inflight_variants[0]
    args.inflight_gb_variants = [g.strip() for g in str(args.inflight_gb).split(",") if g.strip()]
    if not args.inflight_gb_variants:
        parser.error("--inflight-gb: one or more values, comma-separated")
    for value in args.inflight_gb_variants:
        try:
            max_inflight_bytes(value)
        except ValueError:
            parser.error(f"--inflight-gb: {value!r} is neither a positive number nor auto")
    args.writeback_variants = int_list(parser, "--chunk-writeback-mb", args.chunk_writeback_mb, 0)
    args.store_variants = store_variants(parser, "--store-dtypes", args.store_dtypes)
    if not set(args.storages) <= {"shm", "disk"}:
        parser.error("--storages: shm and/or disk")
    if args.dry_run and not args.sglang_version:
        parser.error("--dry-run needs --sglang-version")
    args.tiny = args.dry_run or args.engine == "reference"
    # The sizes a GPU run uses: the plan is made for them, whatever the check itself runs.
    args.full = {k: getattr(args, k) for k in ("tokens", "min_len", "max_len", "raw_gb")}
    if args.tiny:
        args.tokens = min(args.tokens, 3000)
        args.min_len, args.max_len = 16, 160
        args.raw_gb = min(args.raw_gb, 0.05)
    return args


# ----------------------------------------------------------------------------- the jobs


JOB_START_STEPS = ("entered_s", "lease_asked_s", "leased_s", "first_request_s", "lease_via")


def first_request_summary(manifests: list[dict]) -> dict | None:
    """The jobs' start-up, from their manifests (`timing.first_request_s`: process start to
    first request): sum, median and max over the shards, None where none records it; with the
    medians of its steps where the manifests record them (extraction: `entered_s`, the
    library's code entered after interpreter and imports; `lease_asked_s`, the shard's rows
    read and its chunks planned; `leased_s`, the server's lease held) and how many leases had
    the server's info each way (`lease_via`: started it, another job's answer note, asked);
    `jobs`: each job's own steps, in the order given."""
    timings = [m.get("timing", {}) for m in manifests]
    values = sorted(t["first_request_s"] for t in timings if t.get("first_request_s") is not None)
    if not values:
        return None
    summary = {
        "shards": len(values),
        "sum_s": round(sum(values), 3),
        "median_s": values[len(values) // 2],
        "max_s": values[-1],
    }
    for step in ("entered_s", "lease_asked_s", "leased_s"):
        steps = sorted(t[step] for t in timings if t.get(step) is not None)
        if steps:
            summary[f"{step[:-2]}_median_s"] = steps[len(steps) // 2]
    via = Counter(t["lease_via"] for t in timings if t.get("lease_via"))
    if via:
        summary["lease_via"] = dict(sorted(via.items()))
    # Each job's own steps, in the order given (the plan's): a first wave that starts together
    # and a job that starts beside running ones can differ, which medians hide.
    births = [m["job_window"][0] for m in manifests if m.get("job_window")]
    summary["jobs"] = []
    for manifest, timing in zip(manifests, timings, strict=True):
        if timing.get("first_request_s") is None:
            continue
        job = {"shard": manifest.get("shard")}
        if manifest.get("job_window"):  # its process start after the first job's
            job["started_s"] = round(manifest["job_window"][0] - min(births), 3)
        job.update({k: timing[k] for k in JOB_START_STEPS if timing.get(k) is not None})
        summary["jobs"].append(job)
    return summary


def verify_and_delete(shard_dir: Path, manifest: dict) -> dict:
    """The validation stage's integrity check of a finished shard (every chunk present with its
    size, re-hashed against the manifest, none unlisted), then the shard deleted: a benchmark
    that writes more than the storage holds keeps only the shards in progress. Returns what was
    checked; raises on a failed check (the shard is kept for a look)."""
    from eaglepipe.core.manifest import read_manifest
    from eaglepipe.extract.shard_files import HIDDEN_STATES_MANIFEST
    from eaglepipe.validate.integrity import (
        check_chunk_checksum,
        check_chunk_file,
        check_no_stray_chunks,
    )

    started = time.perf_counter()
    shard = manifest["shard"]
    listed, _ = read_manifest(shard_dir, HIDDEN_STATES_MANIFEST, shard=shard)
    for entry in listed["chunks"]:
        check_chunk_file(shard_dir, shard, entry)
        check_chunk_checksum(shard_dir, shard, entry)
    check_no_stray_chunks(shard_dir, shard, listed)
    shutil.rmtree(shard_dir)
    manifest["verified"] = {
        "chunks": len(listed["chunks"]),
        "bytes": listed["num_bytes"],
        "seconds": round(time.perf_counter() - started, 3),
    }
    return manifest["verified"]


def prefill_timeline(log_text: str) -> list[tuple[float, int]]:
    """(epoch second, tokens) of each prefill batch whose log line carries a timestamp."""
    return [(b["at"], b["tokens"]) for b in prefill_batches(log_text) if b["at"] is not None]


def split_by_jobs_alive(
    windows: Sequence[Sequence[float]],
    gpu_points: Sequence[tuple[float, int]],
    prefill_points: Sequence[tuple[float, int]],
) -> dict:
    """A run's whole seconds grouped by how many shard-job processes were alive at mid-second:
    per group the seconds, the tokens the server prefilled in them (from its log, to the
    second) and the mean GPU utilisation. It separates the steady state (every job slot busy)
    from the start-up, turnover and tail of the run."""
    if not windows:
        return {}
    first = int(min(start for start, _ in windows))
    last = int(max(end for _, end in windows))
    groups: dict[int, dict] = {}
    second_group: dict[int, dict] = {}
    for second in range(first, last + 1):
        alive = sum(1 for start, end in windows if start <= second + 0.5 < end)
        group = groups.setdefault(alive, {"seconds": 0, "prefill_tokens": 0, "util": []})
        group["seconds"] += 1
        second_group[second] = group
    for when, tokens in prefill_points:
        if int(when) in second_group:
            second_group[int(when)]["prefill_tokens"] += tokens
    for when, util in gpu_points:
        if int(when) in second_group:
            second_group[int(when)]["util"].append(util)
    return {
        str(alive): {
            "seconds": g["seconds"],
            "prefill_tokens": g["prefill_tokens"],
            "prefill_tokens_per_s": round(g["prefill_tokens"] / g["seconds"], 1),
            "gpu_util_mean_pct": round(sum(g["util"]) / len(g["util"]), 1) if g["util"] else None,
        }
        for alive, g in sorted(groups.items(), reverse=True)
    }


# ----------------------------------------------------------------------------- storage


def raw_write(directory: Path, gigabytes: float) -> dict:
    """Sequential 64 MiB writes of `gigabytes`, then fsync: what the storage takes. Each 64
    MiB is handed to the disk as it is written, as the chunks' are (`Writeback`; since
    2026-12-05, eighth session: the storage's rate, not the kernel's flush timing)."""
    from eaglepipe.core.atomic import Writeback

    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    count = max(1, int(gigabytes * 1e9 / len(block)))
    path = directory / f"raw-write-{os.getpid()}.bin"
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pacer = Writeback(fd)
        for i in range(count):
            os.write(fd, block)
            pacer.advance((i + 1) * len(block))
        os.fsync(fd)
    finally:
        os.close(fd)
        seconds = time.perf_counter() - started
        path.unlink(missing_ok=True)
    written = count * len(block)
    return {"dir": str(directory), "bytes": written, "seconds": round(seconds, 3),
            "gb_per_s": round(written / seconds / 1e9, 3)}  # fmt: skip


# ----------------------------------------------------------------------------- configs


# The lent H200 (KINDS: 128 GiB of /dev/shm, 64 GiB of disk) and what tools/h200.sh leaves this
# script of a 10-minute call: its 570 s budget less the wheels' install and import check (~60 s)
# and its margins.
H200_BYTES = {"shm": 128 << 30, "disk": 64 << 30}
H200_CALL_S = 480
SERVER_START_S = 75  # SGLang 0.5.14 with the JIT cache carried (2026-12-01: 57-87 s)
MODEL_BUILD_S = 45


def dump_bytes_in_flight(gb: str, jobs: int) -> int:
    """The most dump bytes `jobs` jobs hold at once with `--inflight-gb` value `gb`; `auto`
    lets each job take a quarter of the handoff's free space at its start."""
    per_job = max_inflight_bytes(gb)
    if per_job is None:
        return int((1 - 0.75**jobs) * H200_BYTES["shm"])
    return jobs * per_job


def token_bytes(shape: dict, store: str = "bf16") -> int:
    """Chunk bytes per token (the chunk file's own function): aux (3 layers) and final hidden
    states as `store` keeps them, ids, mask."""
    from eaglepipe.core.hidden_store import HiddenStore
    from eaglepipe.extract.chunk_file import token_bytes as chunk_token_bytes

    return chunk_token_bytes(shape["hidden"], 3, HiddenStore(**STORE_VARIANTS[store]))


def model_bytes(shape: dict) -> int:
    h, kv = shape["hidden"], shape["hidden"] * shape["kv_heads"] // shape["heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * shape["intermediate"]
    return 2 * (shape["layers"] * layer + 2 * shape["vocab"] * h)


def shard_token_bound(args, shape: dict) -> int:
    # --shard-gb counts bf16 bytes: every store then extracts the same shards.
    return args.shard_tokens or int(args.shard_gb * 1e9 / token_bytes(shape))


def storage_plan(args) -> dict:
    """What a GPU run of these arguments writes where, at most at once, against the lent
    H200's storage, and how long it takes at `--assume-bare-tok-s`."""
    shape = SHAPES["8b"]
    tokens = args.full["tokens"]
    per_token = max(token_bytes(shape, store) for store in args.store_variants)
    shard_tokens = min(shard_token_bound(args, shape), tokens)
    shards = -(-tokens // shard_tokens)
    shard_bytes = shard_tokens * per_token
    # Jobs write their shards; each finished one waits for its verifier (one at a time) or is
    # deleted at once; a shard being verified is whole, the running ones grow.
    on_storage = min(shards, args.parallel_shards + (1 if args.verify_delete else 0))
    chunks = on_storage * shard_bytes
    dumps = max(dump_bytes_in_flight(gb, args.parallel_shards) for gb in args.inflight_gb_variants)
    model = model_bytes(shape)
    need = {
        storage: chunks + (dumps if storage == "shm" else 0)
        for storage in ("shm", "disk")
        if storage in args.storages
    }
    need.setdefault("shm", dumps)  # the handoff is on /dev/shm whatever holds the chunks
    model_on = args.model_on
    if model_on == "auto":
        room = H200_BYTES["shm"] - need["shm"]
        model_on = "shm" if room > model + (8 << 30) else "disk"
    need[model_on] = need.get(model_on, 0) + model
    bare_s = tokens / args.assume_bare_tok_s
    bare_runs = 2 if args.bare_capture else 1
    seconds = (
        MODEL_BUILD_S
        + (1 + bare_runs) * SERVER_START_S
        + bare_runs * args.bare_fraction * bare_s
        + len(args.store_variants) * len(variant_settings(args)) * bare_s / 0.95
        + (len(args.store_variants) - 1) * SERVER_START_S
    )
    return {
        "shape": "8b",
        "tokens": tokens,
        "bytes_per_token": per_token,
        "shard_tokens": shard_tokens,
        "shards": shards,
        "shard_gb": round(shard_bytes / 1e9, 1),
        "total_gb": round(tokens * per_token / 1e9, 1),
        "model_on": model_on,
        "peak_gb": {k: round(v / 1e9, 1) for k, v in need.items()},
        "room_gb": {k: round(v / 1e9, 1) for k, v in H200_BYTES.items()},
        "fits": all(v <= H200_BYTES[k] for k, v in need.items()),
        "estimated_s": round(seconds),
        "call_s": H200_CALL_S,
        "fits_call": seconds <= H200_CALL_S,
        "verify_delete": args.verify_delete,
    }


def rows_per_shard_for(rows, args, shape) -> int:
    """At least the bound's tokens per shard (rows are whole); four shards in a tiny run."""
    if args.tiny:
        return max(1, len(rows) // 4)
    row_tokens = sum(len(r) for r in rows) / len(rows)
    return max(1, min(len(rows), -(-shard_token_bound(args, shape) // int(row_tokens))))


def with_store(config: dict, store: str) -> dict:
    """The validated config with another extract.store."""
    changed = json.loads(json.dumps(config))
    changed["extract"]["store"] = dict(STORE_VARIANTS[store])
    return changed


def merge_store_run(results: dict, store: str, run: dict) -> None:
    """A later store's pipeline run into results["pipeline"]: its variants as `<name>/<store>`,
    its server's facts under `stores`."""
    pipeline = results["pipeline"]
    for name, entry in run.get("variants", {}).items():
        pipeline["variants"][f"{name}/{store}"] = {**entry, "store": store}
    pipeline.setdefault("stores", {})[store] = {
        k: v for k, v in run.items() if k not in ("variants", "server_log_tail")
    }


# ----------------------------------------------------------------------------- bare SGLang


async def send_rows(url: str, rows, inflight: int, tag: str) -> dict:
    """All rows as prefill-only requests, `inflight` at a time; seconds to the last answer."""
    import aiohttp

    slots = asyncio.Semaphore(inflight)
    errors: list[str] = []
    answered = 0

    async def one(i, ids, session):
        nonlocal answered
        async with slots:
            body = {"input_ids": ids.tolist(), "rid": f"{tag}{i}",
                    "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
            async with session.post(f"{url}/generate", json=body) as response:
                text = await response.text()
                if response.status != 200:
                    errors.append(f"{response.status}: {text[:200]}")
                    return
                answered += 1

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(i, ids, session) for i, ids in enumerate(rows)))
        seconds = time.perf_counter() - started
    return {"answered": answered, "errors": errors[:5], "seconds": round(seconds, 3)}


def run_bare(
    config: dict, rows, warmup, args, work: Path, name: str = "bare", capture: bool = False
) -> dict:
    argv, extra_env = bare_command(config, capture=capture)
    url = f"http://{config['server']['host']}:{config['server']['port']}"
    log_path = work / f"server_{name}.log"
    result: dict = {"argv": argv}
    env = {**os.environ, **extra_env}
    started = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        while not http_ok(url):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} SGLang exited {proc.returncode}: {tail(log_path)}")
            if time.monotonic() - started > args.health_s:
                raise RuntimeError(f"{name} SGLang not healthy in {args.health_s:g}s")
            time.sleep(0.5)
        result["startup_s"] = round(time.monotonic() - started, 1)
        log(f"{name}: healthy after {result['startup_s']}s")
        asyncio.run(send_rows(url, warmup, args.bare_inflight, "warm"))
        offset = log_path.stat().st_size
        with GpuUtilisation() as gpu:
            timed = asyncio.run(send_rows(url, rows, args.bare_inflight, name))
        tokens = sum(len(r) for r in rows)
        result.update(timed)
        result.update(gpu.summary())
        result["tokens"] = tokens
        result["tokens_per_s"] = round(tokens / timed["seconds"], 1)
        time.sleep(0.5)
        result["prefill"] = batch_summary(prefill_batches(log_between(log_path, offset)))
        if timed["answered"] != len(rows):
            answered = f"{timed['answered']}/{len(rows)}"
            raise RuntimeError(f"{name}: {answered} answered: {timed['errors']}")
    finally:
        stop_group(proc)
        result["server_log_tail"] = tail(log_path, 15)
    return result


def batch_summary(batches: list[dict]) -> dict:
    """SGLang's prefill batches: count, size, and per-batch time from its own rate."""
    if not batches:
        return {"batches": 0}
    tokens = sum(b["tokens"] for b in batches)
    rated = [b for b in batches if b["tokens_per_s"]]
    per_ktok = sorted(1e6 / b["tokens_per_s"] for b in rated)  # ms per 1k tokens
    return {
        "batches": len(batches),
        "tokens": tokens,
        "seqs_per_batch": round(sum(b["seqs"] for b in batches) / len(batches), 2),
        "tokens_per_batch": round(tokens / len(batches), 1),
        "log_tokens_per_s_weighted": round(
            sum(b["tokens"] * b["tokens_per_s"] for b in rated)
            / max(1, sum(b["tokens"] for b in rated)),
            1,
        ),
        "ms_per_1k_tokens_median": round(per_ktok[len(per_ktok) // 2], 3) if per_ktok else None,
    }


# ----------------------------------------------------------------------------- the pipeline


def hook_stats(text: str) -> dict | None:
    found = HOOK_LINE.findall(text)
    if not found:
        return None
    batches, requests, tokens, mean_ms, max_ms = found[-1]
    return {"batches": int(batches), "requests": int(requests), "tokens": int(tokens),
            "mean_ms": float(mean_ms), "max_ms": float(max_ms)}  # fmt: skip


def hook_delta(now: dict | None, before: dict | None) -> dict | None:
    """This run's share of the hook's cumulative line (the server served earlier runs too);
    the max is the server's so far."""
    if now is None or before is None:
        return now
    batches = now["batches"] - before["batches"]
    if batches <= 0:
        return None
    total_ms = now["mean_ms"] * now["batches"] - before["mean_ms"] * before["batches"]
    return {
        "batches": batches,
        "requests": now["requests"] - before["requests"],
        "tokens": now["tokens"] - before["tokens"],
        "mean_ms": round(total_ms / batches, 3),
        "max_ms": now["max_ms"],
    }


def variant_settings(args) -> list[tuple[str, int, str, int]]:
    """The pipeline runs of one call: each storage at each in-flight requests, dump GiB and
    chunk writeback value, in order."""
    return [
        (storage, n, gb, mb)
        for storage in args.storages
        for n in args.inflight_variants
        for gb in args.inflight_gb_variants
        for mb in args.writeback_variants
    ]


def variant_name(storage: str, inflight: int, gb: str, writeback_mb: int, args) -> str:
    """`shm` / `disk` for the first values (what the ratios use); after them `shm@32`,
    `disk@64/auto` where the dump bound differs, `disk@64/wb0` where the chunk writeback does."""
    firsts = (args.inflight_variants[0], args.inflight_gb_variants[0], args.writeback_variants[0])
    if (inflight, gb, writeback_mb) == firsts:
        return storage
    suffix = "" if gb == args.inflight_gb_variants[0] else f"/{gb}"
    suffix += "" if writeback_mb == args.writeback_variants[0] else f"/wb{writeback_mb}"
    return f"{storage}@{inflight}{suffix}"


def run_pipeline(run_dir: Path, config: dict, rows, warmup, args, deadline) -> dict:
    from eaglepipe.core.run import resolve
    from eaglepipe.plan.provenance import shards
    from eaglepipe.server.lifecycle.shared_server import start_server, stop_server

    result: dict = {"variants": {}}
    tokens = sum(len(r) for r in rows)
    config = json.loads(json.dumps(config))
    config["server"]["port"] = free_port()  # the bare server's may linger in TIME_WAIT
    previous_hook: dict | None = None
    with working_directory(run_dir):
        try:
            started = time.monotonic()
            handle = start_server(resolve(config))
            result["startup_s"] = round(time.monotonic() - started, 1)
            result["engine_version"] = handle.info.get("engine_version")
            result["capture_layer_ids"] = handle.info.get("sglang_capture_layer_ids")
            log(f"pipeline: SGLang {result['engine_version']} healthy after {result['startup_s']}s")
            asyncio.run(send_rows(handle.url, warmup, args.bare_inflight, "warm"))
            names = shards(resolve(config))
            result["shards"] = len(names)
            for storage, inflight, gb, writeback_mb in variant_settings(args):
                name = variant_name(storage, inflight, gb, writeback_mb, args)
                left = deadline - time.monotonic()
                entry = {"storage": storage, "inflight_per_job": inflight, "inflight_gb": gb,
                         "chunk_writeback_mb": writeback_mb}  # fmt: skip
                result["variants"][name] = entry
                if left < 45:
                    entry["skipped"] = f"not run: {max(left, 0):.0f} s of the budget left (45)"
                    continue
                config["extract"]["max_inflight_requests"] = inflight
                config["extract"]["max_inflight_bytes"] = max_inflight_bytes(gb)
                config["extract"]["chunk_writeback_mb"] = writeback_mb
                shm_dir = chunk_storage(run_dir, storage)
                try:
                    offset = handle.log_path.stat().st_size
                    with GpuUtilisation() as gpu:
                        t0 = time.perf_counter()
                        manifests = shard_jobs_in_parallel(
                            run_dir, config, names, args.parallel_shards,
                            finish=verify_and_delete if args.verify_delete else None,
                        )  # fmt: skip
                        seconds = time.perf_counter() - t0
                    time.sleep(0.5)  # SGLang logs a prefill batch after running it
                    text = log_between(handle.log_path, offset)
                    written = sum(m["num_tokens"] for m in manifests)
                    if written != tokens:
                        raise RuntimeError(f"the shards hold {written} tokens, the rows {tokens}")
                    job_seconds = sum(m["timing"]["seconds"] for m in manifests)
                    windows = [m["job_window"] for m in manifests]
                    # The first job's start to the last job's exit: the run without the
                    # verification of the last shard (--verify-delete), which follows it.
                    span = max(end for _, end in windows) - min(start for start, _ in windows)
                    entry.update(
                        seconds=round(seconds, 3),
                        tokens=tokens,
                        tokens_per_s=round(tokens / seconds, 1),
                        jobs_span_s=round(span, 3),
                        jobs_span_tokens_per_s=round(tokens / span, 1),
                        bytes_written=sum(m["num_bytes"] for m in manifests),
                        chunks=sum(len(m["chunks"]) for m in manifests),
                        prefill=batch_summary(prefill_batches(text)),
                        hook=hook_delta(hook_stats(text), previous_hook),
                        client_breakdown_s={
                            key: round(sum(m["timing"].get(key, 0.0) for m in manifests), 3)
                            for key in BREAKDOWN_KEYS
                        },
                        job_seconds_in_extract=round(job_seconds, 3),
                        # Job time outside extract_shard: interpreter start, imports, lease.
                        job_startup_s=round(
                            sum(m["job_wall_s"] for m in manifests) - job_seconds, 3
                        ),
                        # From the manifests: each job's process start to its first request.
                        first_request=first_request_summary(manifests),
                        shard_tokens=[m["num_tokens"] for m in manifests],
                        # Steady state (every job slot busy) apart from start, turnover, tail.
                        by_jobs_alive=split_by_jobs_alive(
                            windows, gpu.points, prefill_timeline(text)
                        ),
                        **gpu.summary(),
                    )  # fmt: skip
                    if args.verify_delete:
                        checked = [m["verified"] for m in manifests]
                        entry["verified"] = {
                            "shards": len(checked),
                            "chunks": sum(v["chunks"] for v in checked),
                            "gb": round(sum(v["bytes"] for v in checked) / 1e9, 2),
                            "seconds": round(sum(v["seconds"] for v in checked), 1),
                        }
                    entry["chunk_gb_per_s"] = round(entry["bytes_written"] / seconds / 1e9, 3)
                    previous_hook = hook_stats(text) or previous_hook
                    log(f"pipeline ({name}): {entry['tokens_per_s']:,.0f} tok/s, "
                        f"{entry['chunk_gb_per_s']} GB/s of chunks")  # fmt: skip
                except Exception as exc:  # the next storage still runs
                    traceback.print_exc()
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                finally:
                    if shm_dir is not None:
                        shutil.rmtree(shm_dir, ignore_errors=True)
        finally:
            stop_server()
            logs = sorted((run_dir / "logs" / "server").glob("*.log"))
            if logs:
                text = logs[-1].read_text(errors="replace")
                result["server_log"] = str(logs[-1])
                result["server_log_tail"] = text.splitlines()[-15:]
                result["plugin_lines"] = [
                    ln[:300] for ln in text.splitlines() if "[eaglepipe sglang plugin]" in ln
                ][:6]
            shutil.rmtree(config["server"]["dump_root"], ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- summary


def summarise(results: dict) -> None:
    bare = results.get("bare", {}).get("tokens_per_s")
    variants = results.get("pipeline", {}).get("variants", {})
    shm = variants.get("shm", {}).get("tokens_per_s")
    disk = variants.get("disk", {}).get("tokens_per_s")
    raw_disk = results.get("raw_write", {}).get("disk", {}).get("gb_per_s")
    # The disk's raw rate in tokens of the first store (the one `disk` ran with).
    shape = {"hidden": results["setup"]["hidden"]}
    first_store = results["setup"].get("store_dtypes", ["bf16"])[0]
    per_token = token_bytes(shape, first_store)
    disk_tokens_per_s = raw_disk * 1e9 / per_token if raw_disk else None
    ceiling = (
        min(v for v in (bare, disk_tokens_per_s) if v) if (bare or disk_tokens_per_s) else None
    )
    results["ratios"] = {
        "bare_capture_vs_bare": ratio(results.get("bare_capture", {}).get("tokens_per_s"), bare),
        "shm_vs_bare": ratio(shm, bare),
        "disk_vs_bare": ratio(disk, bare),
        "disk_tokens_per_s_raw": round(disk_tokens_per_s, 1) if disk_tokens_per_s else None,
        "disk_vs_ceiling": ratio(disk, ceiling),
    }
    for name, entry in variants.items():
        results["ratios"][f"{name}_vs_bare"] = ratio(entry.get("tokens_per_s"), bare)
        results["ratios"][f"{name}_jobs_span_vs_bare"] = ratio(
            entry.get("jobs_span_tokens_per_s"), bare
        )
        if entry.get("storage") == "disk" and raw_disk:
            # The disk's raw rate in this store's tokens: an FP8 store writes fewer bytes.
            store = entry.get("store", first_store)
            store_tokens_per_s = raw_disk * 1e9 / token_bytes(shape, store)
            results["ratios"][f"{name}_vs_ceiling"] = ratio(
                entry.get("tokens_per_s"), min(v for v in (bare, store_tokens_per_s) if v)
            )
        parallel = str(results["setup"]["parallel_shards"])
        steady = (entry.get("by_jobs_alive") or {}).get(parallel)
        if steady and steady["prefill_tokens"]:
            # The server's rate while every job slot is busy: what a run of many shards
            # approaches once jobs no longer start and end together.
            results["ratios"][f"{name}_steady_vs_bare"] = ratio(
                steady["prefill_tokens_per_s"], bare
            )
    bare_ms = (results.get("bare", {}).get("prefill") or {}).get("ms_per_1k_tokens_median")
    for entry in variants.values():
        pipe = entry.get("prefill") or {}
        if not (bare_ms and entry.get("seconds")):
            continue
        # The forward time these tokens take at the bare server's per-token rate (SGLang's
        # own per-batch measure), over the wall time: the server's busy share.
        entry["server_busy_share_est"] = round(
            min(1.0, entry["tokens"] * bare_ms / 1e6 / entry["seconds"]), 3
        )
        if pipe.get("ms_per_1k_tokens_median"):
            # What a prefill batch of this run's mean size took longer than a bare one.
            extra = (pipe["ms_per_1k_tokens_median"] - bare_ms) * pipe["tokens_per_batch"] / 1e3
            entry["batch_ms_over_bare_est"] = round(extra, 3)
    results["goals"] = {
        "shm_vs_bare": {"goal": GOALS["shm_vs_bare"], "at_least": GOALS["shm_vs_bare_at_least"],
                        "measured": results["ratios"]["shm_vs_bare"]},
        "disk_vs_ceiling": {"goal": GOALS["disk_vs_ceiling"],
                            "measured": results["ratios"]["disk_vs_ceiling"]},
    }  # fmt: skip


def inflight_gb_label(entry: dict) -> str:
    gb = entry.get("inflight_gb", "2")  # runs before 2026-12-05 all bounded dumps at 2 GiB
    return "a quarter of the handoff" if gb == "auto" else f"<= {gb} GiB a job"


def writeback_label(entry: dict) -> str:
    mb = entry.get("chunk_writeback_mb", 64)  # every run from 03ab4f1 (2026-12-05) to here
    return "left to the kernel" if mb == 0 else f"handed to the disk every {mb} MiB"


def report(results: dict) -> str:
    bare = results.get("bare", {})
    rows = [["SGLang bare prefill (no hook, no capture)", bare.get("tokens"), bare.get("seconds"),
             bare.get("tokens_per_s"), 1.0 if bare.get("tokens_per_s") else None,
             bare.get("gpu_util_mean_pct"), (bare.get("prefill") or {}).get("tokens_per_batch"),
             "", bare.get("error", "")]]  # fmt: skip
    if "bare_capture" in results:
        capture = results["bare_capture"]
        rows.append(["SGLang with the capture, no hook (--bare-capture)", capture.get("tokens"),
                     capture.get("seconds"), capture.get("tokens_per_s"),
                     ratio(capture.get("tokens_per_s"), bare.get("tokens_per_s")),
                     capture.get("gpu_util_mean_pct"),
                     (capture.get("prefill") or {}).get("tokens_per_batch"), "",
                     capture.get("error", "")])  # fmt: skip
    for name, entry in results.get("pipeline", {}).get("variants", {}).items():
        hook = entry.get("hook") or {}
        rows.append([
            f"pipeline: hook + {results['setup']['parallel_shards']} shard jobs x "
            f"{entry.get('inflight_per_job')} in flight (dumps {inflight_gb_label(entry)}), "
            f"chunks on {entry.get('storage', name)} ({writeback_label(entry)}), "
            f"store {entry.get('store', results['setup'].get('store_dtypes', ['bf16'])[0])}",
            entry.get("tokens"), entry.get("seconds"), entry.get("tokens_per_s"),
            ratio(entry.get("tokens_per_s"), bare.get("tokens_per_s")),
            entry.get("gpu_util_mean_pct"), (entry.get("prefill") or {}).get("tokens_per_batch"),
            f"{hook.get('mean_ms')} / {hook.get('max_ms')}" if hook else "",
            entry.get("error", entry.get("skipped", "")),
        ])  # fmt: skip
    raw = results.get("raw_write", {})
    ratios = results.get("ratios", {})
    goal_rows = [
        ["pipeline on tmpfs / bare", ratios.get("shm_vs_bare"), ">= 0.95 (0.90 at least)"],
        ["the same, first job's start to last job's exit", ratios.get("shm_jobs_span_vs_bare"), ""],
        ["pipeline on disk / min(bare, disk)", ratios.get("disk_vs_ceiling"), ">= 0.95"],
        [
            "the same, first job's start to last job's exit",
            ratios.get("disk_jobs_span_vs_bare"),
            "",
        ],
        ["raw writes, disk (GB/s)", (raw.get("disk") or {}).get("gb_per_s"), ""],
        ["raw writes, /dev/shm (GB/s)", (raw.get("shm") or {}).get("gb_per_s"), ""],
    ]
    breakdown_rows = []
    for name, entry in results.get("pipeline", {}).get("variants", {}).items():
        br = entry.get("client_breakdown_s", {})
        breakdown_rows.append([name, entry.get("server_busy_share_est"),
                               entry.get("batch_ms_over_bare_est"),
                               entry.get("job_seconds_in_extract"),
                               entry.get("job_startup_s"),
                               *[br.get(k) for k in BREAKDOWN_KEYS]])  # fmt: skip
    start_rows = [
        [name, first.get("shards"), first.get("median_s"), first.get("max_s"),
         first.get("entered_median_s"), first.get("lease_asked_median_s"),
         first.get("leased_median_s"),
         ", ".join(f"{via} {n}" for via, n in (first.get("lease_via") or {}).items())]
        for name, entry in results.get("pipeline", {}).get("variants", {}).items()
        if (first := entry.get("first_request"))
    ]  # fmt: skip
    alive_rows = [
        [name, alive, group["seconds"], group["prefill_tokens"], group["prefill_tokens_per_s"],
         ratio(group["prefill_tokens_per_s"], bare.get("tokens_per_s")),
         group["gpu_util_mean_pct"]]
        for name, entry in results.get("pipeline", {}).get("variants", {}).items()
        for alive, group in (entry.get("by_jobs_alive") or {}).items()
    ]  # fmt: skip
    setup = results["setup"]
    version = results.get("pipeline", {}).get("engine_version")
    return (
        f"### SGLang extraction vs SGLang bare prefill ({setup['shape']} shape, {setup['rows']} "
        f"rows, {setup['tokens']:,} tokens, SGLang {version})\n\n"
        + markdown_table(
            [
                "run",
                "tokens",
                "s",
                "tok/s",
                "x bare",
                "GPU util %",
                "tokens/prefill",
                "hook ms/batch (mean / max)",
                "note",
            ],
            rows,
        )  # fmt: skip
        + "\n"
        + markdown_table(["ratio", "measured", "goal"], goal_rows)
        + "\n"
        + markdown_table(
            [
                "chunks on",
                "server busy (est.)",
                "ms/batch over bare (est.)",
                "job s in extract",
                "job start-up s",
                *BREAKDOWN_KEYS,
            ],
            breakdown_rows,
        )  # fmt: skip
        + "\nJobs' first request (seconds from each job's process start; medians of its steps):\n\n"
        + markdown_table(
            [
                "variant",
                "jobs",
                "median",
                "max",
                "library entered",
                "lease asked",
                "leased",
                "lease had the info by",
            ],
            start_rows,
        )  # fmt: skip
        + "\nBy shard jobs alive (whole seconds; prefill tokens from SGLang's log):\n\n"
        + markdown_table(
            ["variant", "jobs alive", "s", "prefill tokens", "tok/s", "x bare", "GPU util %"],
            alive_rows,
        )
        + f"\nCommand: `{results['command']}`\n"
    )


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    deadline = time.monotonic() + args.deadline_s
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    shape_name = "tiny" if args.tiny else "8b"
    shape = SHAPES[shape_name]
    os.environ.setdefault("EAGLEPIPE_HOOK_STATS_EVERY", "8")  # hook cost lines in the log
    work = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-sglang-", dir=args.work_root))
    rows = seeded_rows(args.tokens, args.min_len, args.max_len, shape["vocab"], args.seed)
    warmup = seeded_rows(1, args.min_len, args.max_len, shape["vocab"], args.seed + 1)
    warmup = (warmup * WARMUP_ROWS)[:WARMUP_ROWS]
    results: dict = {
        "benchmark": "sglang_extraction",
        "command": command_line(),
        "machine": machine_info(device),
        "setup": {
            "shape": shape_name,
            **shape,
            "rows": len(rows),
            "tokens": sum(len(r) for r in rows),
            "min_len": args.min_len,
            "max_len": args.max_len,
            "seed": args.seed,
            "parallel_shards": args.parallel_shards,
            "inflight_per_job": args.inflight_requests,
            "inflight_variants": args.inflight_variants,
            "inflight_gb_variants": args.inflight_gb_variants,
            "chunk_writeback_mb_variants": args.writeback_variants,
            "bare_inflight": args.bare_inflight,
            "shard_gb": args.shard_gb,
            "chunk_mb": args.chunk_mb,
            "sglang_extra_args": SGLANG_EXTRA_ARGS,
            "shard_tokens": args.shard_tokens,
            "verify_delete": args.verify_delete,
            "bare_fraction": args.bare_fraction,
            "store_dtypes": args.store_variants,
        },  # fmt: skip
        "plan": storage_plan(args),
        "bytes_per_token": bytes_per_token(args.store_variants),
    }
    for line in bytes_per_token_lines(results["bytes_per_token"]):
        log(line)
    plan = results["plan"]
    log(
        f"plan: {plan['shards']} shards of {plan['shard_gb']} GB, peak {plan['peak_gb']} GB "
        f"(fits: {plan['fits']}), about {plan['estimated_s']} s (fits the call: "
        f"{plan['fits_call']})"
    )
    if not plan["fits"] and args.engine == "sglang":
        # Refused before anything is built, dry runs included (they plan the GPU run): a run
        # that fills /dev/shm or the disk fails minutes into a device call.
        over = ", ".join(
            f"{storage} {plan['peak_gb'][storage]} GB of its {plan['room_gb'][storage]} GB"
            for storage in plan["peak_gb"]
            if plan["peak_gb"][storage] > plan["room_gb"][storage]
        )
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(
            f"benchmarks.speed.sglang_extraction: the run does not fit the lent machine ({over} at "
            "once): fewer --tokens, smaller --shard-tokens, fewer --parallel-shards or a lower "
            "--inflight-gb"
        )
    code = 0
    config = None
    try:
        results["raw_write"] = {}
        for name, directory in (("disk", work), ("shm", Path("/dev/shm"))):
            if name == "shm" and shm_free_gb() < 2 * args.raw_gb:
                continue
            results["raw_write"][name] = raw_write(directory, args.raw_gb)
            log(f"raw writes to {name}: {results['raw_write'][name]['gb_per_s']} GB/s")
        on_shm = plan["model_on"] == "shm" and shm_free_gb() > model_bytes(shape) / 1e9 + 8
        model_parent = Path("/dev/shm") if on_shm and not args.tiny else work
        model_dir = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-model-", dir=model_parent))
        t0 = time.monotonic()
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = random_llama(device, dtype, seed=0, **shape)
        model.save_pretrained(model_dir, max_shard_size="5GB")
        save_word_tokenizer(model_dir, shape["vocab"])
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        results["setup"]["model_build_and_save_s"] = round(time.monotonic() - t0, 1)
        results["setup"]["model_dir"] = str(model_dir)
        run_dir = work / "run"
        run_dir.mkdir()
        rows_per_shard = rows_per_shard_for(rows, args, shape)
        dataset = write_prepared(run_dir, rows, rows_per_shard=rows_per_shard)
        config = pipeline_config(run_dir, model_dir, dataset, rows_per_shard, args)
        if args.dry_run:
            from eaglepipe.server.sglang.recipe import launch_command

            results["bare"] = {"argv": bare_command(config, args.sglang_version)[0],
                               "env": bare_command(config, args.sglang_version)[1]}  # fmt: skip
            if args.bare_capture:
                argv, env = bare_command(config, args.sglang_version, capture=True)
                results["bare_capture"] = {"argv": argv, "env": env}
            from eaglepipe.core.run import resolve

            argv, env = launch_command(
                resolve(config), host="127.0.0.1", port=config["server"]["port"],
                dump_dir=Path(config["server"]["dump_root"]) / "x", instance_id="dry-run",
                sglang_version=args.sglang_version,
            )  # fmt: skip
            from eaglepipe.plan.provenance import shards

            with working_directory(run_dir):
                names = shards(resolve(config))
            results["pipeline"] = {"argv": argv, "env": {k: v for k, v in env.items()
                                                         if k != "PYTHONPATH"},
                                   "shards": len(names), "variants": {}}  # fmt: skip
            # What each store's server is told: the hook's config quantizes on the GPU.
            results["pipeline"]["stores"] = {}
            for store in args.store_variants:
                argv, _ = launch_command(
                    resolve(with_store(config, store)), host="127.0.0.1",
                    port=config["server"]["port"],
                    dump_dir=Path(config["server"]["dump_root"]) / "x", instance_id="dry-run",
                    sglang_version=args.sglang_version,
                )  # fmt: skip
                hook = json.loads(argv[argv.index("--forward-hooks") + 1])[0]["config"]
                results["pipeline"]["stores"][store] = {
                    "extract.store": STORE_VARIANTS[store],
                    "hook_config_store": hook.get("store", "absent: bf16"),
                }
                log(f"store {store}: the hook's config store {hook.get('store', 'absent: bf16')}")
        else:
            try:
                if args.engine == "sglang":
                    bare_rows = rows[: max(1, round(len(rows) * args.bare_fraction))]
                    results["bare"] = run_bare(config, bare_rows, warmup, args, work)
                    log(f"bare: {results['bare']['tokens_per_s']:,.0f} tok/s")
                else:
                    results["bare"] = {"skipped": "the reference engine has no bare server"}
            except Exception as exc:
                traceback.print_exc()
                results["bare"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                code = 1
            if args.bare_capture and args.engine == "sglang":
                try:
                    results["bare_capture"] = run_bare(
                        config, bare_rows, warmup, args, work, name="bare_capture", capture=True
                    )
                    log(f"bare_capture: {results['bare_capture']['tokens_per_s']:,.0f} tok/s")
                except Exception as exc:
                    traceback.print_exc()
                    results["bare_capture"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                    code = 1
            write_results(args.out, results)
            for index, store in enumerate(args.store_variants):
                try:
                    run = run_pipeline(
                        run_dir, with_store(config, store), rows, warmup, args, deadline
                    )
                except Exception as exc:
                    traceback.print_exc()
                    run = {"error": f"{type(exc).__name__}: {exc}"[:2000], "variants": {}}
                    code = 1
                if index == 0:
                    results["pipeline"] = run
                else:
                    merge_store_run(results, store, run)
                write_results(args.out, results)
            if any("error" in v for v in results["pipeline"].get("variants", {}).values()):
                code = 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if config is not None:
            shutil.rmtree(config["server"]["dump_root"], ignore_errors=True)
        if "model_dir" in results["setup"]:
            shutil.rmtree(results["setup"]["model_dir"], ignore_errors=True)
    summarise(results)
    markdown = report(results)
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    return code


if __name__ == "__main__":
    sys.exit(main())

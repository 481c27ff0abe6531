#!/usr/bin/env python3
"""Extraction at the speed of the prefill: four ways over the same rows, in one run.

Builds a Llama target of the Llama-3.1-8B shape with random bf16 weights directly on the GPU
(no download), saves it once as a local checkpoint (the reference server loads a model
directory), and generates seeded token rows of 512-4096 tokens (uniform, mean ~2300). Then:

- (a) bare: the in-process model over the batches the server forms (rows sorted by length,
  right-padded, at most --max-batch-tokens padded tokens per batch), no capture: the ceiling.
- (b) server: the real reference server (started by the real lifecycle) and the real client
  (`eaglepipe.extract.shard.extract_shard`) writing real checksummed chunks and manifests from a
  prepared table of the same rows. Shards are deleted once done so the disk holds one at a time.
- (c) per-sample: what common scripts do: one sample per forward with
  `output_hidden_states=True`, the aux and final layers moved to the host and `torch.save`d per
  sample (on a seeded subset of the rows: it is slow).
- (d) packed (stretch): the rows packed into --max-batch-tokens-long rows with per-row
  `position_ids`, so transformers' `flex_attention` builds a block-diagonal causal mask and no
  padding is computed; checked against a single-row forward (no attention across rows).

Ratios b/a (goal >= 0.90), b/c (goal >= 3.2) and d/a are printed and written, with the
machine, to --out (JSON) and the .md beside it.

    python -u -m benchmarks.speed.extraction --out benchmarks/results/extraction.json  # GPU
    python -u -m benchmarks.speed.extraction --tiny --out /tmp/extraction.json        # CPU check
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    REPO_ROOT,
    command_line,
    free_port,
    log,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    timed,
    working_directory,
    write_results,
)
from benchmarks.speed.shard_runs import BREAKDOWN_KEYS, GpuUtilisation, shard_jobs_in_parallel
from benchmarks.speed.storage import chunk_storage
from benchmarks.toy_targets.llama import random_llama
from benchmarks.toy_targets.rows import seeded_rows, write_prepared
from eaglepipe.core.layers import default_aux_layer_ids  # noqa: E402

SHAPES = {
    # Llama-3.1-8B
    "8b": dict(
        hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, max_pos=8192
    ),
    # The toy target's shape: a CPU quick check of every path.
    "tiny": dict(
        hidden=64, layers=8, heads=4, kv_heads=2, intermediate=176, vocab=512, max_pos=2048
    ),
}
GOALS = {"server_vs_bare": 0.90, "server_vs_per_sample": 3.2}
# Unprefixed requests (not dumped) the server answers before timing: about two 32k batches.
WARMUP_REQUESTS = 24
PATHS = ("bare_prefill", "server_end_to_end", "per_sample_baseline", "packed_flex")


def rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else float("nan")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy shape, few rows, CPU sizes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--tokens", type=int, default=None, help="total tokens (8B: 1.2M)")
    parser.add_argument("--min-len", type=int, default=None, help="shortest row (8B: 512)")
    parser.add_argument("--max-len", type=int, default=None, help="longest row (8B: 4096)")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="8B: 32768")
    parser.add_argument(
        "--baseline-fraction", type=float, default=None, help="rows the per-sample path runs"
    )
    parser.add_argument("--flex", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--chunk-mb", type=float, default=None, help="chunk bound (8B: 2048)")
    parser.add_argument("--shard-gb", type=float, default=10.0, help="bound on one shard's size")
    parser.add_argument("--inflight-requests", type=int, default=64)
    parser.add_argument(
        "--parallel-shards",
        type=int,
        default=1,
        help="shard jobs at once against the one server, as `snakemake --cores N` runs them",
    )
    parser.add_argument(
        "--server-attention",
        choices=["auto", "packed", "padded"],
        default="auto",
        help="the reference server's batch layout (config server.attention)",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        metavar="LAYOUT:SHARDS:STORAGE",
        help="more runs of path (b), e.g. padded:1:disk auto:3:shm (storage disk = the scratch "
        "dir, shm = chunks on /dev/shm): the headline (b) uses --server-attention, "
        "--parallel-shards and disk",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-root", default=None, help="scratch parent dir (default: /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir")
    parser.add_argument("--out", default=None, help="results JSON (markdown beside it)")
    args = parser.parse_args(argv)
    tiny = args.tiny
    defaults = {
        "tokens": 3000 if tiny else 1_200_000,
        "min_len": 16 if tiny else 512,
        "max_len": 160 if tiny else 4096,
        "max_batch_tokens": 512 if tiny else 32768,
        "baseline_fraction": 0.5 if tiny else 0.2,
        "chunk_mb": 0.05 if tiny else 2048.0,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if tiny:
        args.shard_gb = min(args.shard_gb, 0.1)
    return args


# ----------------------------------------------------------------------------- target and rows


def build_target(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """A random-weight Llama, created directly on the device in the target dtype."""
    return random_llama(device, dtype, seed=seed, **shape)


def save_target(model, model_dir: Path) -> None:
    """The checkpoint the server loads, plus a tokenizer file (provenance fingerprints it)."""
    from tokenizers import Tokenizer, models

    model.save_pretrained(model_dir, max_shard_size="5GB")
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(
        str(model_dir / "tokenizer.json")
    )


def make_rows(args, vocab: int) -> list[np.ndarray]:
    """Seeded rows of uniform length in [min_len, max_len] until --tokens is reached."""
    return seeded_rows(args.tokens, args.min_len, args.max_len, vocab, args.seed)


def server_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices per batch as the server forms them at best: sorted by length, padded
    tokens (longest x count) within the budget."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and lengths[i] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing into rows of `capacity` tokens."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= lengths[i]
    return bins


# ----------------------------------------------------------------------------- (a) bare


def padded_forward(model, seqs: list[np.ndarray], device: torch.device) -> None:
    longest = max(len(s) for s in seqs)
    input_ids = torch.zeros((len(seqs), longest), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.from_numpy(seq)
        attention_mask[row, : len(seq)] = 1
    model(
        input_ids=input_ids.to(device, non_blocking=True),
        attention_mask=attention_mask.to(device, non_blocking=True),
        use_cache=False,
        logits_to_keep=1,
    )


def run_bare(model, rows, batches, device) -> dict:
    real = sum(len(r) for r in rows)
    padded = sum(max(len(rows[i]) for i in b) * len(b) for b in batches)
    with torch.inference_mode():
        padded_forward(model, [rows[i] for i in batches[-1]], device)  # warm-up: longest rows
        with timed(device) as t:
            for batch in batches:
                padded_forward(model, [rows[i] for i in batch], device)
    return {
        "tokens": real,
        "seconds": round(t["seconds"], 3),
        "tokens_per_s": round(rate(real, t["seconds"]), 1),
        "batches": len(batches),
        "padded_tokens": padded,
        "padding_fraction": round(1 - real / padded, 4),
    }


# ----------------------------------------------------------------------------- (b) server


def handoff_root(work: Path, need_bytes: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 4 * need_bytes:
        return Path(tempfile.mkdtemp(prefix="eaglepipe-bench-dumps-", dir=shm))
    return work / "dumps"


def make_run_dir(run_dir: Path, model_dir: Path, rows, args, shape, device: str) -> dict:
    """A run directory as the pipeline sees it: dataset, prepared table, summary, config."""
    from eaglepipe.core.config import validate_config
    from eaglepipe.core.config_files import load_config

    token_bytes = 4 * shape["hidden"] * 2  # three aux layers and the final one, bf16
    row_bytes = token_bytes * args.tokens / len(rows)
    rows_per_shard = max(1, min(len(rows), int(args.shard_gb * 1e9 / row_bytes)))
    if args.tiny:
        rows_per_shard = max(1, len(rows) // 2)  # two shards: the between-shard path runs too
    dataset = write_prepared(run_dir, rows, rows_per_shard=rows_per_shard)
    dumps = handoff_root(run_dir, args.max_batch_tokens * token_bytes)
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["dataset"]["path"] = str(dataset)
    config["shards"].update(
        rows_per_shard=rows_per_shard, chunk_max_bytes=max(4096, int(args.chunk_mb * 2**20))
    )
    config["server"].update(
        port=free_port(),
        device=device,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        max_batch_tokens=args.max_batch_tokens,
        dump_root=str(dumps),
        health_timeout_s=900,
        idle_timeout_s=120,
    )
    handoff_free = shutil.disk_usage(dumps if dumps.exists() else run_dir).free
    config["extract"].update(
        max_inflight_requests=args.inflight_requests,
        max_inflight_bytes=int(max(64 << 20, min(8 << 30, handoff_free // 4))),
    )
    return validate_config(config)


def parse_variant(spec: str) -> tuple[str, int, str]:
    try:
        layout, jobs, storage = spec.split(":")
        if layout not in ("auto", "packed", "padded") or storage not in ("disk", "shm"):
            raise ValueError
        return layout, int(jobs), storage
    except ValueError:
        raise SystemExit(
            f"--variants {spec!r}: expected LAYOUT:SHARDS:STORAGE, e.g. padded:1:disk"
        ) from None


def warm_up_server(url: str, rows, count: int) -> None:
    """Forward passes with unprefixed ids (not dumped) so kernels are chosen before timing."""

    def post(i: int) -> None:
        body = {
            "input_ids": rows[i].tolist(),
            "rid": f"warmup{i}",
            "sampling_params": {"max_new_tokens": 0},
        }
        request = urllib.request.Request(
            f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(post, range(min(count, len(rows)))))


def server_stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/stats", timeout=30) as response:
        return json.loads(response.read())


def stats_delta(before: dict, after: dict) -> dict:
    keys = ("tokens", "batches", "busy_s", "idle_s", "computed_tokens")
    delta = {key: round(after[key] - before[key], 3) for key in keys if key in after}
    if delta.get("busy_s", 0) + delta.get("idle_s", 0) > 0:
        delta["busy_share"] = round(delta["busy_s"] / (delta["busy_s"] + delta["idle_s"]), 4)
    if delta.get("computed_tokens"):
        delta["fill"] = round(delta["tokens"] / delta["computed_tokens"], 4)
    return delta


def run_server(
    run_dir: Path,
    config: dict,
    rows,
    parallel_shards: int = 1,
    attention: str = "auto",
    storage: str = "disk",
) -> dict:
    from eaglepipe.core.run import resolve
    from eaglepipe.extract.shard import extract_shard
    from eaglepipe.plan.provenance import shards
    from eaglepipe.server.lifecycle.shared_server import start_server, stop_server

    config = json.loads(json.dumps(config))
    config["server"].update(attention=attention, port=free_port())
    total = sum(len(r) for r in rows)
    result: dict = {"tokens": total, "attention": attention, "storage": storage}
    with working_directory(run_dir):
        shm_dir = chunk_storage(run_dir, storage)
        try:
            with timed() as start:
                handle = start_server(resolve(config))
            result["server_start_s"] = round(start["seconds"], 1)
            result["batch_layout"] = handle.info.get("batch_layout")
            result["attn_implementation"] = handle.info.get("attn_implementation")
            warm_up_server(handle.url, rows, WARMUP_REQUESTS)
            names = shards(resolve(config))
            seconds, manifests = 0.0, []
            stats_before = server_stats(handle.url)
            with GpuUtilisation() as gpu:
                if parallel_shards > 1:
                    with timed() as t:
                        manifests = shard_jobs_in_parallel(run_dir, config, names, parallel_shards)
                    seconds = t["seconds"]
                    log(
                        f"server: {len(names)} shards, {parallel_shards} at a time, "
                        f"in {seconds:.1f}s"
                    )
                    names = []  # measured above
                for name in names:
                    with timed() as t:
                        manifest = extract_shard(resolve(config), name)
                    seconds += t["seconds"]
                    manifests.append(manifest)
                    log(f"server: {name} {manifest['num_tokens']} tokens in {t['seconds']:.1f}s")
                    shutil.rmtree(run_dir / "hidden_states" / name)  # the disk holds one shard
            written = sum(m["num_tokens"] for m in manifests)
            bytes_written = sum(m["num_bytes"] for m in manifests)
            chunks = sum(len(m["chunks"]) for m in manifests)
            if written != total:
                raise RuntimeError(f"the shards hold {written} tokens, the rows {total}")
            result["server_stats"] = stats_delta(stats_before, server_stats(handle.url))
            result.update(gpu.summary())
            result["client_breakdown_s"] = {
                key: round(sum(m["timing"].get(key, 0.0) for m in manifests), 3)
                for key in BREAKDOWN_KEYS
            }
            result.update(
                seconds=round(seconds, 3),
                tokens_per_s=round(rate(total, seconds), 1),
                shards=len(shards(resolve(config))),
                parallel_shards=parallel_shards,
                chunks=chunks,
                bytes_written=bytes_written,
                chunk_gb_per_s=round(rate(bytes_written, seconds) / 1e9, 3),
                max_batch_tokens=config["server"]["max_batch_tokens"],
                max_inflight_requests=config["extract"]["max_inflight_requests"],
                max_inflight_bytes=config["extract"]["max_inflight_bytes"],
                chunk_max_bytes=config["shards"]["chunk_max_bytes"],
                rows_per_shard=config["shards"]["rows_per_shard"],
                dump_root=config["server"]["dump_root"],
            )
        finally:
            stop_server()
            if shm_dir is not None:
                shutil.rmtree(shm_dir, ignore_errors=True)
            logs = sorted((run_dir / "logs" / "server").glob("*.log"))
            if logs:
                result["server_log_tail"] = logs[-1].read_text(errors="replace").splitlines()[-12:]
            shutil.rmtree(config["server"]["dump_root"], ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- (c) per sample


def run_per_sample(model, rows, subset, aux_ids, device, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)

    def one(i: int, save: bool) -> None:
        ids = torch.from_numpy(rows[i]).long()[None].to(device)
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states
        sample = {
            "input_ids": ids[0].cpu(),
            "aux_hidden_states": torch.cat([hidden[k + 1][0] for k in aux_ids], dim=-1).cpu(),
            "final_hidden_states": hidden[-1][0].cpu(),
        }
        if save:
            torch.save(sample, out_dir / f"row_{i}.pt")

    tokens = sum(len(rows[i]) for i in subset)
    with torch.inference_mode():
        one(subset[0], save=False)  # warm-up
        with timed(device) as t:
            for i in subset:
                one(i, save=True)
    written = sum(p.stat().st_size for p in out_dir.glob("*.pt"))
    shutil.rmtree(out_dir)
    return {
        "rows": len(subset),
        "tokens": tokens,
        "seconds": round(t["seconds"], 3),
        "tokens_per_s": round(rate(tokens, t["seconds"]), 1),
        "bytes_written": written,
    }


# ----------------------------------------------------------------------------- (d) packed flex


def packed_inputs(rows, bin_rows: list[int], capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row: the rows end to end, each with positions from 0, and the tail padded to
    `capacity` as its own segment (a fixed shape keeps flex_attention from recompiling)."""
    ids = [torch.from_numpy(rows[i]).long() for i in bin_rows]
    positions = [torch.arange(len(rows[i])) for i in bin_rows]
    pad = capacity - sum(len(rows[i]) for i in bin_rows)
    if pad > 0:
        ids.append(torch.zeros(pad, dtype=torch.long))
        positions.append(torch.arange(pad))
    return torch.cat(ids)[None], torch.cat(positions)[None]


def set_attention(model, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        model.config._attn_implementation = name


def run_packed(model, rows, capacity: int, device) -> dict:
    lengths = [len(r) for r in rows]
    bins = pack_rows(lengths, capacity)
    previous = model.config._attn_implementation
    set_attention(model, "flex_attention")
    try:
        with torch.inference_mode():
            first_ids, first_pos = packed_inputs(rows, bins[0], capacity)
            with timed(device) as compile_t:  # the first call compiles the kernels
                model(
                    input_ids=first_ids.to(device),
                    position_ids=first_pos.to(device),
                    use_cache=False,
                    logits_to_keep=1,
                )
            check = packed_isolation_error(model, rows, bins[0], first_ids, first_pos, device)
            with timed(device) as t:
                for bin_rows in bins:
                    ids, positions = packed_inputs(rows, bin_rows, capacity)
                    model(
                        input_ids=ids.to(device, non_blocking=True),
                        position_ids=positions.to(device, non_blocking=True),
                        use_cache=False,
                        logits_to_keep=1,
                    )
    finally:
        set_attention(model, previous)
    real = sum(lengths)
    return {
        "tokens": real,
        "seconds": round(t["seconds"], 3),
        "tokens_per_s": round(rate(real, t["seconds"]), 1),
        "packed_rows": len(bins),
        "fill": round(real / (len(bins) * capacity), 4),
        "compile_s": round(compile_t["seconds"], 1),
        "isolation_rel_err": check,
    }


def packed_isolation_error(model, rows, bin_rows, ids, positions, device) -> float:
    """Relative L2 error of one packed row's final hidden states against the row alone: a mask
    that let rows see each other would show as an error near 1, not bf16 noise."""
    if len(bin_rows) < 2:
        return 0.0
    start = len(rows[bin_rows[0]])
    end = start + len(rows[bin_rows[1]])
    # No cache: transformers only reads packed rows from position_ids when there is none.
    packed = model.model(
        input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False
    )
    alone = model.model(
        input_ids=torch.from_numpy(rows[bin_rows[1]]).long()[None].to(device), use_cache=False
    )
    got = packed.last_hidden_state[0, start:end].float()
    want = alone.last_hidden_state[0].float()
    return round(float((got - want).norm() / want.norm()), 5)


# ----------------------------------------------------------------------------- report


def server_note(entry: dict) -> str:
    """Layout, shards at once, storage, server busy share, GPU use: where (b)'s time went."""
    if "batch_layout" not in entry:
        return ""
    stats = entry.get("server_stats", {})
    parts = [
        f"{entry['batch_layout']} ({entry.get('attn_implementation')})",
        f"{entry.get('parallel_shards')} shard(s) at once",
        f"chunks on {entry.get('storage')}",
        f"{entry.get('chunk_gb_per_s')} GB/s",
    ]
    if "busy_share" in stats:
        parts.append(f"forward busy {stats['busy_share']:.0%}")
    if "gpu_util_mean_pct" in entry:
        parts.append(f"GPU util {entry['gpu_util_mean_pct']:.0f}%")
    return ", ".join(parts)


def report(results: dict) -> str:
    paths = results["paths"]
    bare = paths["bare_prefill"].get("tokens_per_s")
    names = {
        "bare_prefill": "(a) bare prefill, server batches, no capture",
        "server_end_to_end": "(b) reference server + client -> checksummed chunks",
        "per_sample_baseline": "(c) per-sample, output_hidden_states, torch.save",
        "packed_flex": "(d) packed rows, block-diagonal flex_attention",
    }
    rows = []
    variants = [key for key in paths if key.startswith("server_end_to_end:")]
    for key in (*PATHS, *variants):
        entry = paths.get(key, {})
        note = entry.get("skipped") or entry.get("error") or server_note(entry)
        label = names.get(key) or f"(b) variant {key.split(':', 1)[1]} (layout:shards:storage)"
        rows.append(
            [
                label,
                entry.get("tokens"),
                entry.get("seconds"),
                entry.get("tokens_per_s"),
                ratio(entry.get("tokens_per_s"), bare),
                note[:120],
            ]
        )
    ratios = results["ratios"]
    goal_rows = [
        ["b/a (server / bare)", ratios["server_vs_bare"], f">= {GOALS['server_vs_bare']}"],
        ["b/c (server / per-sample)", ratios["server_vs_per_sample"], ">= 3.2"],
        ["d/a (packed / bare)", ratios["packed_vs_bare"], "> 1 (stretch)"],
        ["b/d (server / packed bare, when the server packs)", ratios["server_vs_packed"], ""],
    ]
    setup = results["setup"]
    return (
        f"### Extraction throughput ({setup['shape']} shape, {setup['rows']} rows, "
        f"{setup['tokens']:,} tokens, lengths {setup['min_len']}-{setup['max_len']}, "
        f"mean {setup['mean_len']:.0f}, {setup['max_batch_tokens']}-token batches)\n\n"
        + markdown_table(["path", "tokens", "s", "tok/s", "x bare", "note"], rows)
        + "\n"
        + markdown_table(["ratio", "measured", "goal"], goal_rows)
        + f"\nMachine: {machine_line(results['machine'])}.  \n"
        f"Command: `{results['command']}`\n"
    )


def summarise(results: dict) -> None:
    """Ratios and goals from the paths measured so far."""
    paths = results["paths"]
    tps = {key: paths.get(key, {}).get("tokens_per_s") for key in PATHS}
    results["ratios"] = {
        "server_vs_bare": ratio(tps["server_end_to_end"], tps["bare_prefill"]),
        "server_vs_per_sample": ratio(tps["server_end_to_end"], tps["per_sample_baseline"]),
        "packed_vs_bare": ratio(tps["packed_flex"], tps["bare_prefill"]),
        "server_vs_packed": ratio(tps["server_end_to_end"], tps["packed_flex"]),
    }
    results["goals"] = {
        key: {
            "goal": goal,
            "measured": results["ratios"][key],
            "met": results["ratios"][key] is not None and results["ratios"][key] >= goal,
        }
        for key, goal in GOALS.items()
    }


def guarded(name: str, results: dict, out: str | None, work) -> None:
    """Run one path; a failure is recorded and the others still run (one GPU run, four paths).
    The results so far are written after each path, so a run stopped by a time limit still
    leaves the paths it finished."""
    log(f"--- {name}")
    paths = results["paths"]
    try:
        paths[name] = work()
    except Exception as exc:  # the benchmark reports every path it could measure
        traceback.print_exc()
        paths[name] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"{name}: {json.dumps(paths[name])}")
    summarise(results)
    write_results(out, results)


def main(argv=None) -> int:
    args = parse_args(argv)
    # A SIGTERM (a timeout) unwinds like Ctrl-C, so the server started here is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape_name = "tiny" if args.tiny else "8b"
    shape = SHAPES[shape_name]
    aux_ids = default_aux_layer_ids(shape["layers"])
    work = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-extraction-", dir=args.work_root))
    rows = make_rows(args, shape["vocab"])
    lengths = [len(r) for r in rows]
    results: dict = {
        "benchmark": "extraction",
        "command": command_line(),
        "machine": machine_info(device),
        "setup": {
            "shape": shape_name,
            **shape,
            "dtype": str(dtype).removeprefix("torch."),
            "aux_layer_ids": aux_ids,
            "device": str(device),
            "rows": len(rows),
            "tokens": sum(lengths),
            "min_len": args.min_len,
            "max_len": args.max_len,
            "mean_len": round(float(np.mean(lengths)), 1),
            "max_batch_tokens": args.max_batch_tokens,
            "seed": args.seed,
        },
        "paths": {},
    }
    paths = results["paths"]
    log(
        f"{len(rows)} rows, {sum(lengths):,} tokens (mean {np.mean(lengths):.0f}) on {device}; "
        f"scratch {work}"
    )
    try:
        with timed(device) as t:
            model = build_target(shape, device, dtype, args.seed)
        results["setup"]["model_build_s"] = round(t["seconds"], 1)
        results["setup"]["attn_implementation"] = model.config._attn_implementation
        model_dir = work / "target"
        with timed() as t:
            save_target(model, model_dir)
        results["setup"]["model_save_s"] = round(t["seconds"], 1)
        log(f"target built and saved to {model_dir} ({results['setup']['model_save_s']}s)")

        batches = server_batches(lengths, args.max_batch_tokens)
        guarded("bare_prefill", results, args.out, lambda: run_bare(model, rows, batches, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # leave the memory to the server process

        run_dir = work / "run"
        config = make_run_dir(run_dir, model_dir, rows, args, shape, str(device))
        guarded(
            "server_end_to_end",
            results,
            args.out,
            lambda: run_server(run_dir, config, rows, args.parallel_shards, args.server_attention),
        )
        for spec in args.variants:
            layout, jobs, storage = parse_variant(spec)
            guarded(
                f"server_end_to_end:{spec}",
                results,
                args.out,
                functools.partial(run_server, run_dir, config, rows, jobs, layout, storage),
            )

        rng = np.random.default_rng(args.seed + 1)
        count = max(2, int(len(rows) * args.baseline_fraction))
        subset = sorted(int(i) for i in rng.choice(len(rows), size=count, replace=False))
        guarded(
            "per_sample_baseline",
            results,
            args.out,
            lambda: run_per_sample(model, rows, subset, aux_ids, device, work / "per_sample"),
        )

        flex = args.flex == "on" or (args.flex == "auto" and device.type == "cuda")
        if flex:
            guarded(
                "packed_flex",
                results,
                args.out,
                lambda: run_packed(model, rows, args.max_batch_tokens, device),
            )
        else:
            reason = (
                "off (--flex off)"
                if args.flex == "off"
                else "skipped on CPU: flex_attention compiles its kernels with inductor "
                "(minutes on a small CPU); --flex on runs it"
            )
            paths["packed_flex"] = {"skipped": reason}
            log(f"packed_flex: {reason}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    summarise(results)
    markdown = report(results)
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    failed = [key for key in PATHS if "error" in paths.get(key, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

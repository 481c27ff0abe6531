#!/usr/bin/env python3
"""Regeneration through SGLang against SGLang's own serving benchmark, same model and batch
(issue 17, item 5).

The target is 8B-shaped (Llama-3.1-8B: hidden 4096, 32 layers, 32/8 heads, vocab 128256) with
random bf16 weights made on the GPU, and a word-level tokenizer covering the whole vocabulary
with a three-marker chat template. The dataset is `--rows` seeded single-turn conversations
whose rendered prompt is exactly `--prompt-tokens` tokens; every reply is regenerated with
`--new-tokens` new tokens at most (greedy; a random model practically never emits a stop
token, so every reply runs to the limit, as `bench_serving`'s ignore_eos does). Three runs:

- pipeline: SGLang started by the project's launcher for regeneration (`purpose="generation"`:
  since issue 28 a server of its own, without the capture and the four flags it needs, so with
  SGLang's radix cache, chunked prefill and CUDA graphs; the hook stays, inert), then the shards
  as `--jobs` concurrent `scripts/regenerate.py` processes (what `snakemake --cores N` runs),
  each with `extract.max_inflight_requests = --inflight` rows in flight. Output tokens/s from
  the first job's start to the last manifest.
- bench on the pipeline's server: `python -m sglang.bench_serving` on the same server, same
  requests shape (random ids of the same length, the same output length, `--max-concurrency`
  = jobs x inflight, non-streaming as the pipeline's client): what the client costs.
- bench on a stock server: the same launch command without the hook, the capture and the four
  flags the capture needs (SGLang's defaults: radix cache, chunked prefill, decode CUDA graphs),
  the same bench_serving command: SGLang's own number for this model and batch.

`--sweep 64,128,256` repeats the pipeline run and both bench_serving runs at each total
concurrency (the jobs split it): where the server saturates, and the pipeline's ratio there.

SGLang's decode log lines give the running batch size and SGLang's own generation throughput
in each run. JSON to --out, a markdown table beside it.

    python3 -u -m benchmarks.speed.sglang_regeneration --out $OUT/sglang_regeneration.json  # H200
    python3 -u -m benchmarks.speed.sglang_regeneration --engine reference --out /tmp/r.json  # CPU
    python3 -u -m benchmarks.speed.sglang_regeneration --dry-run --sglang-version 0.5.14 \\
        --out /tmp/r.json                                                  # commands only
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    REPO_ROOT,
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
    planned_sglang_commands,
    shm_free_gb,
    stop_group,
    tail,
)
from benchmarks.speed.shard_runs import GpuUtilisation, shard_jobs_in_parallel
from benchmarks.toy_targets.llama import SHAPES, random_llama
from benchmarks.toy_targets.word_tokenizer import TEMPLATE_TOKENS, save_chat_tokenizer
from eaglepipe.server.sglang import recipe  # noqa: E402

# Flags the launcher adds because the capture needs them; a stock server runs without them.
CAPTURE_ONLY_FLAGS = recipe.CAPTURE_ONLY_FLAGS
_DECODE_LINE = re.compile(
    r"Decode batch[^\n]*?#running-req: (\d+)[^\n]*?gen throughput \(token/s\): ([0-9.]+)"
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=2, help="regeneration shard jobs at once")
    parser.add_argument("--inflight", type=int, default=64, help="rows in flight per job")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--mem-fraction-static", type=float, default=0.8)
    parser.add_argument("--runs", default="pipeline,stock", help="servers to measure, in order")
    parser.add_argument(
        "--sweep", default=None,
        help="total concurrencies (e.g. 64,128,256): every run at each, split over --jobs",
    )  # fmt: skip
    parser.add_argument("--deadline-s", type=float, default=540.0, help="whole-run budget")
    parser.add_argument("--health-s", type=float, default=300.0)
    parser.add_argument("--work-root", default=None, help="scratch dir (default /tmp)")
    parser.add_argument("--out", default=None)
    add_engine_options(
        parser,
        "reference: the pipeline run only, through the built-in server on CPU with a tiny "
        "model (a check of this script itself)",
    )
    args = parser.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not set(args.runs) <= {"pipeline", "stock"}:
        parser.error("--runs: pipeline and/or stock")
    if args.dry_run and not args.sglang_version:
        parser.error("--dry-run needs --sglang-version")
    if args.rows % args.jobs:
        parser.error("--rows must be a multiple of --jobs (one shard per job)")
    if args.prompt_tokens <= TEMPLATE_TOKENS:
        parser.error(f"--prompt-tokens must exceed the template's {TEMPLATE_TOKENS} tokens")
    args.tiny = args.dry_run or args.engine == "reference"
    if args.tiny:
        args.runs = ["pipeline"]
    args.sweep = [int(c) for c in args.sweep.split(",") if c.strip()] if args.sweep else None
    if args.sweep and any(c < args.jobs for c in args.sweep):
        parser.error(f"--sweep: every concurrency needs at least one row per job ({args.jobs})")
    return args


def concurrencies(args) -> list[int]:
    """The total concurrencies measured: the sweep's, or jobs x inflight."""
    return args.sweep or [args.jobs * args.inflight]


# ----------------------------------------------------------------------------- inputs


def write_conversations(path: Path, rows: int, prompt_tokens: int, vocab: int, seed: int) -> None:
    """Single-turn conversations of random word tokens (above the markers' ids), whose rendered
    prompt is `prompt_tokens` tokens; the assistant reply is a placeholder to regenerate."""
    rng = np.random.default_rng(seed)
    words = prompt_tokens - TEMPLATE_TOKENS
    with open(path, "w") as f:
        for _ in range(rows):
            ids = rng.integers(103, vocab, words)  # above the markers
            content = " ".join(f"t{i}" for i in ids)
            messages = [{"role": "user", "content": content},
                        {"role": "assistant", "content": "t5"}]  # fmt: skip
            f.write(json.dumps({"messages": messages}) + "\n")


def pipeline_config(run_dir: Path, model_dir: Path, dataset: Path, args) -> dict:
    from eaglepipe.core.config import validate_config
    from eaglepipe.core.config_files import load_config

    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["dataset"].update(
        path=str(dataset), format="openai", max_length=args.prompt_tokens + args.new_tokens + 8
    )
    config["dataset"]["regenerate"].update(
        enabled=True, max_new_tokens=args.new_tokens, temperature=0.0, turns="last",
        on_length_limit="keep",
    )  # fmt: skip
    config["shards"]["rows_per_shard"] = args.rows // args.jobs
    sglang = args.engine == "sglang"
    config["server"].update(
        engine=args.engine,
        dtype="bfloat16" if sglang else "float32",
        device="auto" if sglang else "cpu",
        port=free_port(),
        dump_root=tempfile.mkdtemp(prefix="eaglepipe-bench-regen-dumps-", dir=run_dir),
        health_timeout_s=int(args.health_s),
        idle_timeout_s=900,
        sglang={
            "tp_size": 1,
            "mem_fraction_static": args.mem_fraction_static,
            "extra_args": list(SGLANG_EXTRA_ARGS),
        },
    )
    config["extract"]["max_inflight_requests"] = args.inflight
    return validate_config(config)


def stock_command(config: dict, sglang_version: str | None = None) -> tuple[list[str], dict]:
    """The launcher's command without the hook, the capture and the flags only the capture
    needs: SGLang as it is served, with the same model, port and memory settings."""
    argv, env = bare_command(config, sglang_version)
    return [a for a in argv if a not in CAPTURE_ONLY_FLAGS], env


def bench_serving_command(
    url: str, model_dir: Path, args, output_len: int, out: Path, concurrency: int | None = None
) -> list:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
        "--host", host, "--port", port, "--model", str(model_dir), "--tokenizer", str(model_dir),
        "--dataset-name", "random-ids", "--tokenize-prompt",
        "--random-input-len", str(args.prompt_tokens), "--random-output-len", str(output_len),
        "--random-range-ratio", "1.0", "--num-prompts", str(args.rows),
        "--max-concurrency", str(concurrency or args.jobs * args.inflight),
        "--request-rate", "inf",
        "--disable-stream", "--seed", str(args.seed), "--output-file", str(out),
    ]  # fmt: skip


def server_env() -> dict:
    """The environment SGLang's own tools run in: the server's path first (on the H200, its
    transformers)."""
    env = dict(os.environ)
    server_path = env.get("EAGLEPIPE_SGLANG_PYTHONPATH")
    if server_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (server_path, env.get("PYTHONPATH")) if p)
    return env


# ----------------------------------------------------------------------------- measurements


def decode_summary(text: str) -> dict:
    """SGLang's decode log lines: running batch size and its own generation throughput."""
    lines = [(int(m.group(1)), float(m.group(2))) for m in _DECODE_LINE.finditer(text)]
    if not lines:
        return {"decode_lines": 0}
    running = [r for r, _ in lines]
    speeds = [s for _, s in lines]
    return {
        "decode_lines": len(lines),
        "running_req_mean": round(sum(running) / len(running), 1),
        "running_req_max": max(running),
        "sglang_gen_tok_s_median": round(float(np.median(speeds)), 1),
    }


def run_bench_serving(
    url: str, model_dir: Path, args, output_len: int, work: Path, concurrency: int | None = None
) -> dict:
    out = work / f"bench-serving-{time.monotonic_ns()}.jsonl"
    argv = bench_serving_command(url, model_dir, args, output_len, out, concurrency)
    started = time.perf_counter()
    with GpuUtilisation() as gpu:
        done = subprocess.run(argv, capture_output=True, text=True, env=server_env(), timeout=900)
    result: dict = {"argv": argv, "wall_s": round(time.perf_counter() - started, 1)}
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"bench_serving exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"
        )
    report = json.loads(out.read_text().splitlines()[-1])
    keep = (
        "completed", "total_input_tokens", "total_output_tokens", "duration",
        "output_throughput", "input_throughput", "request_throughput", "max_concurrency",
    )  # fmt: skip
    result.update({k: report.get(k) for k in keep}, **gpu.summary())
    if report.get("completed") != args.rows:
        raise RuntimeError(f"bench_serving completed {report.get('completed')}/{args.rows}")
    return result


def regenerate_all(run_dir: Path, config: dict, names, args, handle, concurrency: int) -> dict:
    """Every shard regenerated afresh by `--jobs` concurrent jobs, `concurrency` rows in flight
    in all; output tokens/s from the first job's start to the last manifest."""
    config = json.loads(json.dumps(config))
    config["extract"]["max_inflight_requests"] = max(1, concurrency // len(names))
    shutil.rmtree(run_dir / "regenerated", ignore_errors=True)  # no journalled row is kept
    offset = handle.log_path.stat().st_size
    with GpuUtilisation() as gpu:
        t0 = time.perf_counter()
        manifests = shard_jobs_in_parallel(run_dir, config, names, len(names), stage="regenerate")
        seconds = time.perf_counter() - t0
    time.sleep(0.5)
    text = log_between(handle.log_path, offset)
    tokens = sum(m["output_tokens"] for m in manifests)
    rows = sum(m["regenerated_rows"] for m in manifests)
    if rows != args.rows:
        raise RuntimeError(f"{rows} of {args.rows} rows regenerated")
    return {
        "concurrency": concurrency,
        "shards": len(names),
        "rows": rows,
        "output_tokens": tokens,
        "output_tokens_per_row": round(tokens / rows, 1),
        "length_limited_replies": sum(m["length_limited_replies"] for m in manifests),
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(tokens / seconds, 1),
        # Inside the jobs, from the first request to the last reply (no start-up).
        "in_job_tokens_per_s": [m["timing"]["output_tokens_per_s"] for m in manifests],
        "job_wall_s": [m["job_wall_s"] for m in manifests],
        # Each job's process start to its first request (its start-up, the tokenizer's load in).
        "first_request_s": [m["timing"].get("first_request_s") for m in manifests],
        # Of which the tokenizer's load (item 2's goal: 1 s plus this).
        "tokenizer_load_s": [m["timing"].get("tokenizer_load_s") for m in manifests],
        **decode_summary(text),
        **gpu.summary(),
    }


def run_pipeline(
    run_dir: Path, config: dict, model_dir: Path, args, work: Path, deadline: float
) -> dict:
    from eaglepipe.core.run import resolve
    from eaglepipe.plan.provenance import shards
    from eaglepipe.server.lifecycle.identity import GENERATION
    from eaglepipe.server.lifecycle.shared_server import start_server, stop_server

    result: dict = {}
    with working_directory(run_dir):
        try:
            started = time.monotonic()
            # The server regeneration leases (no capture; the reference server serves both).
            handle = start_server(resolve(config), purpose=GENERATION)
            result["startup_s"] = round(time.monotonic() - started, 1)
            result["engine_version"] = handle.info.get("engine_version")
            result["argv"] = handle.state.get("argv")  # the supervisor's, the engine's after "--"
            log(f"pipeline: {handle.info.get('engine')} healthy after {result['startup_s']}s")
            names = shards(resolve(config))
            points = []
            for concurrency in concurrencies(args):
                if deadline - time.monotonic() < 60:
                    points.append({"concurrency": concurrency, "skipped": "budget spent"})
                    continue
                point = regenerate_all(run_dir, config, names, args, handle, concurrency)
                log(f"pipeline regeneration at {concurrency} in flight: "
                    f"{point['output_tokens_per_s']:,.0f} output tok/s "
                    f"({point['output_tokens']} tokens, {point['rows']} rows)")  # fmt: skip
                if args.engine == "sglang":
                    output_len = round(point["output_tokens"] / point["rows"])
                    offset = handle.log_path.stat().st_size
                    bench = run_bench_serving(
                        handle.url, model_dir, args, output_len, work, concurrency
                    )
                    bench.update(decode_summary(log_between(handle.log_path, offset)))
                    point["bench_serving"] = bench
                    log(f"bench_serving on the pipeline's server at {concurrency}: "
                        f"{bench['output_throughput']:,.0f} output tok/s")  # fmt: skip
                points.append(point)
            measured = [p for p in points if "skipped" not in p]
            if not measured:
                raise RuntimeError("no concurrency was measured within the budget")
            first = measured[0]
            result["regeneration"] = {k: v for k, v in first.items() if k != "bench_serving"}
            if "bench_serving" in first:
                result["bench_serving"] = first["bench_serving"]
            if args.sweep:
                result["sweep"] = points
        finally:
            stop_server()
            logs = sorted((run_dir / "logs" / "server").glob("*.log"))
            if logs:
                result["server_log_tail"] = tail(logs[-1], 15)
    return result


def run_stock(
    config: dict, model_dir: Path, args, output_lens: dict, work: Path, deadline: float
) -> dict:
    argv, extra_env = stock_command(config)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    url = f"http://{config['server']['host']}:{port}"
    log_path = work / "server_stock.log"
    result: dict = {"argv": argv}
    started = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, env={**os.environ, **extra_env}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    try:
        while not http_ok(url):
            if proc.poll() is not None:
                raise RuntimeError(f"stock SGLang exited {proc.returncode}: {tail(log_path)}")
            if time.monotonic() - started > args.health_s:
                raise RuntimeError(f"stock SGLang not healthy in {args.health_s:g}s")
            time.sleep(0.5)
        result["startup_s"] = round(time.monotonic() - started, 1)
        log(f"stock: healthy after {result['startup_s']}s")
        points = []
        for concurrency in concurrencies(args):
            if deadline - time.monotonic() < 45:
                points.append({"concurrency": concurrency, "skipped": "budget spent"})
                continue
            output_len = output_lens.get(concurrency, args.new_tokens)
            offset = log_path.stat().st_size
            bench = run_bench_serving(url, model_dir, args, output_len, work, concurrency)
            bench.update(decode_summary(log_between(log_path, offset)))
            bench["concurrency"] = concurrency
            points.append(bench)
            log(f"bench_serving on a stock server at {concurrency}: "
                f"{bench['output_throughput']:,.0f} output tok/s")  # fmt: skip
        measured = [p for p in points if "skipped" not in p]
        if not measured:
            raise RuntimeError("no concurrency was measured within the budget")
        result["bench_serving"] = measured[0]
        if args.sweep:
            result["sweep"] = points
    finally:
        stop_group(proc)
        result["server_log_tail"] = tail(log_path, 15)
    return result


# ----------------------------------------------------------------------------- summary


def _tok_s(results: dict, *path: str) -> float | None:
    node = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def summarise(results: dict) -> None:
    regen = _tok_s(results, "pipeline", "regeneration", "output_tokens_per_s")
    bench_same = _tok_s(results, "pipeline", "bench_serving", "output_throughput")
    bench_stock = _tok_s(results, "stock", "bench_serving", "output_throughput")
    results["ratios"] = {
        "regeneration_vs_bench_same_server": ratio(regen, bench_same),
        "regeneration_vs_bench_stock_server": ratio(regen, bench_stock),
        "pipeline_server_vs_stock_server_bench": ratio(bench_same, bench_stock),
    }
    stock_at = {
        b.get("concurrency"): b.get("output_throughput")
        for b in _tok_s(results, "stock", "sweep") or []
        if "output_throughput" in b
    }
    sweep = []
    for point in _tok_s(results, "pipeline", "sweep") or []:
        if "output_tokens_per_s" not in point:
            continue
        c = point["concurrency"]
        same = (point.get("bench_serving") or {}).get("output_throughput")
        sweep.append({
            "concurrency": c,
            "regeneration_tok_s": point["output_tokens_per_s"],
            "bench_same_server_tok_s": same,
            "bench_stock_tok_s": stock_at.get(c),
            "regeneration_vs_stock": ratio(point["output_tokens_per_s"], stock_at.get(c)),
        })  # fmt: skip
    if sweep:
        results["sweep"] = sweep
        best = max(sweep, key=lambda p: p["bench_stock_tok_s"] or p["regeneration_tok_s"])
        # Where the stock server saturates: the least concurrency within 5 % of its best.
        top = best["bench_stock_tok_s"] or best["regeneration_tok_s"]
        results["saturating_concurrency"] = min(
            p["concurrency"]
            for p in sweep
            if (p["bench_stock_tok_s"] or p["regeneration_tok_s"]) >= 0.95 * top
        )


def report(results: dict) -> str:
    setup = results["setup"]
    rows = []
    pipeline = results.get("pipeline", {})
    regen = pipeline.get("regeneration")
    if regen:
        rows.append(["pipeline regeneration (scripts/regenerate.py jobs)",
                     regen["output_tokens_per_s"], regen.get("running_req_mean"),
                     regen.get("sglang_gen_tok_s_median"), regen.get("gpu_util_mean_pct"),
                     regen["seconds"]])  # fmt: skip
    for name, label in (("pipeline", "bench_serving, pipeline's server"),
                        ("stock", "bench_serving, stock server")):  # fmt: skip
        bench = results.get(name, {}).get("bench_serving")
        if bench:
            rows.append([label, round(bench["output_throughput"], 1),
                         bench.get("running_req_mean"), bench.get("sglang_gen_tok_s_median"),
                         bench.get("gpu_util_mean_pct"), round(bench["duration"], 3)])  # fmt: skip
    for name in ("pipeline", "stock"):
        if "error" in results.get(name, {}):
            rows.append([f"{name}: error", results[name]["error"][:200], "", "", "", ""])
    head = (
        f"{setup['rows']} rows x {setup['prompt_tokens']} prompt tokens, up to "
        f"{setup['new_tokens']} new tokens, {setup['jobs']} jobs x {setup['inflight']} in flight "
        f"({setup['jobs'] * setup['inflight']} concurrent)\n\n"
    )
    table = markdown_table(
        ["run", "output tok/s", "running requests (mean)", "SGLang gen tok/s (median)",
         "GPU util %", "seconds"], rows,
    )  # fmt: skip
    ratios = markdown_table(["ratio", "measured"], list(results.get("ratios", {}).items()))
    sweep = ""
    if results.get("sweep"):
        sweep = "\n" + markdown_table(
            ["concurrency", "regeneration tok/s", "bench_serving, pipeline's server",
             "bench_serving, stock", "regeneration / stock"],
            [[p["concurrency"], p["regeneration_tok_s"], p["bench_same_server_tok_s"],
              p["bench_stock_tok_s"], p["regeneration_vs_stock"]] for p in results["sweep"]],
        ) + (
            "\nSaturating concurrency (within 5 % of the best): "
            f"{results['saturating_concurrency']}\n"
        )  # fmt: skip
    return head + table + "\n" + ratios + sweep


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    deadline = time.monotonic() + args.deadline_s
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    shape_name = "tiny" if args.tiny else "8b"
    shape = SHAPES[shape_name]
    if args.tiny:
        args.rows, args.jobs, args.inflight = min(args.rows, 8), 2, 4
        args.prompt_tokens, args.new_tokens = min(args.prompt_tokens, 48), min(args.new_tokens, 8)
    work = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-regen-", dir=args.work_root))
    results: dict = {
        "benchmark": "sglang_regeneration",
        "command": command_line(),
        "machine": machine_info(device),
        "setup": {
            "shape": shape_name,
            **shape,
            "rows": args.rows,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "jobs": args.jobs,
            "inflight": args.inflight,
            "seed": args.seed,
            "mem_fraction_static": args.mem_fraction_static,
            "sglang_extra_args": SGLANG_EXTRA_ARGS,
        },  # fmt: skip
    }
    code = 0
    if not args.tiny:  # fail in seconds, not after building and serving an 8B model
        check = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--help"],
                               capture_output=True, text=True, env=server_env())  # fmt: skip
        if check.returncode != 0:
            raise SystemExit(f"sglang.bench_serving does not start: {check.stderr[-1500:]}")
    try:
        model_parent = Path("/dev/shm") if shm_free_gb() > 45 and not args.tiny else work
        model_dir = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-model-", dir=model_parent))
        results["setup"]["model_dir"] = str(model_dir)
        t0 = time.monotonic()
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = random_llama(device, dtype, seed=0, **shape)
        model.save_pretrained(model_dir, max_shard_size="5GB")
        save_chat_tokenizer(model_dir, shape["vocab"])
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        results["setup"]["model_build_and_save_s"] = round(time.monotonic() - t0, 1)
        run_dir = work / "run"
        run_dir.mkdir()
        dataset = run_dir / "conversations.jsonl"
        write_conversations(dataset, args.rows, args.prompt_tokens, shape["vocab"], args.seed)
        config = pipeline_config(run_dir, model_dir, dataset, args)
        if args.dry_run:
            # Regeneration's server (no capture), and extraction's beside it for comparison.
            planned = planned_sglang_commands(config, args.sglang_version)
            url = f"http://127.0.0.1:{config['server']['port']}"
            results["pipeline"] = {"argv": planned["generation"]}
            results["capture"] = {"argv": planned["capture"]}
            results["stock"] = {"argv": stock_command(config, args.sglang_version)[0]}
            results["bench_serving"] = {
                "argv": [
                    bench_serving_command(url, model_dir, args, args.new_tokens, work / "b", c)
                    for c in concurrencies(args)
                ]
            }
        else:
            # bench_serving's output length: the regeneration's mean at the same concurrency.
            output_lens: dict[int, int] = {}
            for name in args.runs:
                if deadline - time.monotonic() < 90:
                    results[name] = {"skipped": "less than 90 s of the budget left"}
                    continue
                try:
                    if name == "pipeline":
                        results[name] = run_pipeline(
                            run_dir, config, model_dir, args, work, deadline
                        )
                        for point in results[name].get("sweep") or [results[name]["regeneration"]]:
                            if "rows" in point:
                                output_lens[point["concurrency"]] = round(
                                    point["output_tokens"] / point["rows"]
                                )
                    else:
                        results[name] = run_stock(
                            config, model_dir, args, output_lens, work, deadline
                        )
                except Exception as exc:
                    traceback.print_exc()
                    results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                    code = 1
                write_results(args.out, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if "model_dir" in results["setup"]:
            shutil.rmtree(results["setup"]["model_dir"], ignore_errors=True)
    summarise(results)
    markdown = report(results)
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    return code


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A shard job's start-up: what it does before its first request, measured (issue 28, item 2).

Goal: an extraction job sends its first request within 1 s of starting; a regeneration job
within 1 s plus its tokenizer's own load. Every GPU second a job spends starting is lost when
every running job is starting or finishing at once (BENCHMARKS.md, "job turnover"). Parts
(`--parts`, all by default), each in the same run:

- imports: fresh interpreters; `import` of each job's entry module, `scripts/<job>.py --help`,
  the tokenizer's load (as the jobs load it, and through AutoTokenizer), and whether torch was
  imported (best of `--repeat`);
- jobs: real `scripts/extract.py` and `scripts/regenerate.py` processes against a running
  reference server (a tiny random Llama on CPU, started once through the lifecycle, as
  Snakemake's first job would), one shard each, one job at a time: seconds from the process's
  start to the line it logs just before its first request, and the manifest's own
  `first_request_s` where it records one;
- read: a shard's rows from a prepared table of `--rows` rows (its own parquet row group,
  `eaglepipe.extract.shard.load_shard_rows`) against the whole table read and then sliced;
- lease: the server lease a job takes before its first request
  (`eaglepipe.server.lifecycle.leases.Lease`)
  idle and beside `--writers` threads writing `--writer-gb` GB each into the same filesystem as
  shard jobs write their chunks (bench_ingest's raw writes), against the same file fsynced.

    python -u -m benchmarks.speed.job_start --out /tmp/job_start.json
    python -u -m benchmarks.speed.job_start --parts read --rows 20000 --rows-per-shard 200
    python -u -m benchmarks.speed.job_start --parts lease --writer-gb 12
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.common import (
    REPO_ROOT,
    command_line,
    log,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    timed,
    write_results,
)
from benchmarks.toy_targets.rows import train_table_bytes, write_prepared
from eaglepipe.core.atomic import atomic_write_json  # noqa: E402
from eaglepipe.extract.shard import load_shard_rows  # noqa: E402
from eaglepipe.prepare.table import load_prepared, rows_in_range  # noqa: E402
from eaglepipe.server.lifecycle.leases import Lease, ServerPaths  # noqa: E402

PARTS = ("imports", "jobs", "read", "lease")
GOAL_S = 1.0
# What each job logs right before its first request (extract/shard.py, regenerate/shard.py).
FIRST_REQUEST_LINE = {"extract": ": requesting ", "regenerate": ": regenerating "}
ENTRY_MODULES = {"extract": "eaglepipe.extract.shard", "regenerate": "eaglepipe.regenerate.shard"}
TINY = dict(hidden=64, layers=8, heads=4, kv_heads=2, intermediate=128, vocab=512, max_pos=512)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=",".join(PARTS))
    parser.add_argument("--jobs", type=int, default=3, help="jobs timed per stage")
    parser.add_argument("--rows", type=int, default=20000, help="prepared rows (read part)")
    parser.add_argument("--rows-per-shard", type=int, default=200, help="(read part)")
    parser.add_argument("--mean-len", type=int, default=2000, help="mean tokens per row (read)")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many")
    parser.add_argument("--samples", type=int, default=20, help="idle leases per way (lease)")
    parser.add_argument("--writers", type=int, default=2, help="chunk writers (lease part)")
    parser.add_argument(
        "--writer-gb", type=float, default=8.0,
        help="GB each writer writes (all kept until the part ends: writers x GB of free space)",
    )  # fmt: skip
    parser.add_argument("--dir", default=None, help="scratch parent dir (default: /tmp)")
    parser.add_argument("--out", default=None, help="results JSON (markdown beside it)")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.parts or not set(args.parts) <= set(PARTS):
        parser.error(f"--parts: some of {', '.join(PARTS)}")
    if args.samples < 1 or args.writers < 1 or args.writer_gb <= 0:
        parser.error("--samples and --writers: at least 1; --writer-gb: more than 0")
    return args


# ----------------------------------------------------------------------------- imports


def fresh_python(code: str, repeat: int) -> dict:
    """Best wall time of `python -c code` in fresh interpreters, and what it printed."""
    best, printed = float("inf"), ""
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
        )
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"python -c {code!r} failed: {done.stderr[-2000:]}")
        best, printed = min(best, seconds), done.stdout.strip()
    return {"seconds": round(best, 3), "printed": printed}


def import_breakdown(module: str, top: int = 8) -> dict[str, float]:
    """Where `import module` spends its time, by package: the import seconds of every module
    loaded (`python -X importtime`, one fresh interpreter, each module's own time) summed by
    its top-level package name, the `top` largest."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"-X importtime of {module} failed: {done.stderr[-2000:]}")
    by_package: Counter = Counter()
    for line in done.stderr.splitlines():
        # "import time: self [us] | cumulative | imported package" (nesting by indent)
        fields = line.removeprefix("import time:").split("|")
        if len(fields) == 3 and fields[0].strip().isdigit():
            by_package[fields[2].strip().split(".")[0]] += int(fields[0]) / 1e6
    return {name: round(seconds, 3) for name, seconds in by_package.most_common(top)}


def bytecode_state(module: str) -> dict:
    """After `import module` in a fresh interpreter: whether Python writes bytecode here, and
    how many of the imported source modules have no cached bytecode (each such module is
    compiled from source by every process that imports it)."""
    code = (
        "import importlib.util, json, os, sys\n"
        f"import {module}\n"
        "files = [m.__file__ for m in list(sys.modules.values())\n"
        "         if (getattr(m, '__file__', None) or '').endswith('.py')]\n"
        "missing = [f for f in files if not os.path.exists(importlib.util.cache_from_source(f))]\n"
        "print(json.dumps({'dont_write_bytecode': sys.dont_write_bytecode,\n"
        "                  'source_modules': len(files), 'without_bytecode': len(missing),\n"
        "                  'examples': sorted(missing)[:5]}))"
    )
    return json.loads(fresh_python(code, 1)["printed"])


def measure_imports(args, model_dir: Path | None) -> dict:
    result: dict = {"interpreter_s": fresh_python("pass", args.repeat)["seconds"]}
    for job, module in ENTRY_MODULES.items():
        probe = f"import sys, {module}; print('torch' in sys.modules)"
        imported = fresh_python(probe, args.repeat)
        script = REPO_ROOT / "scripts" / f"{job}.py"
        helped = fresh_python(
            f"import runpy, sys; sys.argv = [{str(script)!r}, '--help']\n"
            f"try: runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit: pass",
            args.repeat,
        )
        result[job] = {
            "module": module,
            "import_s": imported["seconds"],
            "imports_torch": imported["printed"] == "True",
            "help_s": helped["seconds"],
            "slowest_imports_s": import_breakdown(module),
            "bytecode": bytecode_state(module),
        }
        bytecode = result[job]["bytecode"]
        log(f"{job}: import {imported['seconds']}s (torch: {imported['printed']}), "
            f"--help {helped['seconds']}s; {bytecode['without_bytecode']} of "
            f"{bytecode['source_modules']} source modules without bytecode (writes bytecode: "
            f"{not bytecode['dont_write_bytecode']})")  # fmt: skip
    if model_dir is not None:
        # The loader every stage uses (the plain class where the config names it), and
        # AutoTokenizer, which imports torch through transformers' config machinery.
        loaders = {
            "tokenizer": "from eaglepipe.data.tokenizer import tokenizer_loader\n"
            f"tokenizer_loader(Path({str(model_dir)!r})).from_pretrained({str(model_dir)!r})\n",
            "auto_tokenizer": "from transformers import AutoTokenizer\n"
            f"AutoTokenizer.from_pretrained({str(model_dir)!r})\n",
        }
        for name, load in loaders.items():
            code = (
                "import sys, time; from pathlib import Path; t = time.perf_counter()\n"
                + load
                + "print(round(time.perf_counter() - t, 3), 'torch' in sys.modules)"
            )
            loaded = fresh_python(code, args.repeat)
            seconds, torch_loaded = loaded["printed"].split()
            result[f"{name}_load_s"] = float(seconds)
            result[f"{name}_imports_torch"] = torch_loaded == "True"
            log(f"{name}: {seconds}s in a fresh interpreter (transformers included)")
    return result


# ----------------------------------------------------------------------------- jobs


def build_target(model_dir: Path) -> None:
    """A tiny random Llama with a word tokenizer and a chat template (no download)."""
    import torch

    from benchmarks.toy_targets.llama import random_llama
    from benchmarks.toy_targets.word_tokenizer import save_chat_tokenizer

    model = random_llama("cpu", torch.float32, seed=0, **TINY)
    model.save_pretrained(model_dir)
    save_chat_tokenizer(model_dir, TINY["vocab"])


def write_inputs(run_dir: Path, shards: int, rows_per_shard: int) -> tuple[Path, Path]:
    """The dataset (single-turn conversations in the tokenizer's words) and a prepared table
    with one row group per shard, as prepare writes it; returns (dataset, table)."""
    rng = np.random.default_rng(0)
    rows = shards * rows_per_shard
    records = []
    for _ in range(rows):
        words = " ".join(f"t{i}" for i in rng.integers(103, TINY["vocab"], 24))
        records.append({"messages": [{"role": "user", "content": words},
                                     {"role": "assistant", "content": "t5"}]})  # fmt: skip
    tokens = [rng.integers(3, TINY["vocab"], 64, dtype=np.int32) for _ in range(rows)]
    dataset = write_prepared(run_dir, tokens, rows_per_shard=rows_per_shard, records=records)
    return dataset, run_dir / "prepared" / "tokenized.parquet"


def job_config(model_dir: Path, dataset: Path, rows_per_shard: int, regenerate: bool) -> dict:
    from benchmarks.common import free_port
    from eaglepipe.core.config import validate_config
    from eaglepipe.core.config_files import load_config

    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["dataset"].update(path=str(dataset), format="openai", max_length=256)
    config["dataset"]["regenerate"].update(
        enabled=regenerate, max_new_tokens=4, temperature=0.0, turns="last"
    )
    config["shards"]["rows_per_shard"] = rows_per_shard
    config["server"].update(
        engine="reference", device="cpu", dtype="float32", port=free_port(),
        dump_root=str(dataset.parent / "dumps"), idle_timeout_s=600, health_timeout_s=300,
    )  # fmt: skip
    return validate_config(config)


def time_job(run_dir: Path, stage: str, config_path: Path, shard: str) -> dict:
    """One job process: seconds from its start to the line before its first request, and to
    its exit; the manifest's own `first_request_s` (seconds since the process started)."""
    argv = [sys.executable, "-u", str(REPO_ROOT / "scripts" / f"{stage}.py")]
    argv += ["--config", str(config_path), "--shard", shard]
    marker = FIRST_REQUEST_LINE[stage]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=run_dir, stderr=subprocess.PIPE, text=True)
    first_request = None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if first_request is None and marker in line:
            first_request = time.perf_counter() - started
    proc.wait()
    wall = time.perf_counter() - started
    if proc.returncode != 0 or first_request is None:
        raise RuntimeError(f"{stage} {shard} exited {proc.returncode}: {''.join(lines)[-2000:]}")
    outputs = {"extract": "hidden_states", "regenerate": "regenerated"}[stage]
    manifest = json.loads((run_dir / outputs / shard / "manifest.json").read_text())
    return {
        "shard": shard,
        "to_first_request_s": round(first_request, 3),
        "manifest_first_request_s": manifest["timing"].get("first_request_s"),
        # Its parts: the library's code reached (interpreter, imports), the lease asked for (the
        # shard's rows read, its chunks planned), the server's lease held, and how it was had.
        "manifest_entered_s": manifest["timing"].get("entered_s"),
        "manifest_lease_asked_s": manifest["timing"].get("lease_asked_s"),
        "manifest_leased_s": manifest["timing"].get("leased_s"),
        "manifest_lease_via": manifest["timing"].get("lease_via"),
        # Regeneration's goal is 1 s plus this (None for extraction, which loads none).
        "manifest_tokenizer_load_s": manifest["timing"].get("tokenizer_load_s"),
        "wall_s": round(wall, 3),
    }


def summary_of(runs: list[dict]) -> dict:
    firsts = [r["to_first_request_s"] for r in runs]
    beyond = [r["to_first_request_s"] - (r["manifest_tokenizer_load_s"] or 0.0) for r in runs]
    return {
        "runs": runs,
        "to_first_request_s_median": round(statistics.median(firsts), 3),
        "to_first_request_s_min": round(min(firsts), 3),
        "without_tokenizer_load_s_median": round(statistics.median(beyond), 3),
    }


def measure_jobs(args, work: Path, model_dir: Path) -> dict:
    from benchmarks.common import working_directory
    from eaglepipe.core.config import write_resolved
    from eaglepipe.core.run import resolve
    from eaglepipe.plan.provenance import shards as planned_shards
    from eaglepipe.server.lifecycle.shared_server import start_server, stop_server

    run_dir = work / "run"
    run_dir.mkdir()
    rows_per_shard = 4
    dataset, _ = write_inputs(run_dir, args.jobs, rows_per_shard)
    result: dict = {"shards": args.jobs, "rows_per_shard": rows_per_shard, "model": TINY}
    configs = {}
    for stage in ("extract", "regenerate"):
        config = job_config(model_dir, dataset, rows_per_shard, stage == "regenerate")
        if configs:  # one server for both: the same port (its identity ignores the dataset)
            config["server"]["port"] = configs["extract"]["server"]["port"]
        configs[stage] = config
    with working_directory(run_dir):
        try:
            with timed() as t:
                start_server(resolve(configs["extract"]))
            result["server_start_s"] = round(t["seconds"], 1)
            log(f"jobs: reference server up in {result['server_start_s']}s")
            names = planned_shards(resolve(configs["extract"]))
            for stage in ("extract", "regenerate"):
                # Where the workflow writes it, as the jobs of a run read it (sealed: no
                # validation again, eaglepipe.core.config).
                resolved = write_resolved(configs[stage], run_dir / ".eaglepipe" / "config.json")
                runs = [time_job(run_dir, stage, resolved, name) for name in names]
                result[stage] = summary_of(runs)
                log(f"{stage}: first request after {result[stage]['to_first_request_s_median']}s"
                    f" (median of {len(runs)} jobs)")  # fmt: skip
        finally:
            stop_server()
    return result


# ----------------------------------------------------------------------------- the row read


def write_table(path: Path, rows: int, rows_per_shard: int, mean_len: int) -> int:
    rng = np.random.default_rng(0)
    lengths = rng.integers(mean_len // 4, 2 * mean_len - mean_len // 4 + 1, rows)
    tokens = [rng.integers(0, 128000, n, dtype=np.int32) for n in lengths]
    path.write_bytes(train_table_bytes(tokens, rows_per_shard=rows_per_shard))
    return int(lengths.sum())


def best_of(repeat: int, read) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeat):
        with timed() as t:
            count = read()
        best = min(best, t["seconds"])
    return best, count


def measure_read(args, work: Path) -> dict:
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
    return {
        "rows": args.rows,
        "rows_per_shard": args.rows_per_shard,
        "tokens": total_tokens,
        "table_bytes": size,
        "shard": f"rows_{start}-{end}",
        "shard_read_s": round(shard_s, 4),
        "whole_table_read_s": round(whole_s, 4),
        "speedup": ratio(whole_s, shard_s),
    }


# ----------------------------------------------------------------------------- the lease

# The ingest benchmark's raw writes: files of up to 1 GiB written as chunks are (handed to the disk
# every 64 MiB, then fsynced), by one thread per writer, in a process of its own so that the lease's
# timing shares no interpreter with them.
WRITERS = """
import json, sys
from pathlib import Path
from benchmarks.speed.storage import raw_write
raw_write(Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), writeback=True)
"""


def writer_file_sizes(writers: int, gigabytes: float) -> list[int]:
    """Each writer's `gigabytes` as files of up to 1 GiB, as the chunks are bounded."""
    total = int(gigabytes * 1e9)
    sizes = [1 << 30] * (total >> 30) + ([total % (1 << 30)] if total % (1 << 30) else [])
    return sizes * writers


def take_lease(paths: ServerPaths) -> float:
    """Seconds to take the lease as a job does (its file written, its heartbeat started)."""
    lease = Lease(paths, ttl_s=60.0, run_token="bench", kind="shared")
    started = time.perf_counter()
    lease.acquire()
    seconds = time.perf_counter() - started
    lease.release()
    return seconds


def write_durably(paths: ServerPaths) -> float:
    """Seconds to write the same lease file with its fsyncs (file and directory)."""
    lease = Lease(paths, ttl_s=60.0, run_token="bench", kind="shared")
    started = time.perf_counter()
    atomic_write_json(lease.path, lease.content, durable=True)
    seconds = time.perf_counter() - started
    lease.path.unlink()
    return seconds


LEASE_WAYS = {"the job's lease": take_lease, "the same file fsynced": write_durably}


def sample_leases(paths: ServerPaths, keep_going) -> dict:
    """Each way in turn while `keep_going(rounds done)`; medians and maxima in ms."""
    seconds: dict[str, list[float]] = {way: [] for way in LEASE_WAYS}
    rounds = 0
    while keep_going(rounds):
        for way, measure in LEASE_WAYS.items():
            seconds[way].append(measure(paths))
            time.sleep(0.05)
        rounds += 1
    return {
        way: {
            "samples": len(values),
            "median_ms": round(1000 * statistics.median(values), 3) if values else None,
            "max_ms": round(1000 * max(values), 3) if values else None,
        }
        for way, values in seconds.items()
    }


def measure_lease(args, work: Path) -> dict:
    paths = ServerPaths(work / "server")
    idle = sample_leases(paths, lambda rounds: rounds < args.samples)
    sizes = writer_file_sizes(args.writers, args.writer_gb)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITERS, str(work), json.dumps(sizes), str(args.writers)],
        cwd=REPO_ROOT,
    )
    started = time.perf_counter()
    try:
        time.sleep(1.0)  # the writers get going first
        # While they write (a round at least): the stalls come while the disk is busy.
        beside = sample_leases(paths, lambda rounds: rounds == 0 or writer.poll() is None)
        if writer.wait() != 0:
            raise SystemExit(f"the chunk writers exited with {writer.returncode}")
    finally:
        writer.kill()
        writer.wait()
    seconds = time.perf_counter() - started
    if list(paths.leases.glob("*")) or list(work.glob("bench-ingest-raw-*")):
        raise SystemExit(f"lease or writer files left in {work}")
    result = {
        "idle": idle,
        "beside_writers": beside,
        "writers": args.writers,
        "writer_gb": args.writer_gb,
        "written_gb_per_s": round(sum(sizes) / 1e9 / seconds, 3),
    }
    for phase in ("idle", "beside_writers"):
        log(f"lease, {phase}: " + ", ".join(
            f"{way} median {v['median_ms']} ms, max {v['max_ms']} ms ({v['samples']})"
            for way, v in result[phase].items()))  # fmt: skip
    return result


# ----------------------------------------------------------------------------- report


def markdown_of(results: dict, repeat: int) -> str:
    parts = []
    imports = results.get("imports")
    if imports:
        rows = [["interpreter start (`python -c pass`)", imports["interpreter_s"], ""]]
        for job in ENTRY_MODULES:
            entry = imports[job]
            rows.append([f"`import {entry['module']}`", entry["import_s"],
                         "yes" if entry["imports_torch"] else "no"])  # fmt: skip
            if slowest := entry.get("slowest_imports_s"):
                rows.append(["of it, by package (`-X importtime`, one run): "
                             + ", ".join(f"{name} {sec}" for name, sec in slowest.items()),
                             "", ""])  # fmt: skip
            if bytecode := entry.get("bytecode"):
                rows.append([f"of its {bytecode['source_modules']} source modules, without "
                             f"cached bytecode after the import: {bytecode['without_bytecode']}"
                             + (" (this Python writes none: compiled at every import)"
                                if bytecode["dont_write_bytecode"] else ""), "", ""])  # fmt: skip
            rows.append([f"`scripts/{job}.py --help`", entry["help_s"], ""])
        if "tokenizer_load_s" in imports:
            rows.append(["the tokenizer's load as the jobs do it (`eaglepipe.data.tokenizer`)",
                         imports["tokenizer_load_s"],
                         "yes" if imports["tokenizer_imports_torch"] else "no"])  # fmt: skip
            rows.append(["the same through `AutoTokenizer`",
                         imports["auto_tokenizer_load_s"],
                         "yes" if imports["auto_tokenizer_imports_torch"] else "no"])  # fmt: skip
        parts.append(
            f"### Imports (fresh interpreters, best of {repeat})\n\n"
            + markdown_table(["what", "s", "torch imported"], rows)
        )
    jobs = results.get("jobs")
    if jobs:
        rows = [
            [stage, jobs[stage]["to_first_request_s_median"], jobs[stage]["to_first_request_s_min"],
             ", ".join(str(r["manifest_first_request_s"]) for r in jobs[stage]["runs"]),
             jobs[stage].get("without_tokenizer_load_s_median"),
             f"<= {GOAL_S:g} s" + (" + the tokenizer's load" if stage == "regenerate" else "")]
            for stage in ("extract", "regenerate")
        ]  # fmt: skip
        parts.append(
            f"### Job start to first request ({jobs['shards']} jobs per stage, one at a time, "
            "reference server on CPU)\n\n"
            + markdown_table(
                [
                    "job",
                    "median s",
                    "min s",
                    "manifest first_request_s",
                    "median s less the tokenizer's load",
                    "goal",
                ],
                rows,
            )  # fmt: skip
        )
    read = results.get("read")
    if read:
        parts.append(
            f"### A shard job's row read ({read['rows']} rows, {read['tokens']:,} tokens, "
            f"{read['rows'] // read['rows_per_shard']} shards)\n\n"
            + markdown_table(
                ["read", f"s (best of {repeat})"],
                [
                    ["the shard's row group", read["shard_read_s"]],
                    ["the whole table, then the shard's rows", read["whole_table_read_s"]],
                ],
            )
            + f"\nwhole / shard: {read['speedup']}x\n"
        )
    lease = results.get("lease")
    if lease:
        phases = ("idle", "beside_writers")
        rows = [
            [way] + [lease[phase][way][key] for phase in phases
                     for key in ("median_ms", "max_ms", "samples")]
            for way in LEASE_WAYS
        ]  # fmt: skip
        parts.append(
            "### A job's server lease, idle and beside chunk writers "
            f"({lease['writers']} x {lease['writer_gb']:g} GB into the same filesystem, "
            f"{lease['written_gb_per_s']} GB/s)\n\n"
            + markdown_table(
                [
                    "lease file",
                    "idle median ms",
                    "max ms",
                    "n",
                    "beside the writers median ms",
                    "max ms",
                    "n",
                ],
                rows,
            )  # fmt: skip
        )
    return (
        "\n".join(parts)
        + f"\nMachine: {machine_line(results['machine'])}.  \nCommand: `{results['command']}`\n"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-job-start-", dir=args.dir))
    results: dict = {
        "benchmark": "job_start",
        "command": command_line(),
        "machine": machine_info("cpu"),
        "goal_s": GOAL_S,
    }
    try:
        model_dir = None
        if "jobs" in args.parts or "imports" in args.parts:
            model_dir = work / "target"
            build_target(model_dir)
        if "imports" in args.parts:
            results["imports"] = measure_imports(args, model_dir)
        if "jobs" in args.parts:
            results["jobs"] = measure_jobs(args, work, model_dir)
        if "read" in args.parts:
            results["read"] = measure_read(args, work)
        if "lease" in args.parts:
            results["lease"] = measure_lease(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    markdown = markdown_of(results, args.repeat)
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

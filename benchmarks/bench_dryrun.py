#!/usr/bin/env python3
"""How long does `snakemake -n` take over a 5,000-shard plan? (goal: <= 10 s)

Writes, in a scratch directory, a JSONL dataset of --rows small conversations and a config
(the embedded default with that dataset and `shards.rows_per_shard` = --rows-per-shard; the
toy target is left unbuilt: parse time must not need it), then times the real Snakefile's dry
run: cold (no cached row count, shard digests or provenance stamps), warm (the second run,
what a user sees on every `snakemake -n` after the first), and warm with `--quiet all` (the
same DAG without the per-job listing). CPU only.

    python -u benchmarks/bench_dryrun.py                     # 10,000 rows -> 5,000 shards
    python -u benchmarks/bench_dryrun.py --rows 200 --out /tmp/dryrun.json   # quick check
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    REPO_ROOT,
    command_line,
    log,
    machine_info,
    machine_line,
    markdown_table,
    timed,
    write_results,
)

GOAL_S = 10.0


def write_dataset(path: Path, rows: int) -> None:
    with open(path, "w") as f:
        for i in range(rows):
            messages = [
                {"role": "user", "content": f"Question {i}: what is {i} + 1?"},
                {"role": "assistant", "content": f"{i + 1}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def write_config(path: Path, dataset: Path, rows_per_shard: int, regenerate: bool) -> None:
    config = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())
    config["dataset"]["path"] = str(dataset)
    config["dataset"]["regenerate"]["enabled"] = regenerate
    config["shards"]["rows_per_shard"] = rows_per_shard
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def dry_run(work: Path, log_path: Path, *extra: str) -> dict:
    """One `snakemake -n` through the repository's Snakefile; its output goes to `log_path`."""
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "-n",
        "--directory",
        str(work),
        "--configfile",
        str(work / "config.yaml"),
        "-s",
        str(REPO_ROOT / "Snakefile"),
        *extra,
    ]
    with timed() as t, open(log_path, "w") as out:
        proc = subprocess.run(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-20:])
        raise RuntimeError(f"snakemake -n exited with {proc.returncode}:\n{tail}")
    totals = re.findall(r"^total\s+(\d+)", text, flags=re.MULTILINE)
    return {"seconds": round(t["seconds"], 2), "jobs": int(totals[-1]) if totals else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--rows-per-shard", type=int, default=2)
    parser.add_argument("--work-root", default=None, help="scratch parent dir (default: /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir")
    parser.add_argument(
        "--regenerate",
        action="store_true",
        help="plan the regenerate jobs too (dataset.regenerate, on in config.yaml); off by "
        "default, as in the recorded runs before it existed",
    )
    parser.add_argument("--out", default=None, help="results JSON (markdown beside it)")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-dryrun-", dir=args.work_root))
    shards = -(-args.rows // args.rows_per_shard)
    try:
        write_dataset(work / "conversations.jsonl", args.rows)
        write_config(
            work / "config.yaml", work / "conversations.jsonl", args.rows_per_shard, args.regenerate
        )
        log(f"dry run over {args.rows} rows, {shards} shards in {work}")
        cold = dry_run(work, work / "cold.log")
        log(f"cold: {cold['seconds']}s, {cold['jobs']} jobs")
        warm = dry_run(work, work / "warm.log")
        log(f"warm: {warm['seconds']}s, {warm['jobs']} jobs")
        # Without printing every job: how much of the dry run is the per-job listing.
        quiet = dry_run(work, work / "quiet.log", "--quiet", "all")
        log(f"warm, --quiet all: {quiet['seconds']}s")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    results = {
        "benchmark": "dryrun",
        "command": command_line(),
        "machine": machine_info("cpu"),
        "setup": {
            "rows": args.rows,
            "rows_per_shard": args.rows_per_shard,
            "shards": shards,
            "regenerate": args.regenerate,
        },
        "cold": cold,
        "warm": warm,
        "warm_quiet": quiet,
        "goal_s": GOAL_S,
        "goal_met": cold["seconds"] <= GOAL_S,
    }
    markdown = (
        f"### Dry run over a {shards:,}-shard plan ({args.rows:,} rows)\n\n"
        + markdown_table(
            ["run", "seconds", "jobs planned", "goal"],
            [
                ["cold (first `snakemake -n`)", cold["seconds"], cold["jobs"], f"<= {GOAL_S:g} s"],
                ["warm (caches and stamps present)", warm["seconds"], warm["jobs"], ""],
                ["warm, `--quiet all` (no per-job listing)", quiet["seconds"], None, ""],
            ],
        )
        + f"\nMachine: {machine_line(results['machine'])}.  \nCommand: `{results['command']}`\n"
    )
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

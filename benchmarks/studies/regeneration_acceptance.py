#!/usr/bin/env python3
"""Does regenerating the assistant turns with the target help the drafter? (issue 17)

Runs the whole pipeline twice from the same config (default: the embedded default,
config.yaml), in two scratch run directories that differ only in `dataset.regenerate.enabled`
(off: the dataset's own replies; on: the target's), then evaluates both drafters on the same
held-out rows:

- offline (evaluate.py's teacher-forced simulated acceptance length) on the held-out rows of
  the regenerated run, i.e. the held-out prompts answered by the target itself, and on the
  held-out rows of the original data;
- live (speculative decoding against the target, the transformers harness of
  live_acceptance.py) on the same held-out prompts, `--live-prompts` of them (every held-out
  row by default), `--live-new-tokens` tokens each: a greedy target's own continuation.

Both runs build the same toy target (seeded; checked: same weights fingerprint). Also reported:
each run's own drafter/eval.json and drafter/live.json, the pipeline's wall time, and the
regeneration stage's output tokens and tokens/s per shard job.

`--overrides FILE` merges a YAML file over the config (the H200's SGLang engine and toy:
benchmarks/studies/h200_regeneration.yaml, through `bash tools/h200.sh regen-acceptance OUT`);
`--parallel` runs the two pipelines at once (cores split between them); `--cross-live 0` leaves
out the two extra live passes (each run's own drafter/live.json is still reported).

    python -u -m benchmarks.studies.regeneration_acceptance --work-root /tmp/regen-bench \
        --out benchmarks/results/regeneration_cpu.json          # the embedded default
    python -u -m benchmarks.studies.regeneration_acceptance --quick --work-root /tmp/q \
        --out /tmp/q.json

`--quick`: 40 rows, 10 per shard, a 20-step toy, 2 epochs, 32 new tokens per reply (a check that
the benchmark runs, not a measurement). A finished run directory is reused (snakemake finds
nothing to do), so an interrupted benchmark resumes.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from benchmarks.common import (
    REPO_ROOT,
    command_line,
    free_port,
    log,
    machine_info,
    machine_line,
    markdown_table,
    write_results,
)
from benchmarks.studies.whole_runs import run_workflow as snakemake
from benchmarks.studies.whole_runs import workflow_env as _env
from eaglepipe.core.config import merge_config

SAMPLE = REPO_ROOT / "data" / "sample" / "conversations.jsonl"
VARIANTS = ("original", "regenerated")  # dataset.regenerate.enabled: false, true


def base_config(args) -> dict:
    config = yaml.safe_load(Path(args.config).read_text())
    if args.overrides:
        config = merge_config(config, yaml.safe_load(Path(args.overrides).read_text()) or {})
    if args.quick:
        lines = SAMPLE.read_text().splitlines(keepends=True)[:40]
        dataset = Path(args.work_root) / "conversations-40.jsonl"
        dataset.write_text("".join(lines))
        config["dataset"]["path"] = str(dataset)
        config["shards"]["rows_per_shard"] = 10
        config["model"]["toy"]["train_steps"] = 20
        config["train"]["epochs"] = 2
        config["evaluate"]["live_prompts"] = 2
        config["evaluate"]["live_new_tokens"] = 8
        config["validate"]["spot_check_rows"] = 1
        config["dataset"]["regenerate"]["max_new_tokens"] = 32
    else:
        config["dataset"]["path"] = str((REPO_ROOT / config["dataset"]["path"]).resolve())
    return config


def run_config(config: dict, run_dir: Path, regenerate: bool) -> dict:
    config = copy.deepcopy(config)
    config["dataset"]["regenerate"]["enabled"] = regenerate
    config["server"]["port"] = free_port()
    config["server"]["dump_root"] = str(run_dir / "dumps")
    return config


def script(name: str, cwd: Path, *args: str) -> None:
    argv = [sys.executable, "-u", str(REPO_ROOT / "scripts" / name), *args]
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=_env())
    if result.returncode != 0:
        output = result.stdout + result.stderr
        raise SystemExit(f"{name} {' '.join(args)} failed in {cwd}:\n{output}")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def regeneration_stats(run_dir: Path) -> dict:
    manifests = [read_json(p) for p in sorted(run_dir.glob("regenerated/rows_*/manifest.json"))]
    shards = [
        {
            "shard": m["shard"],
            "rows": m["num_rows"],
            "turns": m["turns_regenerated"],
            "output_tokens": m["output_tokens"],
            "length_limited_replies": m["length_limited_replies"],
            "seconds": m["timing"]["seconds"],
            "output_tokens_per_s": m["timing"]["output_tokens_per_s"],
        }
        for m in manifests
    ]
    return {
        "shards": shards,
        "rows": sum(s["rows"] for s in shards),
        "turns": sum(s["turns"] for s in shards),
        "output_tokens": sum(s["output_tokens"] for s in shards),
        "length_limited_replies": sum(s["length_limited_replies"] for s in shards),
        "job_seconds": round(sum(s["seconds"] for s in shards), 1),
    }


def cross_evaluate(runs: dict[str, Path], args, scratch: Path) -> dict:
    """Each drafter offline on each run's held-out rows, and live on the same prompts."""
    offline: dict[str, dict] = {}
    for drafter, drafter_dir in runs.items():
        for data, data_dir in runs.items():
            out = scratch / f"eval-{drafter}-drafter-on-{data}-rows.json"
            script(
                "evaluate.py",
                data_dir,
                "--config", ".eaglepipe/config.json",
                "--model", str(drafter_dir / "drafter" / "model.safetensors"),
                "--vocab", str(drafter_dir / "drafter" / "vocab.safetensors"),
                "--table", "prepared/tokenized.parquet",
                "--out", str(out),
            )  # fmt: skip
            result = read_json(out)
            offline.setdefault(drafter, {})[data] = {
                "acceptance_length": result["acceptance_length"],
                "rows": result.get("rows"),
            }
    if args.cross_live == 0:
        return {"offline": offline, "live": {}}
    # Live: the regenerated run's table for the prompts (the held-out prompts are the same rows'
    # system and user turns in both tables), its target, more prompts than the pipeline's check.
    data_dir = runs["regenerated"]
    config = read_json(data_dir / ".eaglepipe" / "config.json")
    config["evaluate"]["live_prompts"] = args.cross_live
    config["evaluate"]["live_new_tokens"] = args.live_new_tokens
    live_config = scratch / "live-config.json"
    live_config.write_text(json.dumps(config))
    live: dict[str, dict] = {}
    for drafter, drafter_dir in runs.items():
        out = scratch / f"live-{drafter}-drafter.json"
        script(
            "live_acceptance.py",
            data_dir,
            "--config", str(live_config),
            "--export-dir", str(drafter_dir / "drafter" / "export" / "sglang"),
            "--table", "prepared/tokenized.parquet",
            "--out", str(out),
        )  # fmt: skip
        result = read_json(out)
        live[drafter] = {
            "acceptance_length": result["acceptance_length"],
            "prompts": result["prompts"],
            "max_new_tokens": result["max_new_tokens"],
            "offline_same_turns": result["offline_same_turns"],
            "outputs_match_greedy": result["lossless"]["identical"],
            "row_ids": [p["row_id"] for p in result["per_prompt"]],
        }
    return {"offline": offline, "live": live}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "config.yaml"))
    parser.add_argument("--work-root", required=True, help="scratch dir for the two runs")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--overrides", help="a YAML file merged over --config")
    parser.add_argument("--parallel", action="store_true", help="both pipelines at once")
    parser.add_argument(
        "--cross-live", type=int, default=256, help="held-out prompts (at most) live; 0: none"
    )
    parser.add_argument("--live-new-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--deadline-s", type=float, default=None, help="for the pipelines")
    parser.add_argument(
        "--snakemake-arg", action="append", default=[], help="passed on (repeatable)"
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.quick:
        args.cross_live, args.live_new_tokens = min(args.cross_live, 2), 8
    root = Path(args.work_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    args.work_root = str(root)
    config = base_config(args)
    runs = {variant: root / variant for variant in VARIANTS}
    cores = max(1, args.cores // len(runs)) if args.parallel else args.cores
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s

    def pipeline(variant: str) -> float:
        run_dir = runs[variant]
        run_dir.mkdir(exist_ok=True)
        config_file = run_dir / "config.yaml"
        if not config_file.exists():  # keep the port of an interrupted run: same resolved config
            wanted = run_config(config, run_dir, variant == "regenerated")
            config_file.write_text(yaml.safe_dump(wanted, sort_keys=False))
        log(f"{variant}: snakemake --cores {cores} in {run_dir}")
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        log_path = root / f"{variant}.log"
        seconds = round(snakemake(run_dir, cores, log_path, *args.snakemake_arg, timeout_s=left), 1)
        log(f"{variant}: {seconds:.0f}s")
        return seconds

    with ThreadPoolExecutor(len(runs) if args.parallel else 1) as pool:
        wall = dict(zip(runs, pool.map(pipeline, runs), strict=True))
    if config["model"]["path"] is None:
        # Each run built its own toy target: seeded, so the same bytes, or the comparison is void.
        weights = {(d / "models/toy-target/model.safetensors").read_bytes() for d in runs.values()}
        if len(weights) != 1:
            raise SystemExit("the two runs built different toy targets: the comparison is void")
    scratch = root / "cross"
    scratch.mkdir(exist_ok=True)
    cross = cross_evaluate(runs, args, scratch)
    own = {}
    for variant, run_dir in runs.items():
        live = read_json(run_dir / "drafter" / "live.json")
        own[variant] = {
            "offline": read_json(run_dir / "drafter" / "eval.json")["acceptance_length"],
            "live": live["acceptance_length"],
            "live_prompts": live["prompts"],
            "live_new_tokens": live.get("max_new_tokens", live.get("new_tokens")),
            "live_outputs_match_greedy": (live.get("lossless") or {}).get(
                "identical", live.get("outputs_match_greedy")
            ),
            "live_row_ids": [p["row_id"] for p in live.get("per_prompt", [])],
        }
    results = {
        "benchmark": "regeneration",
        "command": command_line(),
        "machine": machine_info(),
        "config": args.config,
        "overrides": args.overrides,
        "parallel": args.parallel,
        "quick": args.quick,
        "pipeline_wall_s": wall,
        "regeneration": regeneration_stats(runs["regenerated"]),
        "pipeline_own": own,
        "cross": cross,
    }
    rows = []
    for drafter in VARIANTS:
        rows.append(
            [
                f"{drafter} replies",
                cross["offline"][drafter]["regenerated"]["acceptance_length"],
                cross["offline"][drafter]["original"]["acceptance_length"],
                cross["live"].get(drafter, {}).get("acceptance_length", "not run"),
                own[drafter]["offline"],
                own[drafter]["live"],
            ]
        )
    live = cross["live"].get("regenerated", {"prompts": 0, "new_tokens": 0})
    markdown = (
        f"Machine: {machine_line(results['machine'])}\n\n"
        + markdown_table(
            [
                "drafter trained on",
                "offline, held-out target replies",
                "offline, held-out dataset replies",
                f"live ({live['prompts']} prompts x {live['new_tokens']} tokens)",
                "pipeline's eval.json",
                "pipeline's live.json",
            ],
            rows,
        )
        + "\n"
        + markdown_table(
            ["regenerated rows", "turns", "output tokens", "at max_new_tokens", "job seconds"],
            [
                [
                    results["regeneration"][k]
                    for k in ("rows", "turns", "output_tokens", "length_limited_replies")
                ]
                + [results["regeneration"]["job_seconds"]]
            ],
        )
    )
    print(markdown, flush=True)
    write_results(args.out, results, markdown)


if __name__ == "__main__":
    main()

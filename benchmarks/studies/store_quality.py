#!/usr/bin/env python3
"""Does a drafter trained on an FP8 store accept as well as bf16's?

For each stored dtype of `--store-dtypes` (extract.store: bf16; fp8aux, the aux states in e4m3;
fp8, aux and final in e4m3) the whole pipeline runs in a scratch run directory of its own, from
the same config (default: the embedded default, config.yaml; `--overrides FILE` merges a YAML
file over it, e.g. benchmarks/studies/h200_regeneration.yaml for SGLang and its toy on the
H200), once
per seed of `--seeds` (`train.seed`): the first seed builds everything, each later one retrains,
evaluates, exports and checks live only (the stores share nothing but the config, so each
extracts its own shards; the seeded toy target is the same in every directory).

Per store and seed: the offline acceptance length in decode order at 7 and 3 draft steps
(drafter/eval.json's `decode_order`) and, with evaluate.live_prompts > 0, the live one at each
setting of `--live-settings` (7/1/8 is the pipeline's own drafter/live.json at train.ttt_length
7; any other runs scripts/live_acceptance.py once more with `--speculative`, sharing the plain
greedy reference). Per store: mean, standard deviation, min and max over the seeds; an FP8 store
passes a figure when its mean lies within the bf16 seeds' [min, max].

    python -u -m benchmarks.studies.store_quality --work-root /tmp/store-quality \\
        --store-dtypes bf16,fp8aux,fp8 --seeds 0,1,2 --out /tmp/store_quality.json   # CPU
    python -u -m benchmarks.studies.store_quality \\
        --overrides benchmarks/studies/h200_regeneration.yaml \\
        --work-root /tmp/sq --seeds 0,1,2 --out $OUT/store_quality.json             # H200
    python -u -m benchmarks.studies.store_quality --quick --work-root /tmp/q --out /tmp/q.json

`--quick`: 40 rows, 10 per shard, a 20-step toy, 2 epochs, 2 live prompts of 8 tokens, no
regeneration (a check that the benchmark runs, not a measurement). A finished run directory is
reused (snakemake finds nothing to do) and a seed whose figures are kept (`<store>/seed<N>/`)
is not trained again, so an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.common import (
    REPO_ROOT,
    command_line,
    free_port,
    log,
    machine_info,
    markdown_table,
    write_results,
)
from benchmarks.stores import STORE_VARIANTS, bytes_per_token, store_variants
from benchmarks.studies.whole_runs import run_workflow, workflow_env
from eaglepipe.core.config import merge_config

SAMPLE = REPO_ROOT / "data" / "sample" / "conversations.jsonl"
OFFLINE_STEPS = ("7", "3")  # decode_order keys: the published 7/1/8 and 3/1/4 chains


def base_config(args) -> dict:
    config = yaml.safe_load(Path(args.config).read_text())
    if args.overrides:
        config = merge_config(config, yaml.safe_load(Path(args.overrides).read_text()) or {})
    if args.quick:
        lines = SAMPLE.read_text().splitlines(keepends=True)[:40]
        dataset = Path(args.work_root) / "conversations-40.jsonl"
        dataset.write_text("".join(lines))
        config["dataset"]["path"] = str(dataset)
        config["dataset"]["regenerate"]["enabled"] = False
        config["shards"]["rows_per_shard"] = 10
        config["model"]["toy"]["train_steps"] = 20
        config["train"]["epochs"] = 2
        config["evaluate"]["live_prompts"] = 2
        config["evaluate"]["live_new_tokens"] = 8
        config["validate"]["spot_check_rows"] = 1
    else:
        config["dataset"]["path"] = str((REPO_ROOT / config["dataset"]["path"]).resolve())
    return config


def run_config(config: dict, run_dir: Path, store: str, seed: int) -> dict:
    config = copy.deepcopy(config)
    config["extract"]["store"] = dict(STORE_VARIANTS[store])
    config["train"]["seed"] = seed
    config["server"]["port"] = free_port()
    config["server"]["dump_root"] = str(run_dir / "dumps")
    return config


def extra_live(run_dir: Path, setting: str) -> Path:
    """Live acceptance at another speculative setting, beside the pipeline's own live.json."""
    from eaglepipe.core.run import load_run
    from eaglepipe.drafter.live import live_export_engine

    out = run_dir / "drafter" / f"live_{setting.replace('/', '_')}.json"
    engine = live_export_engine(load_run(run_dir / ".eaglepipe" / "config.json"))
    argv = [
        sys.executable, "-u", str(REPO_ROOT / "scripts" / "live_acceptance.py"),
        "--config", ".eaglepipe/config.json", "--table", "prepared/tokenized.parquet",
        "--eval", "drafter/eval.json", "--out", str(out), "--speculative", setting,
        "--greedy-reference", "drafter/greedy_reference.json",
    ]  # fmt: skip
    if engine:
        argv += ["--export-dir", f"drafter/export/{engine}"]
    result = subprocess.run(argv, cwd=run_dir, capture_output=True, text=True, env=workflow_env())
    if result.returncode != 0:
        raise SystemExit(f"live acceptance at {setting} failed in {run_dir}:\n{result.stderr}")
    return out


def seed_figures(run_dir: Path, live_settings: list[str], ttt_length: int) -> dict:
    """What one seed's drafter achieved: offline at 7 and 3 steps, live at each setting."""
    evaluation = json.loads((run_dir / "drafter" / "eval.json").read_text())
    turns = evaluation["headline_turns"]
    figures = {
        f"offline_{steps}": evaluation["decode_order"][steps][turns]["acceptance_length"]
        for steps in OFFLINE_STEPS
        if steps in evaluation["decode_order"]
    }
    live_path = run_dir / "drafter" / "live.json"
    live = json.loads(live_path.read_text()) if live_path.exists() else {}
    if live.get("acceptance_length") is None:
        return figures  # evaluate.live_prompts is 0: nothing decoded live
    own = f"{ttt_length}/1/{ttt_length + 1}"
    for setting in live_settings:
        path = live_path if setting == own else extra_live(run_dir, setting)
        figures[f"live_{setting}"] = json.loads(path.read_text())["acceptance_length"]
    return figures


def spread(values: list[float]) -> dict:
    return {
        "mean": round(statistics.fmean(values), 4),
        "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else None,
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "seeds": len(values),
    }


def verdicts(summary: dict) -> dict:
    """Per FP8 store and figure: is its mean within the bf16 seeds' [min, max]?"""
    base = summary.get("bf16")
    if not base:
        return {}
    out = {}
    for store, figures in summary.items():
        if store == "bf16":
            continue
        out[store] = {
            name: base[name]["min"] <= spread_["mean"] <= base[name]["max"]
            for name, spread_ in figures.items()
            if name in base
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "config.yaml"))
    parser.add_argument("--overrides", default=None, help="YAML merged over --config")
    parser.add_argument("--store-dtypes", default="bf16,fp8aux,fp8")
    parser.add_argument("--seeds", default="0,1,2", help="train.seed values, in order")
    parser.add_argument(
        "--live-settings", default="7/1/8,3/1/4",
        help="live speculative settings (STEPS/TOPK/DRAFT_TOKENS) per seed, when live_prompts > 0",
    )  # fmt: skip
    parser.add_argument("--work-root", required=True)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=None, help="whole-run budget")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--snakemake-arg", action="append", default=[], help="passed on (repeatable)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    stores = store_variants(parser, "--store-dtypes", args.store_dtypes)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    live_settings = [s.strip() for s in args.live_settings.split(",") if s.strip()]
    work_root = Path(args.work_root).resolve()
    work_root.mkdir(parents=True, exist_ok=True)
    config = base_config(args)
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    results: dict = {
        "benchmark": "store_quality",
        "command": command_line(),
        "machine": machine_info(),
        "setup": {
            "stores": stores,
            "seeds": seeds,
            "live_settings": live_settings,
            "quick": args.quick,
            "overrides": args.overrides,
        },  # fmt: skip
        "bytes_per_token": bytes_per_token(stores),
        "runs": {},
    }
    ttt = config["train"]["ttt_length"]
    for store in stores:
        run_dir = work_root / store
        run_dir.mkdir(exist_ok=True)
        results["runs"][store] = {}
        for seed in seeds:
            kept = run_dir / f"seed{seed}"
            if (kept / "figures.json").exists():  # done by an earlier, interrupted call
                results["runs"][store][str(seed)] = json.loads((kept / "figures.json").read_text())
                continue
            (run_dir / "config.yaml").write_text(
                yaml.safe_dump(run_config(config, run_dir, store, seed), sort_keys=False)
            )
            left = None if deadline is None else max(1.0, deadline - time.monotonic())
            log(f"{store}, seed {seed}: snakemake --cores {args.cores} in {run_dir}")
            seconds = run_workflow(
                run_dir, args.cores, run_dir / "snakemake.log", *args.snakemake_arg,
                "drafter/live.json", timeout_s=left,
            )  # fmt: skip
            figures = {"seconds": round(seconds, 1), **seed_figures(run_dir, live_settings, ttt)}
            kept.mkdir(exist_ok=True)
            for name in ("eval.json", "live.json"):
                if (run_dir / "drafter" / name).exists():
                    shutil.copy2(run_dir / "drafter" / name, kept / name)
            (kept / "figures.json").write_text(json.dumps(figures))
            results["runs"][store][str(seed)] = figures
            log(f"{store}, seed {seed}: {figures}")
            write_results(args.out, results)
    summary = {
        store: {
            name: spread([runs[s][name] for s in runs if runs[s].get(name) is not None])
            for name in sorted({k for r in runs.values() for k in r if k != "seconds"})
        }
        for store, runs in results["runs"].items()
    }
    results["summary"] = summary
    results["within_bf16_spread"] = verdicts(summary)
    rows = [
        [store, name, s["mean"], s["stdev"], s["min"], s["max"], s["seeds"],
         results["within_bf16_spread"].get(store, {}).get(name, "")]
        for store, figures in summary.items()
        for name, s in figures.items()
    ]  # fmt: skip
    markdown = (
        "### Drafter quality by stored dtype (acceptance length, over seeds)\n\n"
        + markdown_table(
            ["store", "figure", "mean", "stdev", "min", "max", "seeds", "within bf16's spread"],
            rows,
        )
        + f"\nCommand: `{results['command']}`\n"
    )
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

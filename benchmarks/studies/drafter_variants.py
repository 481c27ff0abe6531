#!/usr/bin/env python3
"""Held-out acceptance of drafter variants, trained on one finished run's data.

In a finished run directory (e.g. the embedded default after `snakemake --cores 2`), the
pipeline's own stages run once per variant with the run's resolved config, changing only
`train.drafter`: train (the run's validated shards, its draft vocabulary, the same seed, so
the same batches and steps), evaluate (the offline estimate on the held-out rows), export
(both engines), live acceptance (the run's harness: transformers for `server.engine:
reference`). Each variant's files go to --out/<name>/ (model, train_log.jsonl, eval.json,
export/, live.json, result.json); a variant whose result.json exists is read back, not
redone (delete its directory to redo it; one trained for other epochs is redone). The table
goes to stdout and --out/summary.json.

    python -u -m benchmarks.studies.drafter_variants --run-dir <run>
    python -u -m benchmarks.studies.drafter_variants --run-dir <run> --variants plain,mla
    python -u -m benchmarks.studies.drafter_variants --run-dir <run> --seeds 1,2
    python -u -m benchmarks.studies.drafter_variants --run-dir <run> --epochs 2  # quicker, CPU

`--seeds` trains each variant once per `train.seed` (another seed: another initialisation and
batch order), into --out/<name>-seed<k>/; without it the run's own seed is used, so the plain
variant reproduces the run's drafter. `--epochs` replaces `train.epochs` for every variant
(fewer steps than the run's drafter had: the plain variant then no longer reproduces it); the
summary records the `train` settings used.

Variants: plain, fc_norm, norm_output, fc_norm+norm_output (the default set), and any
'+'-joined set of the flags fc_norm, norm_before_fc, norm_output, norm_before_residual and
mla (the MLA layer: for MLA targets only).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch

from eaglepipe.core.config import RESOLVED_CONFIG
from eaglepipe.core.drafter_options import NORM_FLAGS, default_options
from eaglepipe.core.run import config_from_arg, resolve
from eaglepipe.drafter.evaluate import evaluate
from eaglepipe.drafter.export import export
from eaglepipe.drafter.live import live_acceptance, live_export_engine
from eaglepipe.drafter.train import train
from eaglepipe.plan.freshness import planned_manifests, planned_validations

DEFAULT_VARIANTS = "plain,fc_norm,norm_output,fc_norm+norm_output"
TABLE = "prepared/tokenized.parquet"
VOCAB = "drafter/vocab.safetensors"


def variant_options(name: str) -> dict:
    """`train.drafter` for a variant name such as `fc_norm+norm_output` or `mla`."""
    options = default_options()
    options.pop("mla")
    for part in name.split("+"):
        if part == "plain":
            continue
        if part == "mla":
            options["layer"] = "mla"
        elif part in NORM_FLAGS:
            options[part] = True
        else:
            raise SystemExit(f"unknown variant part {part!r} in {name!r}")
    return options


def run_variant(base: dict, name: str, seed: int, out: Path) -> dict:
    """Train, evaluate, export and run live acceptance for one variant (cwd: the run dir)."""
    out.mkdir(parents=True, exist_ok=True)
    live_path, result_path = out / "live.json", out / "result.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if result.get("epochs") == base["train"]["epochs"]:
            print(f"[{name}] reusing {result_path}", flush=True)
            return result
        print(f"[{name}] {result_path} was trained for other epochs: training again", flush=True)
    config = copy.deepcopy(base)
    config["train"]["drafter"] = variant_options(name)
    config["train"]["seed"] = seed
    run = resolve(config)
    model = out / "model.safetensors"
    began = time.perf_counter()
    summary = train(
        run,
        vocab_path=VOCAB,
        table_path=TABLE,
        manifests=planned_manifests(run),
        validated=planned_validations(run),
        out_path=str(model),
        log_path=str(out / "train_log.jsonl"),
        checkpoint_dir=str(out / "checkpoints"),
    )
    train_s = time.perf_counter() - began
    offline = evaluate(
        run,
        model_path=str(model),
        vocab_path=VOCAB,
        table_path=TABLE,
        manifests=planned_manifests(run),
        out_path=str(out / "eval.json"),
        plot_path=None,
    )
    export(run, model_path=str(model), vocab_path=VOCAB, out_dir=str(out / "export"))
    engine = live_export_engine(run)
    live = live_acceptance(
        run,
        export_dir=str(out / "export" / engine) if engine else None,
        table_path=TABLE,
        out_path=str(live_path),
        eval_path=str(out / "eval.json"),
    )
    result = {
        "variant": name,
        "seed": seed,
        "drafter": config["train"]["drafter"],
        "epochs": config["train"]["epochs"],
        "steps": summary["steps"],
        "final_loss": summary["final_loss"],
        "train_seconds": round(train_s, 1),
        "offline_acceptance_length": offline["acceptance_length"],
        "step_accuracy": offline["accuracy"],
        "live_acceptance_length": live["acceptance_length"],
        "live_export": live["export_engine"],
        "live_prompts": live["prompts"],
        "live_offline_same_turns": live["offline_same_turns"],
        "outputs_match_greedy": live["lossless"]["identical"],
    }
    result_path.write_text(json.dumps(result, indent=1))
    return result


def table(results: list[dict]) -> str:
    lines = [
        "| variant | seed | steps | final loss | offline acceptance | step accuracy (0..k-1) "
        "| live acceptance | outputs = greedy | train s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        accuracy = ", ".join(f"{a:.2f}" for a in r["step_accuracy"])
        live = r["live_acceptance_length"]
        lines.append(
            f"| {r['variant']} | {r['seed']} | {r['steps']} | {r['final_loss']:.3f} "
            f"| {r['offline_acceptance_length']:.3f} | {accuracy} "
            f"| {'n/a' if live is None else f'{live:.3f}'} "
            f"| {r['outputs_match_greedy']}/{r['live_prompts']} | {r['train_seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="a finished pipeline run directory")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--seeds", help="comma-separated train.seed values (default: the run's)")
    parser.add_argument("--epochs", type=int, help="train.epochs for every variant")
    parser.add_argument("--out", help="results directory (default: <run-dir>/variants)")
    args = parser.parse_args()
    run_dir = Path(args.run_dir).resolve()
    out = Path(args.out).resolve() if args.out else run_dir / "variants"
    os.chdir(run_dir)  # the stages read the run's planned shards relative to it
    base = config_from_arg(str(RESOLVED_CONFIG))
    if args.epochs is not None:
        base["train"]["epochs"] = args.epochs
    names = [n for n in args.variants.split(",") if n]
    for name in names:
        variant_options(name)  # an unknown name stops before any training
    if args.seeds:
        runs = [(n, int(k), f"{n}-seed{k}") for k in args.seeds.split(",") for n in names]
    else:
        runs = [(n, base["train"]["seed"], n) for n in names]
    results = [run_variant(base, name, seed, out / folder) for name, seed, folder in runs]
    facts = {
        "date": datetime.date.today().isoformat(),
        "run_dir": str(run_dir),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "train": {k: v for k, v in base["train"].items() if k not in ("drafter", "seed")},
        "evaluate": base["evaluate"],
        "results": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(facts, indent=1))
    print(f"\n{facts['date']}, {facts['machine']}, run {run_dir}\n")
    print(table(results), flush=True)


if __name__ == "__main__":
    main()

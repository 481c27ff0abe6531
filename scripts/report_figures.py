#!/usr/bin/env python3
"""Draw one group of report figures (and its table): dataset, extraction, validation, training,
acceptance; or the benchmarks' table. Called by rules/report.smk; the figures are marked for
`snakemake --report`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglepipe.core.config import HIDDEN_STATES_DIR, VALIDATED_DIR
from eaglepipe.core.errors import PipelineError, one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.ops import report
from eaglepipe.ops.status import planned_shard_names


def _inputs(files: list[str], config_path: str | None, template: str) -> list[Path]:
    """Explicit files, or one per shard of the run's plan: a plan of 5,000 shards would not fit
    on a shell command line."""
    paths = [Path(f) for f in files]
    if config_path:
        run = load_run(config_path)
        paths += [Path(template.format(shard=name)) for name in planned_shard_names(run)]
    if not paths:
        raise PipelineError("no input files: list them, or pass --config to read every shard's")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="figure", required=True)

    p = sub.add_parser("dataset", help="length histogram and skipped-row reasons")
    p.add_argument("--table", required=True, help="prepared/tokenized.parquet")
    p.add_argument("--summary", required=True, help="prepared/summary.json")
    p.add_argument("--skipped", required=True, help="prepared/skipped.json")
    p.add_argument("--out", required=True, help="PNG to write")

    p = sub.add_parser("extraction", help="throughput per shard and the shards' timeline")
    p.add_argument("manifests", nargs="*", help="hidden_states/<shard>/manifest.json files")
    p.add_argument("--config", help="read every planned shard's manifest (resolved config)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--table", help="CSV of per-shard figures to write")

    p = sub.add_parser("validation", help="per-layer norm statistics and spot-check errors")
    p.add_argument("reports", nargs="*", help="validated/<shard>.json files")
    p.add_argument("--config", help="read every planned shard's report (resolved config)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--table", help="CSV of per-shard figures to write")

    p = sub.add_parser("training", help="loss and per-position accuracy curves")
    p.add_argument("--log", required=True, help="drafter/train_log.jsonl")
    p.add_argument("--out", required=True, help="PNG to write")

    p = sub.add_parser("acceptance", help="per-position acceptance bars")
    p.add_argument("--eval", required=True, help="drafter/eval.json")
    p.add_argument("--live", help="drafter/live.json (live speculative decoding)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--table", help="CSV of per-position figures to write")

    p = sub.add_parser("benchmarks", help="one table of every benchmark's results")
    p.add_argument("results", nargs="+", help="drafter/benchmarks/<name>.json files")
    p.add_argument("--table", required=True, help="CSV to write")

    args = parser.parse_args(argv)
    with one_line_errors():
        if args.figure == "dataset":
            report.dataset_figure(args.table, args.summary, args.skipped, args.out)
        elif args.figure == "extraction":
            manifests = _inputs(
                args.manifests, args.config, f"{HIDDEN_STATES_DIR}/{{shard}}/manifest.json"
            )
            report.extraction_figure(manifests, args.out, args.table)
        elif args.figure == "validation":
            reports = _inputs(args.reports, args.config, f"{VALIDATED_DIR}/{{shard}}.json")
            report.validation_figure(reports, args.out, args.table)
        elif args.figure == "training":
            report.training_figure(args.log, args.out)
        elif args.figure == "benchmarks":
            report.benchmark_table(args.results, args.table)
        else:
            report.acceptance_figure(args.eval, args.out, args.live, args.table)
    print(f"wrote {getattr(args, 'out', None) or args.table}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

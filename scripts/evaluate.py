#!/usr/bin/env python3
"""Evaluate the drafter on held-out rows of the planned shards: per-step accuracy and simulated
acceptance length."""

import argparse

from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.drafter.evaluate import evaluate
from eaglepipe.plan.freshness import planned_manifests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot")
    args = parser.parse_args()
    with one_line_errors():
        run = load_run(args.config)
        evaluate(
            run,
            model_path=args.model,
            vocab_path=args.vocab,
            table_path=args.table,
            manifests=planned_manifests(run),
            out_path=args.out,
            plot_path=args.plot,
        )


if __name__ == "__main__":
    main()

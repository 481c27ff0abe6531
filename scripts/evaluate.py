#!/usr/bin/env python3
"""Evaluate the drafter on held-out rows of the planned shards: per-step accuracy and simulated
acceptance length."""

import argparse

from eaglepipe.config import config_from_arg
from eaglepipe.drafter.evaluate import evaluate
from eaglepipe.errors import one_line_errors
from eaglepipe.workflow import planned_manifests


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
        config = config_from_arg(args.config)
        evaluate(
            config,
            model_path=args.model,
            vocab_path=args.vocab,
            table_path=args.table,
            manifests=planned_manifests(config),
            out_path=args.out,
            plot_path=args.plot,
        )


if __name__ == "__main__":
    main()

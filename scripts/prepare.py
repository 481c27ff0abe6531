#!/usr/bin/env python3
"""Tokenize the dataset with the target's chat template: prepared/tokenized.parquet and friends."""

import argparse
import sys

from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.prepare.table import run_prepare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config JSON or a YAML config")
    parser.add_argument(
        "--workers", type=int, default=1, help="processes that tokenize (the rule's threads)"
    )
    args = parser.parse_args()
    with one_line_errors():
        run_prepare(load_run(args.config), workers=args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Build the embedded toy target (tiny Llama + BPE tokenizer with a chat template) into --out."""

import argparse
import sys

from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.data.toy_target import build_toy_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config JSON or a YAML config")
    parser.add_argument("--out", required=True, help="model directory to (re)create")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: 1, fastest for the tiny model)",
    )
    args = parser.parse_args()
    with one_line_errors():
        run = load_run(args.config)
        build_toy_target(
            args.out, run.model.toy.as_dict(), run.dataset.path, num_threads=args.threads
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

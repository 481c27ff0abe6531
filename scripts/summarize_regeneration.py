#!/usr/bin/env python3
"""Check every regenerated shard (fresh, rows intact) and write regenerated/summary.json."""

import argparse
import sys
from pathlib import Path

from eaglepipe.core.config import REGENERATION_SUMMARY
from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.regenerate.summary import write_regeneration_summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config JSON or a YAML config")
    parser.add_argument("--out", type=Path, default=REGENERATION_SUMMARY)
    args = parser.parse_args()
    with one_line_errors():
        summary = write_regeneration_summary(load_run(args.config), args.out)
        print(
            f"regeneration: {summary['shards']} shard(s), {summary['num_rows']:,} rows, "
            f"{summary['output_tokens']:,} tokens generated, bad rows: {summary['bad_rows']}, "
            f"replies at max_new_tokens: {summary['length_limited_replies']}; {args.out}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

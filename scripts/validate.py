#!/usr/bin/env python3
"""Validate one extracted shard; write validated/<shard>.json only if every check passes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglepipe.core.config import VALIDATED_DIR
from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.validate import ShardPaths, validate_shard


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config JSON or a YAML config")
    parser.add_argument("--shard", required=True, help="shard name, e.g. rows_0-2000")
    parser.add_argument(
        "--validated-dir",
        type=Path,
        default=VALIDATED_DIR,
        help=f"where the report goes (default {VALIDATED_DIR})",
    )
    args = parser.parse_args()
    with one_line_errors():
        run = load_run(args.config)
        validate_shard(run, args.shard, ShardPaths(validated_dir=args.validated_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Live speculative decoding with the exported SGLang drafter against the target."""

import argparse
import sys
from pathlib import Path

from eaglepipe.config import DRAFTER_DIR, config_from_arg
from eaglepipe.drafter.live import live_acceptance
from eaglepipe.errors import PipelineError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--export-dir", required=True, help="drafter/export/sglang")
    parser.add_argument("--table", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--eval", default=str(Path(DRAFTER_DIR) / "eval.json"), help="offline estimate to report"
    )
    args = parser.parse_args()
    try:
        live_acceptance(
            config_from_arg(args.config),
            export_dir=args.export_dir,
            table_path=args.table,
            out_path=args.out,
            eval_path=args.eval,
        )
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Live speculative decoding with the exported drafter against the target (drafter/live.json)."""

import argparse
from pathlib import Path

from eaglepipe.core.config import DRAFTER_DIR
from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.drafter.live import live_acceptance
from eaglepipe.drafter.live_run import SpeculativeSetting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument(
        "--export-dir",
        help="drafter/export/<engine> (not needed when evaluate.live_prompts is 0)",
    )
    parser.add_argument("--table", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--eval", default=str(Path(DRAFTER_DIR) / "eval.json"), help="offline estimate to report"
    )
    parser.add_argument(
        "--speculative",
        metavar="STEPS/TOPK/DRAFT_TOKENS",
        help="how SGLang drafts, e.g. 3/1/4 (default: a chain of train.ttt_length tokens)",
    )
    parser.add_argument(
        "--greedy-reference",
        metavar="JSON",
        help="reuse the target's plain greedy outputs stored here when they were made for the "
        "same target, serving settings and turns; else make them and store them here",
    )
    args = parser.parse_args()
    with one_line_errors():
        live_acceptance(
            load_run(args.config),
            export_dir=args.export_dir,
            table_path=args.table,
            out_path=args.out,
            eval_path=args.eval,
            speculative=SpeculativeSetting.parse(args.speculative) if args.speculative else None,
            greedy_reference=args.greedy_reference,
        )


if __name__ == "__main__":
    main()

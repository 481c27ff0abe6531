#!/usr/bin/env python3
"""Export the drafter for SGLang and vLLM (one directory per engine)."""

import argparse
import sys

from eaglepipe.config import config_from_arg
from eaglepipe.drafter.export import export
from eaglepipe.errors import PipelineError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    try:
        export(
            config_from_arg(args.config),
            model_path=args.model,
            vocab_path=args.vocab,
            out_dir=args.out_dir,
        )
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

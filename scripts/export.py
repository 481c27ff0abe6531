#!/usr/bin/env python3
"""Export the drafter for SGLang and vLLM (one directory per engine)."""

import argparse

from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.drafter.export import export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    with one_line_errors():
        export(
            load_run(args.config),
            model_path=args.model,
            vocab_path=args.vocab,
            out_dir=args.out_dir,
        )


if __name__ == "__main__":
    main()

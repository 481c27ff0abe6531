#!/usr/bin/env python3
"""Extract one shard's hidden states through the shared server (resumes verified chunks)."""

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config JSON or a YAML config")
    parser.add_argument("--shard", required=True, help="shard name, e.g. rows_0-64")
    args = parser.parse_args()
    # Imported after the arguments parse: --help and a bad argument answer at once.
    from eaglepipe.core.errors import one_line_errors
    from eaglepipe.core.run import load_run
    from eaglepipe.extract.shard import run_extract_job

    with one_line_errors():
        run_extract_job(load_run(args.config), args.shard)
    return 0


if __name__ == "__main__":
    sys.exit(main())

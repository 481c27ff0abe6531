#!/usr/bin/env python3
"""Regenerate the assistant turns of one shard with the target (resumes journalled rows)."""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config JSON or a YAML config")
    parser.add_argument("--shard", required=True, help="e.g. rows_0-64")
    args = parser.parse_args()
    # Imported after the arguments parse: --help and a bad argument answer at once.
    from eaglepipe.core.errors import one_line_errors
    from eaglepipe.core.run import load_run
    from eaglepipe.regenerate.shard import run_regenerate_job

    with one_line_errors():
        run_regenerate_job(load_run(args.config), args.shard)


if __name__ == "__main__":
    main()

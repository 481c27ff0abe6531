#!/usr/bin/env python3
"""One configured benchmark served live: drafter/benchmarks/<name>.json and its bar chart."""

import argparse

from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--benchmark", required=True, help="a name under benchmarks.run")
    parser.add_argument("--export-dir", required=True, help="drafter/export/<engine>")
    parser.add_argument("--out", required=True, help="results JSON to write")
    parser.add_argument("--plot", required=True, help="bar chart PNG to write")
    args = parser.parse_args()
    with one_line_errors():
        from eaglepipe.ops.report import benchmark_figure
        from eaglepipe.prompt_bench.measure import measure_benchmark

        result = measure_benchmark(
            load_run(args.config), args.benchmark, export_dir=args.export_dir, out_path=args.out
        )
        benchmark_figure(result, args.plot)
    print(f"wrote {args.out} and {args.plot}", flush=True)


if __name__ == "__main__":
    main()

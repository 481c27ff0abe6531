#!/usr/bin/env python3
"""Train the EAGLE-3 drafter on the planned shards, all validated (also under torchrun for DDP).

The shards are the run's plan (dataset row count and shards.rows_per_shard), never a glob: a
shard directory left from an earlier plan is not read.
"""

import argparse

import torch

from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.drafter.train import train
from eaglepipe.plan.freshness import planned_manifests, planned_validations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--out", required=True)
    # torchrun reads an abbreviated "--log" as its own --log-dir: use --train-log under torchrun.
    parser.add_argument("--log", "--train-log", dest="log", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    args = parser.parse_args()
    try:
        with one_line_errors():
            run = load_run(args.config)
            train(
                run,
                vocab_path=args.vocab,
                table_path=args.table,
                manifests=planned_manifests(run),
                validated=planned_validations(run),
                out_path=args.out,
                log_path=args.log,
                checkpoint_dir=args.checkpoint_dir,
            )
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""SpecForge 0.2 and this pipeline on the 8B-shaped random Llama (bf16), the rows of issue 27
the toy comparison (compare.py) could not give: (a) hidden-state generation on the same
rows, each killed with `kill -9` at half its rows and run again; (b) training tokens/s of both
trainers on those features; (c) the two feature sets compared row by row.

    bash tools/h200.sh specforge-scale $OUT                  # the H200, one device call
    python3 -u -m benchmarks.studies.specforge.scale --dry-run --out /tmp/scale.json  # commands

Steps (scale_steps.py; each recorded in WORK/state.json when it ends, so a later
call on the warm machine goes on where one stopped; a step starts only when the time left
covers its usual length, and only once the steps it needs are done):

  model             the random target made on the GPU and saved (word tokenizer, chat template)
  inputs            --rows rows of --row-tokens ids: SpecForge's JSONL, template, target view and
                    draft config (aux layers [1, 15, 28], draft vocabulary --draft-vocab); the
                    pipeline's prepared table with the same ids and loss masks; SpecForge's
                    wheels installed
  specforge-kill    prepare_hidden_states.py (SGLang in-process, batch 1), kill -9 at --kill-at
  specforge-resume  the same command again, to its end
  pipeline          the pipeline's SGLang capture server; --shards extract jobs at once, kill -9
                    at --kill-at; the jobs again; the shards checked; the server stopped
  fidelity          compare_features on every row both stored
  train-specforge   `specforge train` (its 8B offline recipe, batch 1, TTT 7), --specforge-steps
  train-eaglepipe   benchmarks.speed.train --run-dir on the pipeline's shards, --eaglepipe-steps
                    steps

--out gets the JSON and a markdown table beside it after every step. Exit 0 when every step
is done (the target and both feature sets are then removed unless --keep-data), 3 when some
are left for a later call, 1 when a step failed (a later call retries it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.studies.specforge.scale_steps import run_plan
from benchmarks.studies.specforge.steps import SPECFORGE_WHEELS


def default_work_root() -> Path:
    """/dev/shm when it can be written (the target, 16 GB, and both feature sets live there),
    else beside tools/h200.sh's other parts."""
    if os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm/eaglepipe-specforge-scale")
    return Path(os.environ.get("EAGLEPIPE_H200_ROOT", "/tmp/eaglepipe-h200")) / "specforge-scale"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--work-root", type=Path, default=default_work_root())
    parser.add_argument("--rows", type=int, default=96, help="rows both generators store")
    parser.add_argument("--row-tokens", type=int, default=2048, help="tokens of every row")
    parser.add_argument("--seed", type=int, default=20261204)
    parser.add_argument("--shards", type=int, default=2, help="the pipeline's shards (jobs)")
    parser.add_argument("--chunk-mb", type=float, default=256.0, help="the pipeline's chunks")
    parser.add_argument("--inflight-requests", type=int, default=32, help="per extract job")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8, help="its server's")
    parser.add_argument(
        "--kill-at", type=float, default=0.5, help="kill -9 once this share of rows is stored"
    )
    parser.add_argument("--draft-vocab", type=int, default=32000, help="both drafters'")
    parser.add_argument("--specforge-steps", type=int, default=64, help="batch 1: 1 row a step")
    parser.add_argument("--eaglepipe-steps", type=int, default=16, help="batches of 16,384 tokens")
    parser.add_argument(
        "--warmup-steps", type=int, default=4, help="each trainer's first steps, not timed"
    )
    parser.add_argument("--deadline-s", type=float, default=480.0)
    parser.add_argument("--wheels", type=Path, default=SPECFORGE_WHEELS)
    parser.add_argument("--fresh", action="store_true", help="remove the work root first")
    parser.add_argument(
        "--keep-data", action="store_true", help="keep the target and features at the end"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if args.rows < 2 or args.shards < 1 or args.shards > args.rows:
        parser.error("--rows must be >= 2 and --shards in [1, --rows]")
    if not 0 < args.kill_at < 1:
        parser.error("--kill-at must be in (0, 1)")
    if args.warmup_steps >= min(args.specforge_steps, args.eaglepipe_steps):
        parser.error("--warmup-steps must leave timed steps for both trainers")
    args.epochs = 1  # SpecForge's run config; set from --specforge-steps when it trains
    return args


def main(argv=None) -> int:
    return run_plan(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

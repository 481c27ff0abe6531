#!/usr/bin/env python3
"""How much the live acceptance figure depends on which held-out turns it is taken on, and how
closely the offline walk follows it (issue 26, item 2: a `live_prompts` that gives a stable
figure).

    python scripts/live_acceptance.py --config CONFIG_WITH_LIVE_PROMPTS_200 ... --out live_all.json
    python -m benchmarks.studies.acceptance_spread --live live_all.json --eval drafter/eval.json \\
        --sizes 8,16,32,64 --draws 2000 --out spread.json

The live run should cover every eligible held-out turn (`evaluate.live_prompts` at least their
number); each draw then takes N of those turns at random (without replacement) and pools them
as both harnesses do (completion tokens per verification round): the live figure, the offline
decode-order walk of the same turns (eval.json's per-turn rounds at the live run's draft
steps), and their ratio. Per N it reports the mean, standard deviation and the 5th-95th
percentile range over the draws, and the figure of the evenly spaced N turns the live stage
itself takes. Nothing here decodes: it reads the two files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import log, markdown_table, write_results


def per_turn(live: dict, evaluation: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per live turn: (completion tokens, rounds) live and (tokens, rounds) offline, at the
    live run's draft steps; turns the offline walk lacks are an error (another run's files)."""
    # Without a speculative setting the harness drafted train.ttt_length tokens a round.
    speculative = live.get("speculative") or {"steps": evaluation["ttt_length"]}
    steps = str(speculative["steps"])
    walked = {(t["row_id"], t["turn"]): t for t in evaluation.get("turns", [])}
    live_pairs, offline_pairs = [], []
    for prompt in live["per_prompt"]:
        key = (prompt["row_id"], prompt["turn"])
        if key not in walked:
            raise SystemExit(f"turn {key} of the live run is not in the evaluation's walk")
        if steps not in walked[key]["rounds"]:
            raise SystemExit(f"the evaluation has no walk at {steps} draft steps")
        live_pairs.append((prompt["completion_tokens"], prompt["rounds"]))
        offline_pairs.append((walked[key]["tokens"], walked[key]["rounds"][steps]))
    return np.array(live_pairs, dtype=float), np.array(offline_pairs, dtype=float)


def pooled(pairs: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Tokens per round pooled over the turns of each row of `index` (draws x N)."""
    return pairs[index, 0].sum(axis=1) / pairs[index, 1].sum(axis=1)


def spread(values: np.ndarray) -> dict:
    return {
        "mean": round(float(values.mean()), 3),
        "stdev": round(float(values.std(ddof=1)), 3),
        "p5": round(float(np.percentile(values, 5)), 3),
        "p95": round(float(np.percentile(values, 95)), 3),
    }


def evenly_spaced(total: int, count: int) -> np.ndarray:
    """The turns the live stage takes (eaglepipe.drafter.live.held_out_turns' spacing)."""
    return np.array([i * total // count for i in range(count)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", required=True, help="live.json over every eligible turn")
    parser.add_argument("--eval", required=True, help="the same run's drafter/eval.json")
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    live = json.loads(Path(args.live).read_text())
    evaluation = json.loads(Path(args.eval).read_text())
    live_pairs, offline_pairs = per_turn(live, evaluation)
    total = len(live_pairs)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or max(sizes) > total:
        parser.error(f"--sizes: between 1 and the live run's {total} turns (got {sizes})")
    rng = np.random.default_rng(args.seed)
    results = {
        "live": str(args.live),
        "eval": str(args.eval),
        "turns": total,
        "all_turns": {
            "live": round(float(live_pairs[:, 0].sum() / live_pairs[:, 1].sum()), 3),
            "offline": round(float(offline_pairs[:, 0].sum() / offline_pairs[:, 1].sum()), 3),
        },
        "draws": args.draws,
        "sizes": {},
    }
    rows = []
    for size in sizes:
        index = np.stack([rng.choice(total, size, replace=False) for _ in range(args.draws)])
        live_values, offline_values = pooled(live_pairs, index), pooled(offline_pairs, index)
        even = evenly_spaced(total, size)[None, :]
        entry = {
            "live": spread(live_values),
            "offline_same_turns": spread(offline_values),
            "live_over_offline": spread(live_values / offline_values),
            "evenly_spaced": {
                "live": round(float(pooled(live_pairs, even)[0]), 3),
                "offline": round(float(pooled(offline_pairs, even)[0]), 3),
            },
        }
        results["sizes"][size] = entry
        rows.append(
            [
                size,
                f"{entry['live']['mean']} ± {entry['live']['stdev']}",
                f"{entry['live']['p5']}-{entry['live']['p95']}",
                f"{entry['live_over_offline']['mean']} ± {entry['live_over_offline']['stdev']}",
                f"{entry['live_over_offline']['p5']}-{entry['live_over_offline']['p95']}",
                f"{entry['evenly_spaced']['live']} / {entry['evenly_spaced']['offline']}",
            ]
        )
    table = markdown_table(
        ["turns", "live (mean ± sd)", "live 5-95 %", "live / offline", "ratio 5-95 %",
         "evenly spaced: live / offline"],
        rows,
    )  # fmt: skip
    log(table)
    log(f"all {total} turns: live {results['all_turns']['live']}, offline "
        f"{results['all_turns']['offline']}")  # fmt: skip
    write_results(args.out, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A benchmark's figures per group of turns (all, each category, each turn), and the rows the
run report's table and `eaglepipe status` show of `drafter/benchmarks/<name>.json`.

Acceptance length is pooled as SGLang counts it: completion tokens over verification rounds,
summed over the group's turns (the prefill's token counted, not its round). Tokens per second
are at batch 1 (one request at a time): completion tokens over the decode's wall time, with
the drafter and plainly.
"""

from __future__ import annotations

ALL = "all"


def group_figures(runs: list, plain: dict) -> dict:
    """Pooled figures of `runs` (PromptRun) against their plain answers (PlainOutput by
    (row_id, turn))."""
    completion = sum(r.completion_tokens for r in runs)
    rounds = sum(r.rounds for r in runs)
    seconds = sum(r.seconds for r in runs)
    outputs = [plain[(r.row_id, r.turn)] for r in runs]
    plain_tokens = sum(len(o.output_ids) for o in outputs)
    plain_s = sum(o.seconds for o in outputs)
    with_drafter = completion / seconds if seconds else None
    without = plain_tokens / plain_s if plain_s else None
    return {
        "turns": len(runs),
        "completion_tokens": completion,
        "rounds": rounds,
        "accepted": sum(r.accepted for r in runs),
        "acceptance_length": completion / rounds if rounds else None,
        "tokens_per_s": with_drafter,
        "plain_tokens_per_s": without,
        "speedup": with_drafter / without if with_drafter and without else None,
        "identical_to_plain": sum(r.produced == r.greedy for r in runs),
    }


def grouped(runs: list, plain: dict, category_of: dict) -> dict:
    """Figures for all turns, each category and each turn number (1-based, as MT-bench's)."""
    by_category: dict[str, list] = {}
    by_turn: dict[str, list] = {}
    for r in runs:
        by_category.setdefault(category_of[r.row_id], []).append(r)
        by_turn.setdefault(str(r.turn + 1), []).append(r)
    return {
        ALL: group_figures(runs, plain),
        "by_category": {c: group_figures(rs, plain) for c, rs in by_category.items()},
        "by_turn": {t: group_figures(rs, plain) for t, rs in sorted(by_turn.items())},
    }


TABLE_COLUMNS = (
    "benchmark",
    "drafter",
    "setting",
    "group",
    "turns",
    "acceptance_length",
    "tokens_per_s",
    "plain_tokens_per_s",
    "speedup",
    "identical_to_plain",
)


def table_rows(result: dict) -> list[dict]:
    """One row per drafter, setting and group (all, turn N, each category)."""
    rows = []
    for measured in result.get("results") or []:
        groups = [(ALL, measured[ALL])]
        groups += [(f"turn {t}", g) for t, g in measured["by_turn"].items()]
        order = result.get("categories") or list(measured["by_category"])
        groups += [(c, measured["by_category"][c]) for c in order if c in measured["by_category"]]
        for name, figures in groups:
            rows.append(
                {
                    "benchmark": result["benchmark"],
                    "drafter": measured["drafter"],
                    "setting": measured["setting"],
                    "group": name,
                    **{k: figures.get(k) for k in TABLE_COLUMNS[4:]},
                }
            )
    return rows


def _length(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def status_lines(result: dict) -> list[str]:
    """A benchmark's results as `eaglepipe status` prints them: per drafter and setting, the
    acceptance length overall and per turn, the speed-up, the lossless check."""
    where = f"benchmark {result['benchmark']}"
    asked, too_long = result.get("turns_asked", 0), len(result.get("too_long") or [])
    head = f"{where} ({result.get('harness')}): {result.get('prompts', 0)} prompts, {asked} turns"
    lines = [head + (f", {too_long} turns too long for the context" if too_long else "")]
    for measured in result.get("results") or []:
        figures = measured[ALL]
        turns = ", ".join(
            f"turn {t} {_length(g['acceptance_length'])}" for t, g in measured["by_turn"].items()
        )
        speedup = figures.get("speedup")
        lines.append(
            f"  {measured['drafter']} {measured['setting']}: acceptance length "
            f"{_length(figures['acceptance_length'])} ({turns}); "
            f"{_length(figures.get('tokens_per_s'))} tok/s vs "
            f"{_length(figures.get('plain_tokens_per_s'))} plain"
            + (f" ({speedup:.2f}x)" if speedup else "")
            + f"; {figures['identical_to_plain']}/{figures['turns']} equal plain greedy"
        )
    return lines

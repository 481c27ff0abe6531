"""One benchmark, measured: `drafter/benchmarks/<name>.json`.

The live-acceptance harness of `server.engine` (`drafter/live_transformers.py` on the reference
engine, `drafter/live_sglang.py` through SGLang, reading SGLang's own counters) runs on the
benchmark's turns instead of held-out ones: the target's plain greedy answers first (each turn
after the target's own earlier answers, `conversation.py`), then every drafter (ours, and each
of `benchmarks.drafters`) at every `benchmarks.speculative` setting, one request at a time.
Each run is checked lossless against the plain answers as live acceptance checks it (in fp32 a
difference stops the stage). The figures are pooled per category and per turn (`summary.py`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..core import config as cfg
from ..core.atomic import atomic_write_json
from ..core.errors import PipelineError
from ..core.run import RunSpec
from ..drafter.live import check_lossless
from ..drafter.live_run import SpeculativeSetting
from .conversation import ask_turns
from .drafters import Drafter, external_drafter, our_drafter
from .prompt_file import prompt_source, read_prompts
from .summary import ALL, grouped

BENCHMARK_DIR = cfg.DRAFTER_DIR / "benchmarks"
PLAIN_CACHE_DIR = cfg.STATE_DIR / "benchmarks"
DEFINITION = (
    "completion tokens per verification round, pooled over the group's turns (SGLang's accept "
    "length; the prefill's token counted, not its round); tokens/s at batch 1"
)


def harness_of(run: RunSpec) -> str:
    return "sglang" if run.server.engine == "sglang" else "transformers"


def benchmark_export_engine(run: RunSpec) -> str:
    """Which of our exports the stage serves: SGLang's through SGLang; in transformers the
    SGLang export when there is one, else the first engine's (each through its own names)."""
    engines = list(run.export.engines)
    if run.server.engine == "sglang" and "sglang" not in engines:
        raise PipelineError(
            f"export.engines is {engines}: benchmarks through SGLang (server.engine sglang) "
            "serve drafter/export/sglang; add sglang to export.engines"
        )
    if not engines:
        raise PipelineError("export.engines is empty: the benchmarks need an exported drafter")
    return "sglang" if "sglang" in engines else engines[0]


def measured_drafters(run: RunSpec, export_dir: str | Path) -> list[Drafter]:
    drafters = [our_drafter(run, export_dir)]
    drafters += [external_drafter(run, name, path) for name, path in run.benchmarks.drafters]
    return drafters


def measure_benchmark(run: RunSpec, name: str, *, export_dir: str | Path, out_path) -> dict:
    """Measure benchmark `name` for every drafter and setting; write its results atomically."""
    from ..data.tokenizer import load_target_tokenizer, stop_token_ids

    benchmark = run.benchmarks.get(name)
    harness = harness_of(run)
    settings = [SpeculativeSetting.parse(s) for s in run.benchmarks.speculative]
    drafters = measured_drafters(run, export_dir)
    prompt_set = read_prompts(
        prompt_source(benchmark), bad_rows=run.dataset.bad_rows, per_category=benchmark.per_category
    )
    tokenizer = load_target_tokenizer(run)
    stops = stop_token_ids(tokenizer, run.model.directory)
    budget = benchmark.max_new_tokens
    print(
        f"benchmark {name}: {len(prompt_set.prompts)} of {prompt_set.rows} prompts "
        f"({len(prompt_set.categories)} categories), {budget} reply tokens, {harness}; "
        f"{len(drafters)} drafter(s) x {len(settings)} setting(s)",
        flush=True,
    )
    asked = ask_turns(
        run,
        harness,
        prompt_set,
        tokenizer,
        stops,
        budget=budget,
        cache_path=PLAIN_CACHE_DIR / f"{name}-plain.json",
    )
    for skipped in asked.too_long:
        print(f"not asked: prompt {skipped['id']} turn {skipped['turn']}: {skipped['why']}")
    if not asked.turns:
        raise PipelineError(
            f"benchmark {name}: no turn fits in the target's context with {budget} reply "
            f"tokens (benchmarks.run.{name}.max_new_tokens)"
        )
    # The harnesses decode `evaluate.live_new_tokens`: here the benchmark's budget.
    served = dataclasses.replace(
        run, evaluate=dataclasses.replace(run.evaluate, live_new_tokens=budget)
    )
    if harness == "sglang":
        from ..drafter.live_sglang import run_sglang as run_harness
    else:
        from ..drafter.live_transformers import run_transformers as run_harness
    category_of = {p.index: p.category for p in prompt_set.prompts}
    results, engine_facts = [], {}
    for drafter in drafters:
        for setting in settings:
            print(f"benchmark {name}: {drafter.name} at {setting.label}", flush=True)
            runs, extra = run_harness(
                served,
                drafter.export,
                drafter.captured,
                asked.turns,
                stops,
                speculative=setting,
                plain=asked.plain,
            )
            extra.pop("plain")
            lossless = check_lossless(runs, extra.pop("dtype"))
            engine_facts = extra
            figures = grouped(runs, asked.plain, category_of)
            results.append(
                {
                    "drafter": drafter.name,
                    "setting": setting.label,
                    "speculative": setting.record(),
                    **figures,
                    "lossless": lossless,
                    "per_turn": [
                        {**r.record(), "id": prompt_set.prompts_by_index[r.row_id].id} for r in runs
                    ],
                }
            )
            print(_line(name, drafter.name, setting.label, figures[ALL]), flush=True)
    plain_tokens = sum(len(o.output_ids) for o in asked.plain.values())
    plain_s = sum(o.seconds for o in asked.plain.values())
    source = prompt_set.source
    result = {
        "benchmark": name,
        "harness": harness,
        "source": {
            "path": str(source.path),
            "sha256": prompt_set.sha256,
            "rows": prompt_set.rows,
            "expected_sha256": source.sha256,
            "expected_rows": source.count,
            "fields": {
                "prompt": source.prompt_field,
                "category": source.category_field,
                "id": source.id_field,
            },
        },
        "per_category": benchmark.per_category,
        "max_new_tokens": budget,
        "prompts": len(prompt_set.prompts),
        "categories": prompt_set.categories,
        "turns_asked": len(asked.turns),
        "too_long": asked.too_long,
        "skipped_rows": prompt_set.skipped,
        "stop_token_ids": list(stops),
        "plain": {
            "reference": asked.reference,
            "tokens": plain_tokens,
            "seconds": round(plain_s, 3),
            "tokens_per_s": plain_tokens / plain_s if plain_s else None,
        },
        "drafters": [d.record() for d in drafters],
        "definition": DEFINITION,
        **engine_facts,
        "results": results,
    }
    atomic_write_json(out_path, result)
    return result


def _line(name: str, drafter: str, label: str, figures: dict) -> str:
    length = figures["acceptance_length"]
    speedup = figures["speedup"]
    return (
        f"benchmark {name}: {drafter} {label}: acceptance length "
        f"{'n/a' if length is None else f'{length:.3f}'} over {figures['turns']} turns, "
        f"{'n/a' if speedup is None else f'{speedup:.2f}x'} tokens/s against plain, "
        f"{figures['identical_to_plain']}/{figures['turns']} equal plain greedy"
    )


def read_result(path: str | Path) -> dict | None:
    """A benchmark's results file, None when absent or unreadable (status shows what exists)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None

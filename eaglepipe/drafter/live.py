"""Live speculative decoding with the exported drafter: the check a layer-id or export bug fails.

Greedy chain drafting of `train.ttt_length` tokens on `evaluate.live_prompts` held-out prompts
(the tokens before each one's first loss-masked token), `evaluate.live_new_tokens` tokens each,
through one of two harnesses that write the same `drafter/live.json`:

- `server.engine: reference` (laptops, CI): the target in transformers with the exported
  drafter read back through its engine's own name mapping (`live_transformers.py`);
- `server.engine: sglang`: SGLang itself serves the target with the SGLang export as its EAGLE-3
  draft model, and once more without it for the plain greedy reference (`live_sglang.py`), so
  a target too large for one device is never loaded outside SGLang.

The report: the measured acceptance length (1 + accepted drafts per verification round, the
same definition in both harnesses) beside the offline estimate of `drafter/eval.json`, and
whether every output equals plain greedy decoding of the target. `evaluate.live_prompts: 0`
skips the stage: live.json then records why, with no lengths.

This module stays free of torch at import: the Snakefile asks it which export the stage reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.atomic import atomic_write_json
from ..core.errors import PipelineError
from ..core.run import RunSpec
from .live_run import ExportInfo, acceptance_length


def live_export_engine(run: RunSpec) -> str | None:
    """Which export live acceptance reads (`drafter/export/<engine>`), or None when skipped.

    SGLang serves its own export. The transformers harness reads the SGLang export when there is
    one and the vLLM export otherwise, each through that engine's name mapping.
    """
    if run.evaluate.live_prompts == 0:
        return None
    engines = list(run.export.engines)
    if run.server.engine == "sglang":
        if "sglang" not in engines:
            raise PipelineError(
                f"export.engines is {engines}: live acceptance with server.engine sglang serves "
                "drafter/export/sglang through SGLang; add sglang to export.engines or set "
                "evaluate.live_prompts: 0"
            )
        return "sglang"
    if not engines:
        raise PipelineError(
            "export.engines is empty: live acceptance needs an exported drafter; export one "
            "or set evaluate.live_prompts: 0"
        )
    return "sglang" if "sglang" in engines else engines[0]


def held_out_prompts(table_path, count: int) -> list[tuple[int, list[int]]]:
    """(row id, prompt ids) of the first `count` eval rows that have an assistant turn."""
    import numpy as np

    from ..prepare.table import load_prepared

    table = load_prepared(table_path, columns=["row_id", "split", "input_ids", "loss_mask"])
    prompts = []
    for row in table[table["split"] == "eval"].sort_values("row_id").itertuples():
        mask = np.asarray(row.loss_mask, dtype=bool)
        if not mask.any():
            continue
        first = int(mask.argmax())
        if first > 0:
            prompts.append((int(row.row_id), [int(t) for t in row.input_ids[:first]]))
        if len(prompts) == count:
            break
    return prompts


def _offline_estimate(eval_path) -> float | None:
    if eval_path and Path(eval_path).exists():
        return json.loads(Path(eval_path).read_text()).get("acceptance_length")
    return None


def live_acceptance(
    run: RunSpec,
    *,
    export_dir: str | None,
    table_path: str,
    out_path: str,
    eval_path: str | None = None,
) -> dict:
    """Run the engine's harness (or record the skip) and write live.json atomically."""
    ec, tc = run.evaluate, run.train
    offline = _offline_estimate(eval_path)
    harness = "sglang" if run.server.engine == "sglang" else "transformers"
    result = {
        "harness": harness,
        "skipped": None,
        "export_dir": None,
        "export_engine": None,
        "target_family": None,
        "aux_layer_ids_written": None,
        "aux_layers_captured": None,
        "prompts": 0,
        "new_tokens": ec.live_new_tokens,
        "ttt_length": tc.ttt_length,
        "rounds": 0,
        "accepted": 0,
        "acceptance_length": None,
        "offline_acceptance_length": offline,
        "outputs_match_greedy": 0,
        "per_prompt": [],
    }
    engine = live_export_engine(run)
    if engine is None:
        result["skipped"] = "evaluate.live_prompts is 0"
        atomic_write_json(out_path, result)
        print("live acceptance skipped: evaluate.live_prompts is 0", flush=True)
        return result
    if not export_dir:
        raise PipelineError(f"live acceptance needs --export-dir (drafter/export/{engine})")
    export = ExportInfo.read(export_dir)
    if harness == "sglang" and export.engine != "sglang":
        raise PipelineError(
            f"{export_dir} is the {export.engine} export; SGLang serves the sglang export"
        )
    prompts = held_out_prompts(table_path, ec.live_prompts)
    if not prompts:
        raise PipelineError(f"{table_path} has no held-out row with an assistant turn")

    from .export import engine_captured_layers, target_family

    family = target_family(run.model.config)
    captured = engine_captured_layers(export.engine, family, export.written_layer_ids)
    if harness == "sglang":
        from .live_sglang import run_sglang as run_harness
    else:
        from .live_transformers import run_transformers as run_harness
    runs, extra = run_harness(run, export, captured, prompts)

    rounds = sum(r.rounds for r in runs)
    accepted = sum(r.accepted for r in runs)
    identical = sum(r.produced == r.greedy for r in runs)
    result.update(
        export_dir=str(export_dir),
        export_engine=export.engine,
        target_family=family,
        aux_layer_ids_written=export.written_layer_ids,
        aux_layers_captured=captured,
        prompts=len(runs),
        rounds=rounds,
        accepted=accepted,
        acceptance_length=acceptance_length(accepted, rounds),
        outputs_match_greedy=identical,
        per_prompt=[r.record() for r in runs],
        **extra,
    )
    atomic_write_json(out_path, result)
    length = result["acceptance_length"]
    print(
        f"live acceptance length ({harness}) "
        f"{'n/a' if length is None else f'{length:.3f}'} (offline estimate {offline}); "
        f"{identical}/{len(runs)} outputs equal plain greedy",
        flush=True,
    )
    if identical < len(runs):
        differing = [r.row_id for r in runs if r.produced != r.greedy]
        print(
            f"warning: greedy outputs with the drafter differ from those without it for rows "
            f"{differing} (first differences in live.json per_prompt)",
            flush=True,
        )
    return result

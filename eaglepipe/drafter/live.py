"""Live speculative decoding with the exported drafter: the check a layer-id or export bug fails,
and the acceptance length a user can plan on.

The prompts are held-out assistant turns, a sample of the turns the offline evaluation walks
(`held_out_turns`: `evaluate.live_prompts` of them, evenly spaced over the turns of the first
`evaluate.max_rows` held-out rows; replies cut at max_new_tokens left out). Each is decoded
greedily with chain drafting of `train.ttt_length` tokens until the end of the turn (the
tokenizer's end-of-turn / eos tokens) or `evaluate.live_new_tokens` tokens, through one of two
harnesses that write the same `drafter/live.json` (run by hand, the steps / top-k / draft tokens
can be another `SpeculativeSetting`):

- `server.engine: reference` (laptops, CI): the target in transformers with the exported
  drafter read back through its engine's own name mapping (`live_transformers.py`);
- `server.engine: sglang`: SGLang itself serves the target with the SGLang export as its EAGLE-3
  draft model, and once more without it for the plain greedy reference (`live_sglang.py`), so
  a target too large for one device is never loaded outside SGLang.

The report: the acceptance length as SGLang counts it (completion tokens per verification round,
pooled), beside the offline decode-order figure of `drafter/eval.json` on the same turns; the
wall-clock decode speed-up against the same target without the drafter; and the lossless check:
every output must equal plain greedy decoding of the target. In fp32 a difference is a bug and
fails the stage (naming the rows); in bf16 kernels may break near-ties, so differences are
counted with the target's logit margin at each first difference (a near-tie says kernels, a wide
margin says a bug). `evaluate.live_prompts: 0` skips the stage: live.json then records why, with
no lengths. With a greedy-reference file the plain outputs (and their wall time) are read from
it when it was made for the same target, serving settings, turns and budget (else made and
written there): several drafters or settings on one target serve the plain target once.

This module stays free of torch at import: the Snakefile asks it which export the stage reads.
"""

from __future__ import annotations

from pathlib import Path

from ..core.atomic import atomic_write_json
from ..core.errors import PipelineError
from ..core.jsonio import read_json_object
from ..core.run import RunSpec
from .live_run import (
    ExportInfo,
    LiveTurn,
    PromptRun,
    SpeculativeSetting,
    acceptance_length,
    first_difference,
    greedy_reference_key,
    read_greedy_reference,
    write_greedy_reference,
)


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


def held_out_turns(table_path, count: int, max_rows: int) -> list[LiveTurn]:
    """`count` of the turns the offline walk scores (those of the first `max_rows` held-out
    rows, replies cut at max_new_tokens left out), evenly spaced over them in (row, turn) order:
    a sample of the same mix of first and later turns, so the live figure estimates the offline
    headline and not a subset of easier or harder turns."""
    import numpy as np
    import pyarrow.parquet as pq

    from ..prepare.table import load_prepared
    from .decode_order import assistant_turns

    columns = ["row_id", "split", "input_ids", "loss_mask"]
    has_limits = "length_limited_turns" in pq.read_schema(table_path).names
    table = load_prepared(table_path, columns=columns + ["length_limited_turns"] * has_limits)
    rows = table[table["split"] == "eval"].sort_values("row_id").head(max_rows)
    eligible: list[LiveTurn] = []
    for row in rows.itertuples():
        ids = [int(t) for t in row.input_ids]
        limited = set(int(t) for t in row.length_limited_turns) if has_limits else set()
        for ordinal, (first, last) in enumerate(assistant_turns(np.asarray(row.loss_mask))):
            if first > 0 and ordinal not in limited:
                eligible.append(
                    LiveTurn(int(row.row_id), ordinal, ids[:first], ids[first : last + 1])
                )
    if count >= len(eligible):
        return eligible
    return [eligible[i * len(eligible) // count] for i in range(count)]


def walked_turns(eval_path) -> tuple[float | None, dict]:
    """eval.json's headline and its decode-order walk per (row_id, turn); (None, {}) without it."""
    if not eval_path or not Path(eval_path).exists():
        return None, {}
    evaluation = read_json_object(
        eval_path, what="offline evaluation", missing="does not exist: run the evaluate rule"
    )
    walked = {(t["row_id"], t["turn"]): t for t in evaluation.get("turns", [])}
    return evaluation.get("acceptance_length"), walked


def pooled_offline(walked: dict, turns, steps: int) -> float | None:
    """The offline walk's tokens per round pooled over `turns` (objects with row_id and turn),
    None when one of them was not walked at `steps`."""
    chosen = [walked.get((turn.row_id, turn.turn)) for turn in turns]
    if not chosen or any(t is None or str(steps) not in t["rounds"] for t in chosen):
        return None
    rounds = sum(t["rounds"][str(steps)] for t in chosen)
    return sum(t["tokens"] for t in chosen) / rounds if rounds else None


def offline_figures(headline: float | None, walked: dict, turns, steps: int) -> dict:
    """eval.json's headline, and its decode-order walk pooled over exactly these turns."""
    return {
        "offline_acceptance_length": headline,
        "offline_same_turns": pooled_offline(walked, turns, steps),
    }


def before_stop(ids: list[int], stops) -> list[int]:
    """The tokens before the first end-of-turn token (all of them when none comes)."""
    for i, token in enumerate(ids):
        if token in stops:
            return list(ids[:i])
    return list(ids)


def reproduces_reply(produced: list[int], reply: list[int], stops, decode) -> bool:
    """Whether a live output is the stored reply the offline walk scored, up to the end of the
    turn (a chat template may mask in a token after its end-of-turn marker, e.g. a newline).
    Compared as text: the table holds the reply as prepare tokenised it again, and a BPE
    tokenizer may split the same text otherwise than the tokens were generated."""
    mine, stored = before_stop(produced, stops), before_stop(reply, stops)
    return mine == stored or decode(mine) == decode(stored)


def split_by_stored_reply(
    runs: list[PromptRun], reproduced: list[bool], walked: dict, steps: int
) -> dict:
    """Live against offline on the turns whose live output reproduced the stored reply, and on
    the others. In bf16 a near-tie can break another way in the live server than in the one
    that wrote the reply (regeneration's batching, kernels); from there the live decode scores
    text the offline walk never saw, so only the first group compares like with like."""
    groups: dict[str, list[PromptRun]] = {"reproduced": [], "departed": []}
    for r, same in zip(runs, reproduced, strict=True):
        groups["reproduced" if same else "departed"].append(r)
    split = {}
    for name, members in groups.items():
        rounds = sum(r.rounds for r in members)
        live = sum(r.completion_tokens for r in members) / rounds if rounds else None
        offline = pooled_offline(walked, members, steps)
        split[name] = {
            "turns": len(members),
            "completion_tokens": sum(r.completion_tokens for r in members),
            "acceptance_length": live,
            "offline_same_turns": offline,
            "live_over_offline": live / offline if live and offline else None,
        }
    return split


def check_lossless(runs: list[PromptRun], dtype: str) -> dict:
    """Outputs with the drafter against plain greedy decoding. In fp32 any difference is a bug
    (verification let a draft through that the target would not have produced): refused."""
    differing = [r for r in runs if r.produced != r.greedy]
    report = {
        "dtype": dtype,
        "prompts": len(runs),
        "identical": len(runs) - len(differing),
        "first_differences": [
            {
                "row_id": r.row_id,
                "turn": r.turn,
                "position": first_difference(r.produced, r.greedy),
                "target_logit_margin": r.margin_at_difference,
            }
            for r in differing
        ],
    }
    if dtype == "float32" and differing:
        where = ", ".join(
            f"row {r.row_id} turn {r.turn} at token {first_difference(r.produced, r.greedy)}"
            for r in differing
        )
        raise PipelineError(
            f"speculative decoding changed the target's fp32 greedy output on {len(differing)} "
            f"of {len(runs)} prompts ({where}): drafts were accepted that the target would not "
            "have produced; the verification step is broken"
        )
    return report


def _figure(value: float | None) -> str:
    """An acceptance length as the log prints it."""
    return "n/a" if value is None else f"{value:.3f}"


def live_acceptance(
    run: RunSpec,
    *,
    export_dir: str | None,
    table_path: str,
    out_path: str,
    eval_path: str | None = None,
    speculative: SpeculativeSetting | None = None,
    greedy_reference: str | None = None,
) -> dict:
    """Run the engine's harness (or record the skip) and write live.json atomically."""
    ec, tc = run.evaluate, run.train
    harness = "sglang" if run.server.engine == "sglang" else "transformers"
    speculative = speculative or SpeculativeSetting.chain(tc.ttt_length)
    result = {
        "harness": harness,
        "skipped": None,
        "export_dir": None,
        "export_engine": None,
        "target_family": None,
        "aux_layer_ids_written": None,
        "aux_layers_captured": None,
        "prompts": 0,
        "max_new_tokens": ec.live_new_tokens,
        "ttt_length": tc.ttt_length,
        "speculative": speculative.record(),
        "greedy_reference": None,
        "completion_tokens": 0,
        "rounds": 0,
        "accepted": 0,
        "acceptance_length": None,
        "acceptance_length_definition": (
            "completion tokens per verification round, pooled over the prompts (SGLang's "
            "accept length; the prefill's token counted, not its round)"
        ),
        "drafts_accepted_per_round": None,
        "offline_acceptance_length": None,
        "offline_same_turns": None,
        "live_over_offline": None,
        "by_stored_reply": None,
        "speedup": None,
        "lossless": None,
        "per_prompt": [],
    }
    engine = live_export_engine(run)
    if engine is None:
        result["skipped"] = "evaluate.live_prompts is 0"
        result.update(offline_figures(*walked_turns(eval_path), [], speculative.steps))
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
    turns = held_out_turns(table_path, ec.live_prompts, ec.max_rows)
    if not turns:
        raise PipelineError(f"{table_path} has no held-out row with an assistant turn")

    from ..data.tokenizer import load_target_tokenizer, stop_token_ids
    from .export import engine_captured_layers, target_family

    tokenizer = load_target_tokenizer(run)
    stops = stop_token_ids(tokenizer, run.model.directory)
    family = target_family(run.model.config)
    captured = engine_captured_layers(export.engine, family, export.written_layer_ids)
    if harness == "sglang":
        from .live_sglang import run_sglang as run_harness
    else:
        from .live_transformers import run_transformers as run_harness
    plain, reference_note = None, "computed"
    if greedy_reference:
        key = greedy_reference_key(run, harness, turns, stops)
        plain, why = read_greedy_reference(greedy_reference, key)
        reference_note = f"read from {greedy_reference}" if plain else f"computed: {why}"
        print(f"greedy reference {reference_note}", flush=True)
    runs, extra = run_harness(
        run, export, captured, turns, stops, speculative=speculative, plain=plain
    )
    used = extra.pop("plain")
    if greedy_reference and plain is None:
        write_greedy_reference(greedy_reference, key, used)
    lossless = check_lossless(runs, extra.pop("dtype"))

    completion = sum(r.completion_tokens for r in runs)
    rounds = sum(r.rounds for r in runs)
    accepted = sum(r.accepted for r in runs)
    length = completion / rounds if rounds else None
    headline, walked = walked_turns(eval_path)
    offline = offline_figures(headline, walked, turns, speculative.steps)
    replies = {(t.row_id, t.turn): t.reply for t in turns}
    reproduced = [
        reproduces_reply(r.produced, replies[(r.row_id, r.turn)], stops, tokenizer.decode)
        for r in runs
    ]
    by_reply = split_by_stored_reply(runs, reproduced, walked, speculative.steps)
    plain_s = sum(r.greedy_seconds for r in runs)
    speculative_s = sum(r.seconds for r in runs)
    result.update(
        export_dir=str(export_dir),
        export_engine=export.engine,
        target_family=family,
        aux_layer_ids_written=export.written_layer_ids,
        aux_layers_captured=captured,
        stop_token_ids=list(stops),
        prompts=len(runs),
        completion_tokens=completion,
        rounds=rounds,
        accepted=accepted,
        acceptance_length=length,
        drafts_accepted_per_round=acceptance_length(accepted, rounds),
        **offline,
        live_over_offline=(
            length / offline["offline_same_turns"]
            if length and offline["offline_same_turns"]
            else None
        ),
        by_stored_reply=by_reply,
        speedup={
            "plain_s": round(plain_s, 3),
            "speculative_s": round(speculative_s, 3),
            "ratio": plain_s / speculative_s if speculative_s else None,
        },
        lossless=lossless,
        greedy_reference=reference_note,
        per_prompt=[
            {**r.record(), "reproduces_stored_reply": same}
            for r, same in zip(runs, reproduced, strict=True)
        ],
        **extra,
    )
    atomic_write_json(out_path, result)
    print(
        f"live acceptance length ({harness}, {speculative.label}) {_figure(length)} over "
        f"{len(runs)} held-out turns (offline on the same turns "
        f"{_figure(offline['offline_same_turns'])}, offline headline "
        f"{_figure(offline['offline_acceptance_length'])}); decode speed-up "
        f"{result['speedup']['ratio'] or 0:.2f}x; {lossless['identical']}/{len(runs)} outputs "
        f"equal plain greedy ({lossless['dtype']})",
        flush=True,
    )
    kept, departed = by_reply["reproduced"], by_reply["departed"]
    if departed["turns"]:
        print(
            f"{kept['turns']}/{len(runs)} live outputs reproduce the stored reply the "
            f"offline walk scored: live / offline {_ratio(kept['live_over_offline'])} "
            f"on those, {_ratio(departed['live_over_offline'])} on the "
            f"{departed['turns']} that departed from it",
            flush=True,
        )
    if lossless["first_differences"]:
        print(
            "warning: greedy outputs with the drafter differ from those without it: "
            + ", ".join(
                f"row {d['row_id']} turn {d['turn']} at {d['position']} (target margin "
                f"{d['target_logit_margin']})"
                for d in lossless["first_differences"]
            ),
            flush=True,
        )
    return result


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"

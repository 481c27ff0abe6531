"""The 8B-shape comparison (scale_steps.py): its results, as JSON and as the markdown table
BENCHMARKS.md takes."""

from __future__ import annotations

from benchmarks.studies.specforge.scale_kill import combined_rate
from benchmarks.studies.specforge.steps import Context

# ---------------------------------------------------------------- the results


def result_of(ctx: Context, name: str) -> dict:
    entry = ctx.state["steps"].get(name, {})
    return entry.get("result") or {} if entry.get("status") == "done" else {}


def generation_summary(ctx: Context) -> dict:
    """(a) per tool: steady tokens/s over both runs, start-up, bytes stored per token, and
    what the kill and the rerun left."""
    args = ctx.args
    tokens = args.rows * args.row_tokens
    kill, resume = result_of(ctx, "specforge-kill"), result_of(ctx, "specforge-resume")
    specforge = {}
    if kill:
        specforge["kill_run"] = {k: kill.get(k) for k in (
            "killed_after_s", "rows_stored_at_kill", "complete_at_kill",
            "write_in_flight_at_kill", "first_file_s", "rate")}  # fmt: skip
    if resume:
        accounting = resume["accounting"]
        specforge.update(
            rerun={k: resume.get(k) for k in ("wall_s", "first_file_s", "rate")},
            tokens_per_s=combined_rate([kill.get("rate", {}), resume["rate"]]),
            # what a user waits for, the kill's lost work and both start-ups included
            end_to_end_tokens_per_s=end_to_end(
                tokens, kill.get("killed_after_s"), resume["wall_s"]
            ),  # fmt: skip
            bytes_per_token=round(resume["feature_bytes"] / tokens, 1),
            dir_bytes_per_token=round(resume["dir_bytes"] / tokens, 1),
            after_kill_and_rerun=accounting,
        )
    pipeline = result_of(ctx, "pipeline")
    eaglepipe = {}
    if pipeline:
        verify = pipeline["verify"]
        eaglepipe = {
            "server_start_s": pipeline["server_start_s"],
            "engine_version": pipeline.get("engine_version"),
            "kill_run": {
                k: pipeline["kill"].get(k)
                for k in (
                    "killed_after_s",
                    "rows_stored_at_kill",
                    "write_in_flight_at_kill",
                    "rate",
                    "journal_at_kill",
                    "tmp_at_kill",
                )
            },  # fmt: skip
            "rerun": pipeline["resume"],
            "tokens_per_s": combined_rate([pipeline["kill"]["rate"], pipeline["resume"]["rate"]]),
            "end_to_end_tokens_per_s": end_to_end(
                tokens,
                pipeline["server_start_s"],
                pipeline["kill"].get("killed_after_s"),
                pipeline["resume"]["wall_s"],
            ),
            "bytes_per_token": round(verify["chunk_bytes"] / tokens, 1),
            "dir_bytes_per_token": round(verify["dir_bytes"] / tokens, 1),
            "after_kill_and_rerun": pipeline["accounting"],
            "verify": verify,
            "handoff_files_left": pipeline.get("handoff_files_left"),
        }
    return {"rows": args.rows, "tokens": tokens, "specforge": specforge, "eaglepipe": eaglepipe}


def end_to_end(tokens: int, *seconds) -> float | None:
    """Tokens over the whole wall time of the runs (start-ups, the killed run, the rerun)."""
    if any(s is None for s in seconds) or not sum(seconds):
        return None
    return round(tokens / sum(seconds), 1)


def training_summary(ctx: Context) -> dict:
    keys = ("tokens_per_s", "timed_steps", "timed_tokens", "median_step_s", "wall_s", "steps")
    out = {}
    theirs = result_of(ctx, "train-specforge")
    if theirs:
        out["specforge"] = {k: theirs.get(k) for k in keys} | {
            "batch": f"1 row ({theirs['tokens_per_step']} tokens)",
            "set_aside": theirs.get("set_aside"),
        }
    ours = result_of(ctx, "train-eaglepipe")
    if ours:
        out["eaglepipe"] = {k: ours.get(k) for k in keys} | {
            "batch": f"{ours['batch_tokens']} tokens",
            "peak_gpu_memory_gib": ours.get("peak_gpu_memory_gib"),
            "data_wait_fraction": ours.get("data_wait_fraction"),
        }
    if len(out) == 2 and out["specforge"]["tokens_per_s"] and out["eaglepipe"]["tokens_per_s"]:
        out["eaglepipe_over_specforge"] = round(
            out["eaglepipe"]["tokens_per_s"] / out["specforge"]["tokens_per_s"], 3
        )
    return out


WHAT_WAS_COMPARED = (
    "aux: SpecForge's aux_hidden_state [1, T, 3H] (SGLang's aux_hidden_states captured at "
    "layers_to_capture = id + 1: the output of decoder layer id, in id order) block by block "
    "against eaglepipe's aux_hidden_states [T, 3H] (the same SGLang tensors through the "
    "logits-processor hook; aux id k = output of decoder layer k); final: SpecForge's "
    "hidden_state (the logits processor's hidden_states, after model.norm: post-norm) against "
    "eaglepipe's final_hidden_states (post-norm). Rows matched by their input ids. The random "
    "target's norm weights are ones, so pre- and post-norm states differ only in scale: the "
    "cosine cannot tell them apart, max |diff| and the per-token RMS (about 1 post-norm) can."
)


def write(ctx: Context, step_names: list[str]) -> None:
    from benchmarks.common import command_line, write_results

    args = ctx.args
    results = {
        "benchmark": "specforge_scale",
        "command": command_line(),
        "setup": {
            **ctx.state.get("setup", {}),
            "shape": "8b (Llama-3.1-8B: hidden 4096, 32 layers, 32/8 heads, vocab 128256), bf16",
            "aux_layer_ids": ctx.state.get("aux_layer_ids")
            or result_of(ctx, "inputs").get("aux_layer_ids"),
            "specforge_capture_batch": 1,
            "specforge_steps": args.specforge_steps,
            "eaglepipe_steps": args.eaglepipe_steps,
            "warmup_steps": args.warmup_steps,
            "work": str(ctx.paths.work),
            "dry_run": args.dry_run,
        },
        "steps": {  # in the plan's order
            name: {k: v for k, v in ctx.state["steps"][name].items() if k != "result"}
            for name in step_names
            if name in ctx.state.get("steps", {})
        },
        "generation": generation_summary(ctx),
        "fidelity": {
            "what_was_compared": WHAT_WAS_COMPARED,
            **{k: v for k, v in result_of(ctx, "fidelity").items()},
        },
        "training": training_summary(ctx),
        "remaining": [
            name for name in step_names if ctx.state["steps"].get(name, {}).get("status") != "done"
        ],
    }
    if args.dry_run:
        results["commands"] = ctx.dry
    write_results(args.out, results, markdown(results))


def na(cell):
    """A cell of the results table: n/a for a figure not measured (yet)."""
    if cell is None:
        return "n/a"
    return cell.replace("None", "n/a") if isinstance(cell, str) else cell


def _rate(entry: dict, *keys):
    for key in keys:
        entry = (entry or {}).get(key)
    return entry


def markdown(results: dict) -> str:
    from benchmarks.common import markdown_table

    gen = results["generation"]
    sf, ep = gen["specforge"], gen["eaglepipe"]
    sfa, epa = sf.get("after_kill_and_rerun", {}), ep.get("after_kill_and_rerun", {})
    rows = [
        ["tokens/s (steady: file mtimes, both runs)", sf.get("tokens_per_s"),
         ep.get("tokens_per_s")],
        ["tokens/s end to end (start-ups, killed run, rerun)",
         sf.get("end_to_end_tokens_per_s"), ep.get("end_to_end_tokens_per_s")],
        ["tokens/s, killed run / rerun", f"{_rate(sf, 'kill_run', 'rate', 'tokens_per_s')} / "
         f"{_rate(sf, 'rerun', 'rate', 'tokens_per_s')}",
         f"{_rate(ep, 'kill_run', 'rate', 'tokens_per_s')} / "
         f"{_rate(ep, 'rerun', 'rate', 'tokens_per_s')}"],
        ["start to first file (s), killed run / rerun",
         f"{_rate(sf, 'kill_run', 'first_file_s')} / {_rate(sf, 'rerun', 'first_file_s')}",
         f"server start {ep.get('server_start_s')}; rerun {_rate(ep, 'rerun', 'first_chunk_s')}"],
        ["rerun wall s", _rate(sf, "rerun", "wall_s"), _rate(ep, "rerun", "wall_s")],
        ["bytes stored per token (files / whole dir)",
         f"{sf.get('bytes_per_token')} / {sf.get('dir_bytes_per_token')}",
         f"{ep.get('bytes_per_token')} / {ep.get('dir_bytes_per_token')}"],
        ["rows stored at the kill (files present / complete; journalled)",
         f"{_rate(sf, 'kill_run', 'rows_stored_at_kill')} / "
         f"{_rate(sf, 'kill_run', 'complete_at_kill')}",
         _rate(ep, "kill_run", "rows_stored_at_kill")],
        ["cut short at the kill", f"{sfa.get('torn_at_kill')} file(s)",
         f"{epa.get('tmp_at_kill')} temp chunk(s), {epa.get('unjournalled_at_kill')} unjournalled"],
        ["rerun kept / redid", f"{sfa.get('kept')} files / {sfa.get('new')} new, "
         f"{sfa.get('rewritten')} rewritten",
         f"{epa.get('chunks_kept')} chunks ({epa.get('rows_kept')} rows) / "
         f"{epa.get('chunks_written')} chunks ({epa.get('rows_redone')} rows)"],
        ["cut-short file taken as done", sfa.get("torn_taken_as_done"),
         f"0 by design; temp files left {epa.get('tmp_after')}"],
        ["result whole and right", sfa.get("complete"), _rate(ep, "verify", "ok")],
    ]  # fmt: skip
    text = (f"# SpecForge 0.2.0 vs eaglepipe on the 8B shape (issue 27)\n\n"
            f"{gen['rows']} rows x {results['setup'].get('row_tokens')} tokens "
            f"({gen['tokens']:,} tokens), aux layers {results['setup'].get('aux_layer_ids')}\n\n"
            "## (a) hidden-state generation, kill -9 half-way\n\n")  # fmt: skip
    rows = [[na(cell) for cell in row] for row in rows]
    text += markdown_table(["", "SpecForge prepare_hidden_states.py", "eaglepipe extract"], rows)
    fid = results["fidelity"]
    text += "\n## (c) the two feature sets\n\n"
    if fid.get("blocks"):
        keys = ("max_abs_diff", "min_cos", "mean_cos", "rms_ours", "rms_specforge")
        every = {**fid["blocks"], **fid["shifted"]}
        table = [[name, *(s[k] for k in keys)] for name, s in every.items()]
        text += markdown_table(
            ["block", "max abs diff", "min cos", "mean cos", "RMS eaglepipe", "RMS SpecForge"],
            table,
        )
        text += (f"\nRows compared: {fid['rows_compared']} of {fid['shard_rows']}; loss masks "
                 f"equal: {fid['loss_mask_equal']}. **Verdict: {fid['verdict']}**\n")  # fmt: skip
    text += f"\n{fid['what_was_compared']}\n"
    train = results["training"]
    text += "\n## (b) training tokens/s (TTT 7, draft vocab 32,000)\n\n"
    text += markdown_table(
        ["trainer", "batch", "timed steps", "tokens/s", "median step s", "wall s"],
        [[name, t.get("batch"), t.get("timed_steps"), t.get("tokens_per_s"),
          t.get("median_step_s"), t.get("wall_s")]
         for name, t in train.items() if isinstance(t, dict)],
    )  # fmt: skip
    text += "\n" + markdown_table(
        ["step", "status", "seconds"],
        [[n, s.get("status"), s.get("seconds")] for n, s in results["steps"].items()],
    )
    return text + f"\nCommand: `{results['command']}`\n"

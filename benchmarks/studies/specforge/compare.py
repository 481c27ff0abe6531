#!/usr/bin/env python3
"""This pipeline and SpecForge 0.2 side by side on the lent H200: the same target, the same
training rows, the same number of epochs, and both drafters served by the same SGLang through
the same live harness (issue 27).

    bash tools/h200.sh specforge $OUT [--seeds 0,1,2] [--epochs 8] [--settings 7/1/8,3/1/4]
    python3 -u -m compare --dry-run --out /tmp/sf.json   # commands, here

Steps, in order; each is recorded in WORK/state.json when it ends, and a later call on the
warm machine (the same WORK) skips what is done, so a comparison longer than one call's 10
minutes continues where the last call stopped:

1. pipeline (the first seed): benchmarks/checks/sglang_pipeline_h200.sh, the pipeline part's run
   (the 128-wide toy, engine sglang), through drafter/eval.json and the SGLang export, with
   `train.epochs` and `train.seed` set. Its export, eval.json and training log are kept under
   WORK/seeds/seed<S>-epochs<E>/eaglepipe/.
2. specforge-inputs (once, after the first seed's pipeline): the run's train split as
   SpecForge JSONL (held-out rows and rows prepare skipped are left out;
   benchmarks/studies/specforge/data.py), the target's chat template as SpecForge's template JSON,
   checked row by row against the prepared table (SpecForge's masking rule, written here,
   gives the same input_ids and loss mask), a view of the target with the index SpecForge's
   loader wants, and the draft config (the run's aux layers and train.draft_vocab_size, so
   both drafters have the same size).
3. specforge-features (once): SpecForge's own generator, scripts/prepare_hidden_states.py with
   SGLang in-process (--features sglang), or a transformers forward through SpecForge's own
   preprocessing (hf, hf_features.py); the first route of --features that
   succeeds is used. Every feature file's tokens and loss mask are then looked up in the
   prepared table.
4. the trainings, side by side on the one GPU (a toy's training leaves it mostly idle) unless
   --train-one-at-a-time: specforge-train for every seed at once (`specforge train` with its
   Llama-3.1-8B offline recipe, examples/configs/llama3.1-8b-eagle3-offline.yaml: batch 1, lr
   1e-4, grad clip 0.5, TTT 7, sdpa, but --epochs and the seed, then `specforge export --to
   sglang`; the export's config.json gets the `eaglepipe` block the live harness reads), and
   meanwhile the pipeline for each later seed, one after the other (the same run directory
   retrains, evaluates and exports only: the train settings stamp changed). Training times
   measured side by side are marked so (`trained_at_once`); the solo figures are in
   BENCHMARKS.md.
5. live (per setting, seed and drafter): scripts/live_acceptance.py from the run directory,
   with the run's config, table and prompts, `--speculative S/K/D`, and one greedy reference
   for the target (`--greedy-reference`): the plain target is served once for all of them.
   With --live-at-once N, after the first (which serves the plain target) up to N at once,
   each on its own server, started --live-stagger-s apart (their speed-ups are then not a
   lone run's, and are marked `live_side_by_side`). With --deterministic-live, one more for
   the first seed's eaglepipe drafter at the first setting, both servers started with SGLang's
   `--enable-deterministic-inference` (its own greedy reference): whether the bf16
   differences from plain greedy decoding go away.

A step starts only when the time left (--deadline-s) covers its usual length, and runs under
a timeout inside it. --out gets the JSON (and a markdown table beside it) after every step:
per seed and drafter the live acceptance lengths, the offline estimate where there is one
(eaglepipe's drafter/eval.json), training time and steps; per setting and drafter the mean,
spread and standard deviation over seeds. Exit 0 when every step is done, 3 when some are left
for the next call, 1 when a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import REPO_ROOT, log, markdown_table, write_results
from benchmarks.studies.specforge.resume import restore_kit, write_kit
from benchmarks.studies.specforge.steps import (
    MARGIN_S,
    RECIPE,
    SPECFORGE_WHEELS,
    Context,
    Paths,
    Step,
    StepFailed,
    checked,
    step_features,
    step_inputs,
    step_trainings,
)
from eaglepipe.core.errors import PipelineError  # noqa: E402
from eaglepipe.drafter.live_run import SpeculativeSetting  # noqa: E402

# Usual lengths on the H200 (2026-12-01 and 2026-12-03 runs), to decide whether a step can start.
STEP_SECONDS = {
    "pipeline-first": 150,  # resumable: snakemake continues in the next call (439 s in all)
    "pipeline-retrain": 120,
    "specforge-inputs": 30,
    "specforge-features": 120,
    "specforge-train-base": 60,
    "specforge-train-per-epoch": 25,  # 219 s for 8 epochs alone on 2026-12-03
    "live": 90,  # 32 held-out turns, each to its end of turn: 72-80 s on 2026-12-03
    "live-with-reference": 170,  # 150 s on 2026-12-03
}
EXIT_LEFT_FOR_LATER = 3


# ---------------------------------------------------------------- the plan


def plan_steps(args) -> list[Step]:
    """The first seed's pipeline, SpecForge's inputs and features; SpecForge's trainings, then
    the later seeds' pipelines (the two kinds side by side unless --train-one-at-a-time); then
    the live runs, setting by setting."""
    steps, epochs = [], args.epochs
    tags = {seed: f"seed{seed}-epochs{epochs}" for seed in args.seeds}
    first, *later = args.seeds
    steps.append(
        Step(f"pipeline@{tags[first]}", "pipeline", tags[first], first,
             needs_s=STEP_SECONDS["pipeline-first"])
    )  # fmt: skip
    for name, kind in (("specforge-inputs", "inputs"), ("specforge-features", "features")):
        steps.append(Step(name, kind, needs_s=STEP_SECONDS[name]))
    train_s = STEP_SECONDS["specforge-train-base"]
    train_s += STEP_SECONDS["specforge-train-per-epoch"] * epochs
    for seed in args.seeds:
        name = f"specforge-train@{tags[seed]}"
        steps.append(Step(name, "train", tags[seed], seed, needs_s=train_s))
    for seed in later:
        steps.append(
            Step(f"pipeline@{tags[seed]}", "pipeline", tags[seed], seed,
                 needs_s=STEP_SECONDS["pipeline-retrain"])
        )  # fmt: skip
    # Setting by setting (the first setting's seeds are a table row even if a call runs out);
    # the first live run also serves the plain target.
    reference = "live-with-reference"
    for setting in args.settings:
        for seed in args.seeds:
            for drafter in ("eaglepipe", "specforge"):
                needs, reference = STEP_SECONDS[reference], "live"
                name = f"live@{tags[seed]}@{drafter}@{setting.label.replace('/', '-')}"
                steps.append(Step(name, "live", tags[seed], seed, drafter, setting, needs))
    if args.deterministic_live:
        setting = args.settings[0]
        name = f"live-deterministic@{tags[first]}@eaglepipe@{setting.label.replace('/', '-')}"
        needs = STEP_SECONDS["live-with-reference"]
        steps.append(
            Step(name, "live", tags[first], first, "eaglepipe", setting, needs, deterministic=True)
        )
    return steps


def next_group(ctx: Context, steps: list[Step], index: int) -> list[Step]:
    """The steps to run together from `index`: SpecForge's trainings with the later seeds'
    pipelines (unless --train-one-at-a-time); up to --live-at-once live runs, but the first
    live run of the plan alone (it serves the plain target for the shared greedy reference);
    any other step alone."""
    step = steps[index]
    if step.kind == "train" and not ctx.args.train_one_at_a_time:
        kinds, limit = ("train", "pipeline"), len(steps)
    elif step.kind == "live" and step is not next(s for s in steps if s.kind == "live"):
        kinds, limit = ("live",), ctx.args.live_at_once
    else:
        return [step]
    group = []
    while index < len(steps) and steps[index].kind in kinds and len(group) < limit:
        group.append(steps[index])
        index += 1
    return group


def group_needs(ctx: Context, group: list[Step]) -> float:
    """Seconds a group usually takes: its trainings side by side (a fifth more per extra one),
    its pipelines one after the other beside them; live runs side by side, started apart."""
    if group[0].kind == "live":
        stagger = ctx.args.live_stagger_s * (len(group) - 1)
        return max(s.needs_s for s in group) * (1 + 0.1 * (len(group) - 1)) + stagger
    trains = [s.needs_s for s in group if s.kind == "train"]
    side_by_side = max(trains, default=0) * (1 + 0.2 * max(len(trains) - 1, 0))
    return max(side_by_side, sum(s.needs_s for s in group if s.kind != "train"))


# ---------------------------------------------------------------- step 1: the pipeline


def pipeline_overrides(args, seed: int) -> str:
    """The run's config over the pipeline part's: the seed and epochs, and the live runs' turns
    and token budget when given (the live stage is not run by the pipeline step)."""
    text = f"train:\n  epochs: {args.epochs}\n  seed: {seed}\n"
    live = {"live_prompts": args.live_prompts, "live_new_tokens": args.live_new_tokens}
    if any(v is not None for v in live.values()):
        text += "evaluate:\n" + "".join(f"  {k}: {v}\n" for k, v in live.items() if v is not None)
    return text


def step_pipeline(ctx: Context, step: Step) -> dict:
    paths, seed = ctx.paths, step.seed
    keep = paths.kept(step, "eaglepipe")
    overrides = paths.work / f"overrides-seed{seed}.yaml"
    if not ctx.args.dry_run:
        keep.mkdir(parents=True, exist_ok=True)
        overrides.write_text(pipeline_overrides(ctx.args, seed))
    resume = paths.run.exists()
    if resume and not ctx.args.dry_run:
        # A snakemake killed at the last call's limit can leave its lock; nothing else runs
        # snakemake in this directory (tools/h200.sh stopped the last call's processes).
        shutil.rmtree(paths.run / ".snakemake" / "locks", ignore_errors=True)
    limit = int(ctx.left() - MARGIN_S - 10)
    env = {
        **os.environ,
        "EAGLEPIPE_H200_ROOT": str(paths.work),
        "EAGLEPIPE_PIPELINE_LIMIT_S": str(limit),
        "EAGLEPIPE_PIPELINE_RESUME": "1" if resume else "0",
    }
    argv = [
        "bash", str(REPO_ROOT / "benchmarks" / "checks" / "sglang_pipeline_h200.sh"),
        str(keep / "pipeline"),
        "--overrides", str(overrides),
        "--rerun-incomplete", "drafter/eval.json", "drafter/export/sglang/config.json",
    ]  # fmt: skip
    checked(ctx, step.name, argv, log_path=keep / "pipeline.log", env=env)
    if ctx.args.dry_run:
        return {}
    run = paths.run
    shutil.rmtree(keep / "export", ignore_errors=True)
    shutil.copytree(run / "drafter" / "export" / "sglang", keep / "export")
    for name in ("eval.json", "train_log.jsonl"):
        shutil.copyfile(run / "drafter" / name, keep / name)
    summary = json.loads((keep / "pipeline" / "pipeline_summary.json").read_text())
    return {
        "resumed": resume,
        "eval": json.loads((keep / "eval.json").read_text()),
        "training": eaglepipe_training(keep / "train_log.jsonl"),
        "rule_seconds": summary.get("rule_seconds"),
        "engine": summary.get("engine"),
        "train_rows": prepared_split_sizes(run),
    }


def eaglepipe_training(train_log: Path) -> dict:
    records = [json.loads(line) for line in train_log.read_text().splitlines() if line.strip()]
    if not records:
        return {}
    last = records[-1]
    return {
        "steps": last["step"],
        "epochs": last["epoch"] + 1,
        "tokens": sum(r["tokens"] for r in records),
        "step_seconds": round(sum(r["seconds"] for r in records), 1),
        "final_loss": last["loss"],
        "final_acc": last["acc"],
    }


def prepared_split_sizes(run: Path) -> dict:
    import pandas as pd

    table = pd.read_parquet(run / "prepared" / "tokenized.parquet", columns=["split"])
    return {k: int(v) for k, v in table["split"].value_counts().items()}


# ---------------------------------------------------------------- step 5: live acceptance


DETERMINISTIC_FLAG = "--enable-deterministic-inference"


def deterministic_config(run: Path, out: Path) -> Path:
    """The run's resolved config with SGLang's batch-invariant mode on every server it starts
    (the triton attention backend the pipeline part sets is one that mode accepts)."""
    config = json.loads((run / ".eaglepipe" / "config.json").read_text())
    extra = config["server"]["sglang"]["extra_args"]
    if DETERMINISTIC_FLAG not in extra:
        extra.append(DETERMINISTIC_FLAG)
    out.write_text(json.dumps(config, indent=1))
    return out


def step_live(ctx: Context, step: Step) -> dict:
    paths = ctx.paths
    keep = paths.kept(step, step.drafter)
    label = step.setting.label.replace("/", "-")
    config, greedy = ".eaglepipe/config.json", paths.greedy
    if step.deterministic:
        # Its own greedy reference: the serving settings are part of the reference's key, and
        # one file holds one key.
        label += "-deterministic"
        greedy = paths.work / "greedy-reference-deterministic.json"
        config = paths.work / "config-deterministic.json"
        if not ctx.args.dry_run:
            deterministic_config(paths.run, config)
    out = keep / f"live-{label}.json"
    argv = [
        sys.executable, "-u", str(REPO_ROOT / "scripts" / "live_acceptance.py"),
        "--config", str(config), "--table", "prepared/tokenized.parquet",
        "--export-dir", str(keep / "export"), "--out", str(out),
        "--speculative", step.setting.label, "--greedy-reference", str(greedy),
    ]  # fmt: skip
    # SpecForge's drafter has no offline estimate: a path that does not exist says so (the
    # script's default would be the pipeline's own drafter/eval.json).
    argv += ["--eval", str(keep / ("eval.json" if step.drafter == "eaglepipe" else "none.json"))]
    checked(ctx, step.name, argv, log_path=keep / f"live-{label}.log", cwd=paths.run)
    if ctx.args.dry_run:
        return {}
    live = json.loads(out.read_text())
    kept = (
        "acceptance_length", "drafts_accepted_per_round", "offline_acceptance_length",
        "offline_same_turns", "live_over_offline", "prompts", "max_new_tokens",
        "completion_tokens", "rounds", "accepted", "speculative", "speedup", "greedy_reference",
    )  # fmt: skip
    lossless = live.get("lossless") or {}
    return {k: live.get(k) for k in kept} | {
        "lossless": {
            k: lossless.get(k) for k in ("dtype", "prompts", "identical", "first_differences")
        },
        "per_prompt": [p["acceptance_length"] for p in live.get("per_prompt", [])],
    }


# ---------------------------------------------------------------- the results


def summarise(state: dict, args) -> dict:
    """Per setting and drafter: the live acceptance lengths over seeds, and their spread."""
    summary = {}
    for setting in args.settings:
        label = setting.label.replace("/", "-")
        per = {}
        for drafter in ("eaglepipe", "specforge"):
            values = {}
            for seed in args.seeds:
                name = f"live@seed{seed}-epochs{args.epochs}@{drafter}@{label}"
                entry = state["steps"].get(name, {})
                if entry.get("status") == "done":
                    values[seed] = entry["result"]["acceptance_length"]
            numbers = [v for v in values.values() if v is not None]
            per[drafter] = {
                "by_seed": values,
                "mean": round(statistics.fmean(numbers), 3) if numbers else None,
                "min": min(numbers, default=None),
                "max": max(numbers, default=None),
                "stdev": round(statistics.stdev(numbers), 3) if len(numbers) > 1 else None,
            }
        summary[setting.label] = per
    return summary


def markdown(results: dict) -> str:
    rows = []
    for setting, per in results["summary"].items():
        for drafter, figures in per.items():
            seeds = ", ".join(
                f"{s}: {v:.3f}" if v is not None else f"{s}: n/a"
                for s, v in figures["by_seed"].items()
            )
            rows.append([setting, drafter, figures["mean"], figures["stdev"], seeds])
    table = markdown_table(
        ["setting", "drafter", "mean live acceptance", "stdev", "per seed"], rows
    )  # fmt: skip
    steps = markdown_table(
        ["step", "status", "seconds"],
        [[n, s.get("status"), s.get("seconds")] for n, s in results["steps"].items()],
    )
    return f"# eaglepipe vs SpecForge 0.2.0 (issue 27)\n\n{table}\n{steps}"


def write(ctx: Context, remaining: list[str]) -> None:
    results = {
        "setup": {
            "command": shlex.join([Path(sys.executable).name, "-u", *sys.argv]),
            "seeds": ctx.args.seeds,
            "epochs": ctx.args.epochs,
            "live_prompts": ctx.args.live_prompts,
            "live_new_tokens": ctx.args.live_new_tokens,
            "settings": [s.label for s in ctx.args.settings],
            "features": ctx.args.features,
            "specforge_recipe": {**RECIPE, "num_epochs": ctx.args.epochs, "save_interval": 0},
            "work": str(ctx.paths.work),
            "dry_run": ctx.args.dry_run,
        },
        "steps": ctx.state.get("steps", {}),
        "summary": summarise(ctx.state, ctx.args),
        "remaining": remaining,
    }
    if ctx.args.dry_run:
        results["commands"] = ctx.dry
    write_results(ctx.args.out, results, markdown(results))


# ---------------------------------------------------------------- main


RUNNERS = {
    "pipeline": step_pipeline,
    "inputs": step_inputs,
    "features": step_features,
    "live": step_live,
}


def is_done(ctx: Context, step: Step) -> bool:
    return ctx.state["steps"].get(step.name, {}).get("status") == "done"


def run_group(ctx: Context, group: list[Step]) -> dict[str, dict]:
    """Each step's state entry: done with its result, failed or timed out with the error."""
    if len(group) > 1:
        if group[0].kind == "live":
            return run_lives_side_by_side(ctx, group)
        return run_side_by_side(ctx, group)
    (step,) = group
    if step.kind == "train":
        return step_trainings(ctx, group)
    try:
        result = RUNNERS[step.kind](ctx, step)
    except StepFailed as exc:
        return {
            step.name: {"status": "timed out" if exc.code == 124 else "failed", "error": str(exc)}
        }
    if step.kind == "inputs" and result:  # what later steps, and later calls, need from it
        ctx.state["max_length"] = result["max_length"]
        ctx.state["lm_head_key"] = result["target_view"]["lm_head_key"]
        ctx.state["aux_layer_ids"] = result["aux_layer_ids"]
    return {step.name: {"status": "done", "result": result}}


def run_lives_side_by_side(ctx: Context, group: list[Step]) -> dict[str, dict]:
    """Live runs at once, each on its own SGLang server (a free port each; each server takes
    its static-memory fraction of what is free when it starts, so they are started
    --live-stagger-s apart: two sizing up the memory at the same moment would both count the
    other's share as free). The acceptance figures are the servers' own; the wall-clock
    speed-ups are not comparable with a lone run's, and are marked so."""
    stagger = 0.0 if ctx.args.dry_run else ctx.args.live_stagger_s

    def one(position: int, step: Step) -> dict:
        time.sleep(position * stagger)
        began = time.monotonic()
        entry = run_group(ctx, [step])[step.name]
        entry["seconds"] = round(time.monotonic() - began, 1)
        entry["live_side_by_side"] = len(group)
        return entry

    if ctx.args.dry_run:  # the commands in a stable order
        return {step.name: one(i, step) for i, step in enumerate(group)}
    with ThreadPoolExecutor(max_workers=len(group)) as pool:
        futures = {step.name: pool.submit(one, i, step) for i, step in enumerate(group)}
        return {name: future.result() for name, future in futures.items()}


def run_side_by_side(ctx: Context, group: list[Step]) -> dict[str, dict]:
    """SpecForge's trainings in a thread (its processes at once), the group's pipelines one
    after the other here; each step's entry with its own seconds."""
    trains = [s for s in group if s.kind == "train"]
    entries: dict[str, dict] = {}
    if ctx.args.dry_run:  # the commands in a stable order
        entries = step_trainings(ctx, trains) if trains else {}
        for step in (s for s in group if s.kind != "train"):
            entries |= run_group(ctx, [step])
        return entries
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = time.monotonic()
        training = pool.submit(step_trainings, ctx, trains) if trains else None
        for step in (s for s in group if s.kind != "train"):
            began = time.monotonic()
            entry = run_group(ctx, [step])[step.name]
            entry["seconds"] = round(time.monotonic() - began, 1)
            entry["beside_trainings"] = len(trains)
            entries[step.name] = entry
        if training is not None:
            trained = training.result()
            seconds = round(time.monotonic() - started, 1)
            for name, entry in trained.items():
                entry.setdefault("seconds", seconds)
                entries[name] = entry
    return entries


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    root = os.environ.get("EAGLEPIPE_H200_ROOT", "/tmp/eaglepipe-h200")
    parser.add_argument("--work-root", type=Path, default=Path(root) / "specforge")
    parser.add_argument("--seeds", default="0", help="drafter training seeds, e.g. 0,1,2")
    parser.add_argument("--epochs", type=int, default=8, help="both drafters' epochs")
    parser.add_argument(
        "--settings", default="7/1/8,3/1/4", help="SGLang's steps/top-k/draft tokens, each"
    )
    parser.add_argument(
        "--features", default="sglang,hf", help="SpecForge feature routes to try, in order"
    )
    parser.add_argument(
        "--live-prompts", type=int, default=None, help="held-out turns per live run (config's)"
    )
    parser.add_argument(
        "--live-new-tokens", type=int, default=None, help="token budget per turn (config's)"
    )
    parser.add_argument("--deadline-s", type=float, default=540.0)
    parser.add_argument("--wheels", type=Path, default=SPECFORGE_WHEELS)
    parser.add_argument(
        "--train-one-at-a-time",
        action="store_true",
        help="every training alone, one after the other (default: SpecForge's for all seeds "
        "at once, the later seeds' pipelines beside them)",
    )
    parser.add_argument(
        "--live-at-once",
        type=int,
        default=1,
        help="live runs side by side on the GPU, each its own server (after the first, which "
        "serves the plain target alone); their speed-ups are then not comparable",
    )
    parser.add_argument(
        "--live-stagger-s",
        type=float,
        default=12.0,
        help="seconds between the starts of live runs side by side",
    )
    parser.add_argument(
        "--deterministic-live",
        action="store_true",
        help="one more live run of the first seed's drafter on SGLang's deterministic mode",
    )
    parser.add_argument(
        "--kit-out",
        type=Path,
        default=None,
        help="after each group, write what a call on another machine needs to go on "
        "(benchmarks/studies/specforge/resume.py)",
    )
    parser.add_argument(
        "--resume-kit",
        type=Path,
        default=None,
        help="a kit an earlier call wrote: used when this machine has no state of its own",
    )
    parser.add_argument("--fresh", action="store_true", help="remove the work root first")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    try:
        args.settings = [SpeculativeSetting.parse(s) for s in args.settings.split(",") if s]
    except PipelineError as exc:
        parser.error(f"--settings: {exc}")
    args.features = [r.strip() for r in args.features.split(",") if r.strip()]
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: distinct integers, e.g. 0,1,2 (got {args.seeds})")
    if args.epochs < 1:
        parser.error("--epochs must be >= 1")
    if args.live_at_once < 1 or args.live_stagger_s < 0:
        parser.error("--live-at-once must be >= 1 and --live-stagger-s >= 0")
    if not args.features or set(args.features) - {"sglang", "hf"}:
        parser.error(f"--features: sglang and/or hf, in the order to try (got {args.features})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    paths = Paths(args.work_root.resolve())
    if args.fresh and not args.dry_run:
        shutil.rmtree(paths.work, ignore_errors=True)
    ctx = Context(args, paths, time.monotonic() + args.deadline_s)
    if paths.state.is_file() and not args.dry_run:
        ctx.state = json.loads(paths.state.read_text())
    steps = plan_steps(args)
    if args.resume_kit and args.resume_kit.is_file():
        restored = restore_kit(paths, args.resume_kit, steps, dry_run=args.dry_run)
        if restored is None:
            log(f"[resume] {args.resume_kit} not used: the state is here, or a pipeline is left")
        else:
            ctx.state = restored
            done = sorted(restored["steps"])
            log(f"[resume] from {args.resume_kit}: {len(done)} steps done ({', '.join(done)})")
            if not args.dry_run:
                paths.state.write_text(json.dumps(ctx.state, indent=1))
    ctx.state.setdefault("steps", {})
    if not args.dry_run:
        paths.work.mkdir(parents=True, exist_ok=True)
    code, index = 0, 0
    while index < len(steps) and not code:
        group = next_group(ctx, steps, index)
        index += len(group)
        if not args.dry_run:
            for step in [s for s in group if is_done(ctx, s)]:
                log(f"[{step.name}] done in an earlier call")
            group = [s for s in group if not is_done(ctx, s)]
        if not group:
            continue
        names = ", ".join(s.name for s in group)
        needs = group_needs(ctx, group)
        if ctx.left() < needs and not args.dry_run:
            log(f"[{names}] not started: {ctx.left():.0f}s left, it needs ~{needs:.0f}s")
            code = EXIT_LEFT_FOR_LATER
            break
        log(f"[{names}] start ({ctx.left():.0f}s left)")
        started = time.monotonic()
        entries = run_group(ctx, group)
        for step in group:
            entry = entries[step.name]
            entry.setdefault("seconds", round(time.monotonic() - started, 1))
            entry["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            log(f"[{step.name}] {entry['status']} in {entry['seconds']}s")
            if entry["status"] != "done":
                code = max(code, EXIT_LEFT_FOR_LATER if entry["status"] == "timed out" else 1)
            if not args.dry_run:
                ctx.state["steps"][step.name] = entry
        if not args.dry_run:
            paths.state.write_text(json.dumps(ctx.state, indent=1))
            write(ctx, [s.name for s in steps if not is_done(ctx, s)])
            if args.kit_out and write_kit(paths, ctx.state, steps, args.kit_out):
                log(f"[resume] kit for a later call on another machine: {args.kit_out}")
    remaining = [s.name for s in steps if not is_done(ctx, s)]
    write(ctx, [] if args.dry_run else remaining)
    if not args.dry_run:
        log(f"bench_specforge: exit {code}; left for a later call: {remaining or 'nothing'}")
    return code


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""This pipeline and SpecForge 0.2 side by side on the lent H200: the same target, the same
training rows, the same number of epochs, and both drafters served by the same SGLang through
the same live harness (issue 27).

    bash tools/h200.sh specforge $OUT [--seeds 0,1,2] [--epochs 8] [--settings 7/1/8,3/1/4]
    python3 -u benchmarks/bench_specforge.py --dry-run --out /tmp/sf.json   # commands, here

Steps, in order; each is recorded in WORK/state.json when it ends, and a later call on the
warm machine (the same WORK) skips what is done, so a comparison longer than one call's 10
minutes continues where the last call stopped:

1. pipeline (per seed, one after the other): benchmarks/sglang_pipeline_h200.sh, the
   pipeline part's run (the 128-wide toy, engine sglang), through drafter/eval.json and the
   SGLang export, with `train.epochs` and `train.seed` set; for a later seed the same run
   directory retrains, evaluates and exports only (the train settings stamp changed). Its
   export, eval.json and training log are kept under WORK/seeds/seed<S>-epochs<E>/eaglepipe/.
2. specforge-inputs (once, after the first seed's pipeline): the run's train split as
   SpecForge JSONL (held-out rows and rows prepare skipped are left out;
   benchmarks/specforge_data.py), the target's chat template as SpecForge's template JSON,
   checked row by row against the prepared table (SpecForge's masking rule, written here,
   gives the same input_ids and loss mask), a view of the target with the index SpecForge's
   loader wants, and the draft config (the run's aux layers and train.draft_vocab_size, so
   both drafters have the same size).
3. specforge-features (once): SpecForge's own generator, scripts/prepare_hidden_states.py with
   SGLang in-process (--features sglang), or a transformers forward through SpecForge's own
   preprocessing (hf, benchmarks/specforge_hf_features.py); the first route of --features that
   succeeds is used. Every feature file's tokens and loss mask are then looked up in the
   prepared table.
4. specforge-train (per seed, every seed's at once on the one GPU unless
   --train-one-at-a-time: a toy's training leaves it mostly idle): `specforge train` with its
   Llama-3.1-8B offline recipe (examples/configs/llama3.1-8b-eagle3-offline.yaml: batch 1, lr
   1e-4, grad clip 0.5, TTT 7, sdpa) but --epochs and the seed, then `specforge export --to
   sglang`; the export's config.json gets the `eaglepipe` block the live harness reads.
5. live (per seed, setting and drafter): scripts/live_acceptance.py from the run directory,
   with the run's config, table and prompts, `--speculative S/K/D`, and one greedy reference
   for the target (`--greedy-reference`): the plain target is served once for all of them.

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, log, markdown_table, write_results  # noqa: E402
from specforge_steps import (  # noqa: E402
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
    """Every seed's pipeline first (one run directory, retrained per seed), SpecForge's inputs
    and features after the first; then SpecForge's trainings (run at once unless
    --train-one-at-a-time); then the live runs, seed by seed."""
    steps, epochs = [], args.epochs
    tags = {seed: f"seed{seed}-epochs{epochs}" for seed in args.seeds}
    for i, seed in enumerate(args.seeds):
        needs = STEP_SECONDS["pipeline-first" if i == 0 else "pipeline-retrain"]
        steps.append(Step(f"pipeline@{tags[seed]}", "pipeline", tags[seed], seed, needs_s=needs))
        if i == 0:
            for name, kind in (("specforge-inputs", "inputs"), ("specforge-features", "features")):
                steps.append(Step(name, kind, needs_s=STEP_SECONDS[name]))
    train_s = STEP_SECONDS["specforge-train-base"]
    train_s += STEP_SECONDS["specforge-train-per-epoch"] * epochs
    for seed in args.seeds:
        name = f"specforge-train@{tags[seed]}"
        steps.append(Step(name, "train", tags[seed], seed, needs_s=train_s))
    reference = "live-with-reference"  # the first live run also serves the plain target
    for seed in args.seeds:
        for setting in args.settings:
            for drafter in ("eaglepipe", "specforge"):
                needs, reference = STEP_SECONDS[reference], "live"
                name = f"live@{tags[seed]}@{drafter}@{setting.label.replace('/', '-')}"
                steps.append(Step(name, "live", tags[seed], seed, drafter, setting, needs))
    return steps


def next_group(ctx: Context, steps: list[Step], index: int) -> list[Step]:
    """The steps to run together from `index`: SpecForge's trainings not done yet side by side
    (unless --train-one-at-a-time), any other step alone."""
    if steps[index].kind != "train" or ctx.args.train_one_at_a_time:
        return [steps[index]]
    group = []
    while index < len(steps) and steps[index].kind == "train":
        group.append(steps[index])
        index += 1
    return group


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
        "bash", str(REPO_ROOT / "benchmarks" / "sglang_pipeline_h200.sh"), str(keep / "pipeline"),
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


def step_live(ctx: Context, step: Step) -> dict:
    paths = ctx.paths
    keep = paths.kept(step, step.drafter)
    label = step.setting.label.replace("/", "-")
    out = keep / f"live-{label}.json"
    argv = [
        sys.executable, "-u", str(REPO_ROOT / "scripts" / "live_acceptance.py"),
        "--config", ".eaglepipe/config.json", "--table", "prepared/tokenized.parquet",
        "--export-dir", str(keep / "export"), "--out", str(out),
        "--speculative", step.setting.label, "--greedy-reference", str(paths.greedy),
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
        "lossless": {k: lossless.get(k) for k in ("dtype", "prompts", "identical")},
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
    if group[0].kind == "train":
        return step_trainings(ctx, group)
    (step,) = group
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
        help="SpecForge's trainings one after the other (default: all seeds' at once)",
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
    ctx.state.setdefault("steps", {})
    if not args.dry_run:
        paths.work.mkdir(parents=True, exist_ok=True)
    steps = plan_steps(args)
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
        # Trainings side by side slow each other a little: a fifth more per extra one.
        needs = max(s.needs_s for s in group) * (1 + 0.2 * (len(group) - 1))
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
    remaining = [s.name for s in steps if not is_done(ctx, s)]
    write(ctx, [] if args.dry_run else remaining)
    if not args.dry_run:
        log(f"bench_specforge: exit {code}; left for a later call: {remaining or 'nothing'}")
    return code


if __name__ == "__main__":
    sys.exit(main())

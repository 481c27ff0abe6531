"""The rows of issue 27 still open, on the 8B-shaped random Llama (benchmarks/
benchmarks/studies/specforge/scale.py drives them on the lent H200; nothing here imports SpecForge):

(a) hidden-state generation on the same rows: SpecForge 0.2's own generator
    (scripts/prepare_hidden_states.py, SGLang in-process, as capture.py runs it)
    against this pipeline's extraction through its SGLang server (scripts/extract.py shard
    jobs): tokens/s, bytes stored per token, and a `kill -9` at half the rows followed by the
    same command again: what the rerun kept, what it redid, and whether the result is whole
    and right. SpecForge resumes by "the file exists" (a row whose file is there is skipped);
    the pipeline keeps a chunk only when its journal vouches for it and it re-hashes;
(b) training tokens/s of both trainers on those features, the same drafter (one Llama layer of
    the target's width, draft vocabulary 32,000) and TTT length 7, a fixed number of steps each;
(c) the two feature sets compared row by row (`compare_features`).

The rows: one user turn and one assistant turn of word tokens `t<id>` of the word-level
tokenizer benchmarks/speed/sglang_extraction.py saves, rendered by a chat template of our own
(`CHAT_TEMPLATE`): `t3 <user words> t4 <assistant words> t5 `. SpecForge tokenizes the
rendering and masks by its rule (the reply and its end of turn); the pipeline's prepared table
holds the same ids and mask, written directly (`scale_rows`). Content ids start at 16, so the
markers never occur inside a turn. Every row has the same length, so a SpecForge training step
(batch 1) is exactly one row's tokens.

What each stores as the final hidden state, from the sources (SGLang 0.5.14's
layers/logits_processor.py and models/llama.py, SpecForge 0.2.0's offline_capture/
sglang_backend): both take the logits processor's inputs. SpecForge's `hidden_state` is its
`pruned_states` of `hidden_states` (all tokens, forward mode switched to decode), which Llama
hands over after `model.norm` and without a pre-norm copy: post-norm. Its `aux_hidden_state` is
SGLang's `aux_hidden_states` concatenated in layer order, captured at `layers_to_capture = id +
1`, i.e. the residual stream entering layer id + 1 = the output of decoder layer id. The
pipeline's hook (patch/eaglepipe_hook.py) stores the same two tensors: aux id k = output of
decoder layer k, final = post-norm (docs/layers.md). So aux block i is compared with aux block
i, and final with hidden_state. A random model's norm weights are ones, so a pre-norm and a
post-norm state point the same way (cosine 1) and differ only in scale: the comparison reports
max |diff| and each side's mean per-token RMS (about 1 after a unit-weight RMSNorm) beside the
cosines.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO_ROOT, log, working_directory
from benchmarks.studies.specforge.data import (
    draft_config,
    target_view,
    write_json,
    write_specforge_jsonl,
)
from benchmarks.studies.specforge.scale_compare import (
    compare_features,
    specforge_step_times,
    training_rate,
)
from benchmarks.studies.specforge.scale_kill import (
    SPECFORGE_FILES,
    KillPlan,
    PipelineWatch,
    SpecforgeWatch,
    pipeline_completions,
    pipeline_resume_report,
    run_and_kill,
    same_file,
    shard_snapshot,
    specforge_completions,
    specforge_file_complete,
    specforge_resume_report,
    specforge_snapshot,
    steady_rate,
    verify_shards,
)
from benchmarks.studies.specforge.scale_results import write
from benchmarks.studies.specforge.steps import (
    SERVING_DTYPE,
    Command,
    Context,
    Paths,
    Step,
    StepFailed,
    capture_command,
    install_specforge,
    run_commands,
    show,
    tail,
    training_command,
)

# The word tokenizer's ids used as markers; content ids start at FIRST_CONTENT_ID.
USER, ASSISTANT, END_OF_TURN = 3, 4, 5
FIRST_CONTENT_ID = 16
TEMPLATE_NAME = "eaglepipe-target"  # the name capture_command passes to SpecForge
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}t3 {{ message['content'] }} "
    "{% elif message['role'] == 'assistant' %}t4 {{ message['content'] }} t5 "
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}t4 {% endif %}"
)
# SpecForge's ChatTemplate fields for CHAT_TEMPLATE (registered by capture.py).
TEMPLATE_SPEC = {
    "name": TEMPLATE_NAME,
    "assistant_header": "t4 ",
    "user_header": "t3 ",
    "end_of_turn_token": "t5 ",
    "system_prompt": None,
}


class ScalePaths(Paths):
    """steps.Paths (SpecForge's inputs, features and runs under WORK/specforge-files,
    the pipeline's run under WORK/pipeline-run) and the random target."""

    @property
    def model(self) -> Path:
        return self.work / "model"

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def hidden_states(self) -> Path:
        return self.run / "hidden_states"


# ---------------------------------------------------------------- the rows


@dataclass(frozen=True)
class ScaleRow:
    row_id: int
    input_ids: list[int]
    loss_mask: list[int]

    def messages(self) -> list[dict]:
        """The conversation whose rendering by CHAT_TEMPLATE tokenizes to `input_ids`."""
        header = self.input_ids.index(ASSISTANT)
        words = [f"t{i}" for i in self.input_ids]
        return [
            {"role": "user", "content": " ".join(words[1:header])},
            {"role": "assistant", "content": " ".join(words[header + 1 : -1])},
        ]


def scale_rows(count: int, tokens: int, vocab: int, seed: int) -> list[ScaleRow]:
    """`count` seeded rows of exactly `tokens` ids: USER, a quarter of user words, ASSISTANT,
    the assistant's words, END_OF_TURN; the loss mask covers the reply and END_OF_TURN."""
    import numpy as np

    if tokens < 8:
        raise ValueError(f"rows of {tokens} tokens: at least 8")
    rng = np.random.default_rng(seed)
    user = tokens // 4
    reply = tokens - 3 - user
    rows = []
    for row_id in range(count):
        words = rng.integers(FIRST_CONTENT_ID, vocab, user + reply).tolist()
        ids = [USER, *words[:user], ASSISTANT, *words[user:], END_OF_TURN]
        mask = [0] * (user + 2) + [1] * (reply + 1)
        rows.append(ScaleRow(row_id, ids, mask))
    return rows


# ---------------------------------------------------------------- steps


def note(ctx: Context, name: str, text: str) -> None:
    """An in-process step's line in a dry run (and its record among the commands)."""
    ctx.dry.append({"step": name, "in_process": text})
    log(f"[{name}] (in process) {text}")


def shape() -> dict:
    from benchmarks.toy_targets.llama import SHAPES

    return SHAPES["8b"]


def step_model(ctx: Context, step: Step) -> dict:
    """The random 8B-shaped Llama in bf16, made on the GPU and saved once (with the word
    tokenizer and CHAT_TEMPLATE); a half-saved model is never taken: it is saved beside and
    renamed."""
    paths = ctx.paths
    note(ctx, step.name, f"random Llama-3.1-8B-shaped target (bf16, seed 0) -> {paths.model}")
    if ctx.args.dry_run:
        return {}
    import torch

    from benchmarks.toy_targets.llama import random_llama
    from benchmarks.toy_targets.word_tokenizer import save_word_tokenizer

    if (paths.model / "config.json").is_file():
        return {"reused": True}
    if not torch.cuda.is_available():
        raise StepFailed("the 8B-shaped target is made on the GPU: no CUDA here")
    partial = paths.work / "model.partial"
    shutil.rmtree(partial, ignore_errors=True)
    began = time.monotonic()
    model = random_llama("cuda", torch.bfloat16, seed=0, **shape())
    model.save_pretrained(partial, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    save_word_tokenizer(partial, shape()["vocab"], CHAT_TEMPLATE)
    partial.rename(paths.model)
    files = [p for p in paths.model.iterdir() if p.is_file()]
    return {"seconds": round(time.monotonic() - began, 1),
            "bytes": sum(p.stat().st_size for p in files)}  # fmt: skip


def step_inputs(ctx: Context, step: Step) -> dict:
    """The same rows for both: SpecForge's JSONL, template JSON, target view and draft config;
    the pipeline's dataset and prepared table with the same ids and loss masks. A few rows are
    tokenized by SpecForge's rule (data.specforge_tokenize) with the target's own
    tokenizer and template first: they must give the table's ids and mask. SpecForge's wheels
    are installed here too."""
    paths, args = ctx.paths, ctx.args
    aux_ids = default_aux_ids()
    ctx.state.update(max_length=args.row_tokens + 64, aux_layer_ids=aux_ids)
    note(ctx, step.name, f"{args.rows} rows x {args.row_tokens} tokens -> {paths.data} and "
         f"{paths.run}/prepared/tokenized.parquet; target view {paths.target}")  # fmt: skip
    if not args.dry_run:
        import numpy as np
        from transformers import AutoTokenizer

        from benchmarks.studies.specforge.data import specforge_tokenize
        from benchmarks.toy_targets.rows import write_prepared

        rows = scale_rows(args.rows, args.row_tokens, shape()["vocab"], args.seed)
        tokenizer = AutoTokenizer.from_pretrained(paths.model)
        for row in rows[:4]:
            theirs = specforge_tokenize(tokenizer, row.messages(), TEMPLATE_SPEC, 10**6)
            if theirs != (row.input_ids, row.loss_mask):
                raise StepFailed(f"row {row.row_id}: SpecForge's rule tokenizes it otherwise")
        shutil.rmtree(paths.specforge, ignore_errors=True)
        shutil.rmtree(paths.run, ignore_errors=True)
        paths.specforge.mkdir(parents=True)
        write_specforge_jsonl([(r.row_id, r.messages()) for r in rows], paths.data)
        write_json(paths.template, TEMPLATE_SPEC)
        view = target_view(paths.model, paths.target, dtype=SERVING_DTYPE)
        write_json(paths.draft_config, draft_config(paths.model, aux_ids, args.draft_vocab))
        paths.run.mkdir(parents=True)
        write_prepared(
            paths.run, [np.asarray(r.input_ids, dtype=np.int32) for r in rows],
            rows_per_shard=scale_rows_per_shard(args), loss_masks=[r.loss_mask for r in rows],
        )  # fmt: skip
        ctx.state["lm_head_key"] = view["lm_head_key"]
    install_specforge(ctx)
    return {"rows": args.rows, "row_tokens": args.row_tokens, "aux_layer_ids": aux_ids}


def default_aux_ids() -> list[int]:
    from eaglepipe.core.layers import default_aux_layer_ids

    return list(default_aux_layer_ids(shape()["layers"]))


def specforge_capture(ctx: Context, name: str) -> Command:
    argv, env = capture_command(ctx, "sglang")
    return Command(name, argv, ctx.paths.logs / f"{name}.log", env=env)


def step_specforge_kill(ctx: Context, step: Step) -> dict:
    """SpecForge's generator from a fresh output directory and cache, `kill -9` at half the
    rows; the files as the kill left them."""
    paths, args = ctx.paths, ctx.args
    if not args.dry_run:  # a fresh output directory and cache (SpecForge caches by path)
        shutil.rmtree(paths.features, ignore_errors=True)
        shutil.rmtree(paths.specforge / "cache", ignore_errors=True)
        shutil.rmtree(paths.specforge / "scripts" / "cache", ignore_errors=True)
        (paths.logs / f"{step.name}.log").unlink(missing_ok=True)
    run = run_and_kill(ctx, [specforge_capture(ctx, step.name)], SpecforgeWatch(paths.features),
                       args.rows, KillPlan(fraction=args.kill_at))  # fmt: skip
    if args.dry_run:
        return {}
    at_kill = specforge_snapshot(paths.features)
    complete = [n for n, f in at_kill.items() if f["complete"]]
    return {
        **run,
        "snapshot": at_kill,
        "rate": steady_rate(specforge_completions(at_kill, complete, args.row_tokens)),
        "first_file_s": first_after(at_kill, complete, run["started_at"]),
        "complete_at_kill": len(complete),
    }


def first_after(snapshot: dict, names, started_at: float) -> float | None:
    times = [snapshot[n]["mtime_ns"] / 1e9 for n in names]
    return round(min(times) - started_at, 2) if times else None


def step_specforge_resume(ctx: Context, step: Step) -> dict:
    """The same command again, run to its end: what it kept and redid, and the result."""
    paths, args = ctx.paths, ctx.args
    if not args.dry_run:
        (paths.logs / f"{step.name}.log").unlink(missing_ok=True)
    command = specforge_capture(ctx, step.name)
    began, wall_began = time.monotonic(), time.time()
    (code,) = run_commands(ctx, [command])
    if args.dry_run:
        return {}
    if code != 0:
        raise StepFailed(f"{step.name}: exit {code}:\n{tail(command.log_path)}", code)
    at_kill = ctx.state["steps"]["specforge-kill"]["result"]["snapshot"]
    after = specforge_snapshot(paths.features)
    report = specforge_resume_report(at_kill, after, args.rows)
    written = [n for n in after if n not in at_kill or not same_file(at_kill[n], after[n])]
    files = [paths.features / n for n in after]
    return {
        "wall_s": round(time.monotonic() - began, 1),
        "rate": steady_rate(specforge_completions(after, written, args.row_tokens)),
        "first_file_s": first_after(after, written, wall_began),
        "accounting": report,
        "feature_bytes": sum(p.stat().st_size for p in files),
        "dir_bytes": sum(p.stat().st_size for p in paths.features.rglob("*") if p.is_file()),
        "snapshot_after": after,
    }


def scale_rows_per_shard(args) -> int:
    """--rows over --shards shards."""
    return math.ceil(args.rows / args.shards)


def pipeline_config_for(ctx: Context, model_dir: Path, run_dir: Path, dataset: Path) -> dict:
    """The extraction benchmark's server and extraction settings (benchmarks.sglang_runs'
    pipeline_config: the flags that ran on the H200), with --shards shards and --chunk-mb chunks."""
    from argparse import Namespace

    from benchmarks.sglang_runs import pipeline_config
    from eaglepipe.core.config import validate_config

    args = ctx.args
    settings = Namespace(
        engine="sglang", mem_fraction_static=args.mem_fraction_static, health_s=300.0,
        chunk_mb=args.chunk_mb, inflight_requests=args.inflight_requests,
        inflight_gb_variants=["2"], writeback_variants=[64],
    )  # fmt: skip
    config = pipeline_config(run_dir, model_dir, dataset, scale_rows_per_shard(args), settings)
    config["aux_layer_ids"] = list(ctx.state.get("aux_layer_ids") or default_aux_ids())
    return validate_config(config)


def extract_command(ctx: Context, config_path: Path, shard: str, name: str) -> Command:
    argv = [sys.executable, "-u", str(REPO_ROOT / "scripts" / "extract.py"),
            "--config", str(config_path), "--shard", shard]  # fmt: skip
    return Command(f"{name}:{shard}", argv, ctx.paths.logs / f"{name}-{shard}.log",
                   cwd=ctx.paths.run)  # fmt: skip


def step_pipeline(ctx: Context, step: Step) -> dict:
    """The pipeline's capture server started once; every shard's extract job at once, `kill
    -9` at half the rows; the same jobs again for the shards without a manifest; the shards
    checked as the validate stage checks them; the server stopped."""
    if ctx.args.dry_run:
        return pipeline_dry_run(ctx, step)
    from eaglepipe.core.config import write_resolved
    from eaglepipe.core.run import resolve
    from eaglepipe.plan.provenance import shards
    from eaglepipe.server.lifecycle.shared_server import start_server, stop_server

    paths, args = ctx.paths, ctx.args
    shutil.rmtree(paths.hidden_states, ignore_errors=True)
    for old in paths.logs.glob("pipeline-*.log"):
        old.unlink()
    config = pipeline_config_for(ctx, paths.model, paths.run, paths.run / "conversations.jsonl")
    resolved = write_resolved(config, paths.run / ".eaglepipe" / "config.json")
    result: dict = {}
    with working_directory(paths.run):
        names = shards(resolve(config))
        shard_dirs = [paths.hidden_states / n for n in names]
        began = time.monotonic()
        handle = start_server(resolve(config))
        try:
            result["server_start_s"] = round(time.monotonic() - began, 1)
            result["engine_version"] = handle.info.get("engine_version")
            commands = [extract_command(ctx, resolved, n, "pipeline-kill") for n in names]
            kill = run_and_kill(ctx, commands, PipelineWatch(shard_dirs), args.rows,
                                KillPlan(fraction=args.kill_at))  # fmt: skip
            at_kill = {n: shard_snapshot(d) for n, d in zip(names, shard_dirs, strict=True)}
            todo = [n for n in names if not at_kill[n]["manifest"]]
            began, wall_began = time.monotonic(), time.time()
            commands = [extract_command(ctx, resolved, n, "pipeline-resume") for n in todo]
            codes = run_commands(ctx, commands)
            wall = round(time.monotonic() - began, 1)
            if any(codes):
                tails = "\n".join(tail(c.log_path, 15) for c in commands)
                raise StepFailed(f"{step.name}: the rerun's jobs exited {codes}:\n{tails}")
            handoff = Path(config["server"]["dump_root"])
            leftovers = sum(1 for p in handoff.rglob("*") if p.is_file())
        finally:
            stop_server()
            shutil.rmtree(config["server"]["dump_root"], ignore_errors=True)
    after = {n: shard_snapshot(d) for n, d in zip(names, shard_dirs, strict=True)}
    manifests = {n: json.loads((d / "manifest.json").read_text())
                 for n, d in zip(names, shard_dirs, strict=True)}  # fmt: skip
    killed, resumed = pipeline_completions(at_kill, after, manifests)
    first = min((t for t, _ in resumed), default=None)
    return {
        **result,
        "shards": names,
        "kill": {
            **kill,
            "rate": steady_rate(killed),
            "journal_at_kill": {n: len(s["journal"]) for n, s in at_kill.items()},
            "tmp_at_kill": {n: s["tmp"] for n, s in at_kill.items()},
        },  # fmt: skip
        "resume": {
            "wall_s": wall,
            "rate": steady_rate(resumed),
            "first_chunk_s": None if first is None else round(first - wall_began, 2),
        },
        "accounting": pipeline_resume_report(at_kill, after, manifests),
        "verify": verify_shards(shard_dirs, {r: args.row_tokens for r in range(args.rows)}),
        "handoff_files_left": leftovers,
    }


def pipeline_dry_run(ctx: Context, step: Step) -> dict:
    """The server's command and the jobs' commands, built on a stand-in of the target (its
    config.json) and of the run in a temporary folder; shown with the real paths."""
    import tempfile

    import numpy as np
    from transformers import LlamaConfig

    from benchmarks.toy_targets.rows import write_prepared
    from eaglepipe.core.config import write_resolved
    from eaglepipe.core.run import resolve
    from eaglepipe.plan.provenance import shards
    from eaglepipe.server.sglang.recipe import launch_command, supported_range

    paths, args = ctx.paths, ctx.args
    s = shape()
    with tempfile.TemporaryDirectory(prefix="eaglepipe-scale-dry-") as tmp:
        model, run = Path(tmp) / "model", Path(tmp) / "run"
        LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"], max_position_embeddings=s["max_pos"],
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(model)  # fmt: skip
        run.mkdir()
        dataset = write_prepared(
            run, [np.zeros(args.row_tokens, dtype=np.int32)] * args.rows,
            rows_per_shard=scale_rows_per_shard(args),
        )  # fmt: skip
        config = pipeline_config_for(ctx, model, run, dataset)
        try:
            resolved = write_resolved(config, run / ".eaglepipe" / "config.json")
            with working_directory(run):
                names = shards(resolve(config))
            argv, env = launch_command(
                resolve(config), host="127.0.0.1", port=config["server"]["port"],
                dump_dir=Path(config["server"]["dump_root"]) / "dry-run", instance_id="dry-run",
                sglang_version=supported_range().recommended,
            )  # fmt: skip
        finally:
            shutil.rmtree(config["server"]["dump_root"], ignore_errors=True)
        real = {str(model.resolve()): str(paths.model), str(run): str(paths.run),
                str(resolved): str(paths.run / ".eaglepipe" / "config.json")}  # fmt: skip

        def relocate(argv: list[str]) -> list[str]:
            out = []
            for arg in argv:
                for old, new in sorted(real.items(), key=lambda kv: -len(kv[0])):
                    arg = arg.replace(old, new)
                out.append(arg)
            return out

        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        show(ctx, Command(f"{step.name}:server", relocate(argv), paths.logs / "server.log",
                          cwd=paths.run, env=env))  # fmt: skip
        for name in ("pipeline-kill", "pipeline-resume"):
            commands = [extract_command(ctx, paths.run / ".eaglepipe" / "config.json", n, name)
                        for n in names]  # fmt: skip
            if name == "pipeline-kill":
                run_and_kill(ctx, commands, None, args.rows, KillPlan(fraction=args.kill_at))
            else:
                run_commands(ctx, commands)
    note(ctx, step.name, "the shards checked (integrity, every row once), the server stopped")
    return {}


def step_fidelity(ctx: Context, step: Step) -> dict:
    paths = ctx.paths
    note(ctx, step.name, f"{paths.features} against {paths.hidden_states}/*: compare_features")
    if ctx.args.dry_run:
        return {}
    import torch

    config = json.loads(paths.draft_config.read_text())
    shard_dirs = sorted(p.parent for p in paths.hidden_states.glob("*/manifest.json"))
    manifest = json.loads((shard_dirs[0] / "manifest.json").read_text())
    began = time.monotonic()
    result = compare_features(
        paths.features, shard_dirs,
        specforge_aux_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        shard_aux_ids=manifest["aux_layer_ids"],
        device="cuda" if torch.cuda.is_available() else "cpu",
    )  # fmt: skip
    result["seconds"] = round(time.monotonic() - began, 1)
    return result


def run_one(ctx: Context, step: Step, command: Command) -> bool:
    """Run one step's command; False on a dry run (nothing to read), StepFailed on an exit."""
    (code,) = run_commands(ctx, [command])
    if ctx.args.dry_run:
        return False
    if code != 0:
        raise StepFailed(f"{step.name}: exit {code}:\n{tail(command.log_path)}", code)
    return True


def step_train_specforge(ctx: Context, step: Step) -> dict:
    """`specforge train` (its Llama-3.1-8B offline recipe: batch 1, TTT 7) for --specforge-steps
    steps, one log line a step. Feature files the kill left cut short are set aside first
    (renamed *.torn, which SpecForge's reader skips): its loader would fail on them."""
    paths, args = ctx.paths, ctx.args
    set_aside = []
    if not args.dry_run:
        for path in sorted(paths.features.glob(SPECFORGE_FILES)):
            if path.suffix == ".ckpt" and not specforge_file_complete(path):
                path.rename(path.with_name(path.name + ".torn"))
                set_aside.append(path.name)
    args.epochs = max(1, math.ceil(args.specforge_steps / args.rows))
    command = training_command(ctx, step)
    command.argv += [f"training.max_steps={args.specforge_steps}", "training.log_interval=1"]
    began = time.monotonic()
    if not run_one(ctx, step, command):
        return {}
    steps = specforge_step_times(command.log_path)
    rate = training_rate([s for _, s in steps], [args.row_tokens] * len(steps), args.warmup_steps)
    shutil.rmtree(paths.specforge / step.tag / "run", ignore_errors=True)  # its checkpoint
    return {"wall_s": round(time.monotonic() - began, 1), "steps": len(steps),
            "tokens_per_step": args.row_tokens, "batch_rows": 1, "set_aside": set_aside,
            **rate}  # fmt: skip


def step_train_eaglepipe(ctx: Context, step: Step) -> dict:
    """benchmarks/speed/train.py (the 8B shape's batch of 16,384 tokens, TTT 7) on the
    pipeline's shards of the same rows, --eaglepipe-steps steps."""
    paths, args = ctx.paths, ctx.args
    out = paths.work / "train-eaglepipe.json"
    argv = [sys.executable, "-u", "-m", "benchmarks.speed.train",
            "--run-dir", str(paths.run), "--model-dir", str(paths.model),
            "--steps", str(args.eaglepipe_steps), "--warmup-steps", str(args.warmup_steps),
            "--work-dir", str(paths.work / "train-eaglepipe"), "--out", str(out)]  # fmt: skip
    command = Command(step.name, argv, paths.logs / f"{step.name}.log")
    began = time.monotonic()
    if not run_one(ctx, step, command):
        return {}
    return {"wall_s": round(time.monotonic() - began, 1), **json.loads(out.read_text())}


# Usual lengths on the H200 (estimates from the 2026-12-01..03 runs: a 45 s model build, 57-87 s
# per SGLang start, ~60 s for SpecForge's generator to start on the toy; 0.83 s a training step
# of 16,384 tokens on the 8B shape): a step starts only when the time left covers it, and only
# once the steps it needs are done.
STEPS = (
    # name, runner, usual seconds, the steps it needs
    ("model", step_model, 60, ()),
    ("inputs", step_inputs, 25, ("model",)),
    ("specforge-kill", step_specforge_kill, 90, ("inputs",)),
    ("specforge-resume", step_specforge_resume, 90, ("specforge-kill",)),
    ("pipeline", step_pipeline, 120, ("inputs",)),
    ("fidelity", step_fidelity, 40, ("specforge-resume", "pipeline")),
    ("train-specforge", step_train_specforge, 90, ("specforge-resume",)),
    ("train-eaglepipe", step_train_eaglepipe, 50, ("pipeline",)),
)
RUNNERS = {name: runner for name, runner, _, _ in STEPS}
NEEDS = {name: needs for name, _, _, needs in STEPS}
EXIT_LEFT_FOR_LATER = 3
# What makes the data: a state written with other values is another comparison's.
DATA_SETTINGS = ("rows", "row_tokens", "seed", "shards", "chunk_mb", "draft_vocab", "kill_at")
# Deleted once every step is done (unless --keep-data): the target and both feature sets.
BIG_DATA = ("model", "model.partial", "specforge-files/features", "specforge-files/scale",
            "pipeline-run/hidden_states", "train-eaglepipe")  # fmt: skip


def plan_steps() -> list[Step]:
    return [Step(name, name, "scale", 0, needs_s=needs) for name, _, needs, _ in STEPS]


def status(ctx: Context, name: str) -> str | None:
    return ctx.state["steps"].get(name, {}).get("status")


def run_plan(args) -> int:
    """Every step not done yet, in order, each once the steps it needs are done and the time
    left covers it; the state after each (WORK/state.json) and the results (--out). Exit 0 when
    all are done, 3 when some are left for a later call, 1 when one failed (a later call
    retries it)."""
    paths = ScalePaths(Path(args.work_root).resolve())
    if args.fresh and not args.dry_run:
        shutil.rmtree(paths.work, ignore_errors=True)
    ctx = Context(args, paths, time.monotonic() + args.deadline_s)
    setup = {k: getattr(args, k) for k in DATA_SETTINGS}
    if paths.state.is_file() and not args.dry_run:
        ctx.state = json.loads(paths.state.read_text())
        if ctx.state.get("setup", setup) != setup:
            log(f"{paths.state} holds a comparison of {ctx.state['setup']}, not {setup}: "
                "give the same settings, or --fresh")  # fmt: skip
            return 2
    ctx.state.setdefault("steps", {})
    ctx.state["setup"] = setup
    if not args.dry_run:
        paths.logs.mkdir(parents=True, exist_ok=True)
    code = 0
    for step in plan_steps():
        if status(ctx, step.name) == "done" and not args.dry_run:
            log(f"[{step.name}] done in an earlier call")
            continue
        waiting = [n for n in NEEDS[step.name] if status(ctx, n) != "done"]
        if waiting and not args.dry_run:
            log(f"[{step.name}] not started: it needs {', '.join(waiting)}")
            continue
        if ctx.left() < step.needs_s and not args.dry_run:
            log(f"[{step.name}] not started: {ctx.left():.0f}s left, it needs ~{step.needs_s}s")
            code = max(code, EXIT_LEFT_FOR_LATER)
            continue
        log(f"[{step.name}] start ({ctx.left():.0f}s left)")
        began = time.monotonic()
        try:
            entry = {"status": "done", "result": RUNNERS[step.name](ctx, step)}
        except StepFailed as exc:
            entry = {"status": "timed out" if exc.code == 124 else "failed", "error": str(exc)}
            log(f"[{step.name}] {entry['status']}: {exc}")
        except Exception as exc:  # noqa: BLE001 - recorded; the steps that do not need it go on
            traceback.print_exc()
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:3000]}
            log(f"[{step.name}] failed: {entry['error']}")
        entry.update(seconds=round(time.monotonic() - began, 1),
                     ended_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
        if entry["status"] != "done":
            code = 1 if entry["status"] == "failed" or code == 1 else EXIT_LEFT_FOR_LATER
        if not args.dry_run:
            ctx.state["steps"][step.name] = entry
            write_state(paths, ctx.state)
            write(ctx, [s.name for s in plan_steps()])
    remaining = [s.name for s in plan_steps() if status(ctx, s.name) != "done"]
    if not args.dry_run and not remaining and not args.keep_data:
        for name in BIG_DATA:
            shutil.rmtree(paths.work / name, ignore_errors=True)
        log(f"every step done: the target and both feature sets removed from {paths.work}")
    write(ctx, [s.name for s in plan_steps()])
    if not args.dry_run:
        log(f"bench_specforge_scale: exit {code}; left for a later call: {remaining or 'nothing'}")
    return code


def write_state(paths: ScalePaths, state: dict) -> None:
    from eaglepipe.core.atomic import atomic_write_json

    atomic_write_json(paths.state, state)

"""SpecForge's side of compare.py (issue 27), and the command runner both
sides share: SpecForge's inputs made from the pipeline's run, its features (its own SGLang
generator, or a transformers forward through its preprocessing), `specforge train` with its
offline recipe and `specforge export --to sglang`, each as a step of the comparison.

SpecForge runs from its own wheels (.whl-specforge/manifest.json, staged by
tools/stage_specforge.py) installed into WORK/site-specforge: training, export and the
transformers capture see them and the machine's packages only (what ran on 2026-12-01);
SpecForge's SGLang capture also sees the staged SGLang, with the SGLang server's transformers
5.8.1 ahead. Nothing here imports SpecForge: it runs in those processes.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO_ROOT, log, working_directory
from eaglepipe.drafter.live_run import SpeculativeSetting

SPECFORGE_WHEELS = REPO_ROOT / ".whl-specforge"
MARGIN_S = 15  # kept back from the deadline for writing the results
# The dtype both ends run the target in on the GPU: the pipeline's server (server.dtype auto)
# and SpecForge's trainer and feature generator, through the target view's config.
SERVING_DTYPE = "bfloat16"
RECIPE = {  # SpecForge's examples/configs/llama3.1-8b-eagle3-offline.yaml, less the epochs
    "batch_size": 1,
    "learning_rate": 1.0e-4,
    "max_grad_norm": 0.5,
    "ttt_length": 7,
    "attention_backend": "sdpa",
    "log_interval": 50,
    "dist_timeout": 20,
}


@dataclass
class Paths:
    work: Path

    @property
    def run(
        self,
    ) -> Path:  # benchmarks/checks/sglang_pipeline_h200.sh's run with EAGLEPIPE_H200_ROOT=work
        return self.work / "pipeline-run"

    @property
    def specforge(self) -> Path:  # SpecForge's inputs, features and runs
        return self.work / "specforge-files"

    @property
    def site(self) -> Path:
        return self.work / "site-specforge"

    @property
    def state(self) -> Path:
        return self.work / "state.json"

    @property
    def greedy(self) -> Path:
        return self.work / "greedy-reference.json"

    @property
    def features(self) -> Path:
        return self.specforge / "features"

    @property
    def template(self) -> Path:
        return self.specforge / "chat_template.json"

    @property
    def data(self) -> Path:
        return self.specforge / "train.jsonl"

    @property
    def target(self) -> Path:
        return self.specforge / "target"

    @property
    def draft_config(self) -> Path:
        return self.specforge / "draft_config.json"

    def kept(self, step: Step, drafter: str) -> Path:
        """Where a seed's drafter is kept: its export, training log, evaluation and live runs."""
        return self.work / "seeds" / step.tag / drafter


@dataclass
class Step:
    name: str
    kind: str
    tag: str | None = None  # seed<S>-epochs<E>: what a drafter is trained with
    seed: int | None = None
    drafter: str | None = None
    setting: SpeculativeSetting | None = None
    needs_s: float = 60.0
    deterministic: bool = False  # a live run on SGLang's --enable-deterministic-inference


@dataclass
class Context:
    args: argparse.Namespace
    paths: Paths
    deadline: float
    state: dict = field(default_factory=dict)
    dry: list = field(default_factory=list)  # the dry run's commands

    def left(self) -> float:
        return self.deadline - time.monotonic()


# ---------------------------------------------------------------- running commands


def specforge_env(paths: Paths, *, capture: bool) -> dict:
    """SpecForge's processes: its own wheels first. Training, export and the transformers
    capture see them and the machine's packages only (what ran on 2026-12-01); SpecForge's
    SGLang capture also sees the staged SGLang, with the server's transformers 5.8.1 ahead."""
    env = dict(os.environ)
    entries = [str(paths.site)]
    if capture:
        server = [p for p in env.get("EAGLEPIPE_SGLANG_PYTHONPATH", "").split(os.pathsep) if p]
        pipeline = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        entries = [*server, str(paths.site), *pipeline]
    env.update(
        PYTHONPATH=os.pathsep.join(entries),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    return env


@dataclass
class Command:
    name: str
    argv: list[str]
    log_path: Path
    cwd: Path | None = None
    env: dict | None = None


def show(ctx: Context, command: Command) -> None:
    """The dry run's line for a command (and its record in the results)."""
    changed = {
        k: v
        for k, v in (command.env or {}).items()
        if k.startswith(("EAGLEPIPE_", "PYTHONPATH")) and os.environ.get(k) != v
    }
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(changed.items()))
    cwd = command.cwd or REPO_ROOT
    ctx.dry.append({"step": command.name, "argv": command.argv, "cwd": str(cwd), "env": changed})
    log(f"[{command.name}] (cd {cwd} && {prefix}{shlex.join(command.argv)})")


def run_commands(ctx: Context, commands: list[Command]) -> list[int]:
    """Run the commands at once, each to its log, under what is left of the deadline; their exit
    codes (124 for one still running at the deadline: its process group gets TERM, then KILL)."""
    if ctx.args.dry_run:
        for command in commands:
            show(ctx, command)
        return [0] * len(commands)
    running = []
    for command in commands:
        command.log_path.parent.mkdir(parents=True, exist_ok=True)
        log(f"[{command.name}] {shlex.join(command.argv)}  (log {command.log_path})")
        with open(command.log_path, "ab") as out:
            running.append(
                subprocess.Popen(
                    command.argv,
                    cwd=command.cwd or REPO_ROOT,  # where `-m benchmarks...` resolves
                    env=command.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            )
    codes = []
    for command, proc in zip(commands, running, strict=True):
        try:
            codes.append(proc.wait(timeout=max(ctx.left() - MARGIN_S, 1)))
        except subprocess.TimeoutExpired:
            log(f"[{command.name}] out of time: stopping its process group")
            stop_group(proc)
            codes.append(124)
    return codes


def stop_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_command(ctx: Context, name: str, argv: list[str], *, log_path: Path, cwd=None, env=None):
    """One command, as run_commands runs it; its exit code."""
    return run_commands(ctx, [Command(name, argv, log_path, cwd, env)])[0]


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"


class StepFailed(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def checked(ctx: Context, name: str, argv, *, log_path: Path, cwd=None, env=None) -> None:
    code = run_command(ctx, name, argv, log_path=log_path, cwd=cwd, env=env)
    if code != 0:
        log(f"[{name}] exit {code}; last lines of {log_path}:\n{tail(log_path)}")
        raise StepFailed(f"{name}: exit {code} (log {log_path})", code)


# ---------------------------------------------------------------- step 2: SpecForge's inputs


def step_inputs(ctx: Context, step: Step) -> dict:
    """In-process, from the run directory: SpecForge's JSONL, template, target view, config."""
    paths = ctx.paths
    if ctx.args.dry_run:
        log(f"[{step.name}] {paths.run}: train rows -> {paths.data}, template -> {paths.template}")
        return {}
    import pandas as pd

    from benchmarks.studies.specforge.data import (
        chat_template_spec,
        draft_config,
        target_view,
        template_agreement,
        train_conversations,
        write_json,
        write_specforge_jsonl,
    )
    from eaglepipe.core.run import load_run
    from eaglepipe.data.tokenizer import load_target_tokenizer

    shutil.rmtree(paths.specforge, ignore_errors=True)
    paths.specforge.mkdir(parents=True)
    with working_directory(paths.run):
        run = load_run(".eaglepipe/config.json")
        table_path = Path("prepared/tokenized.parquet")
        rows = train_conversations(run, table_path)
        written = write_specforge_jsonl(rows, paths.data)
        tokenizer = load_target_tokenizer(run)
        spec = chat_template_spec(tokenizer, "eaglepipe-target")
        write_json(paths.template, spec)
        table = pd.read_parquet(table_path)
        agreement = template_agreement(
            tokenizer, rows, spec, table, run.dataset.max_length
        )  # fmt: skip
        view = target_view(run.model.directory, paths.target, dtype=SERVING_DTYPE)
        config = draft_config(
            run.model.directory, run.aux_layer_ids, run.train.draft_vocab_size
        )  # fmt: skip
        write_json(paths.draft_config, config)
        max_length = run.dataset.max_length
    if agreement["equal"] != agreement["rows"]:
        log(
            f"[{step.name}] warning: SpecForge's masking rule differs from the prepared table on "
            f"{agreement['rows'] - agreement['equal']} of {agreement['rows']} rows "
            f"(first: {agreement['differing_rows'][:5]}): the drafters train on other targets"
        )
    return {
        "train_rows": written,
        "eval_rows": int((table["split"] == "eval").sum()),
        "chat_template": spec,
        "template_vs_table": agreement,
        "target_view": view,
        "max_length": max_length,
        "aux_layer_ids": config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "draft_vocab_size": config["draft_vocab_size"],
    }


def install_specforge(ctx: Context) -> None:
    """SpecForge's wheels (.whl-specforge/manifest.json) into WORK/site-specforge, once
    per manifest; each wheel is checked against its sha256 first."""
    manifest_path = ctx.args.wheels / "manifest.json"
    paths = ctx.paths
    if ctx.args.dry_run:
        wheels = [f"<{manifest_path}: its wheels>"]
    else:
        if not manifest_path.is_file():
            raise StepFailed(
                f"{manifest_path} does not exist: run 'tools/stage_specforge.py' here and carry "
                f"{ctx.args.wheels.name}"
            )
        manifest = json.loads(manifest_path.read_text())
        stamp = hashlib.sha256(manifest_path.read_bytes()).hexdigest()[:16]
        if (paths.site / ".installed").is_file() and (
            paths.site / ".installed"
        ).read_text() == stamp:
            return
        wheels = []
        for entry in manifest["wheels"]:
            path = REPO_ROOT / entry["file"]
            if (
                not path.is_file()
                or hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]
            ):
                raise StepFailed(f"{path} is missing or differs from {manifest_path}: stage again")
            wheels.append(str(path))
        shutil.rmtree(paths.site, ignore_errors=True)
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--disable-pip-version-check",
            "--target", str(paths.site), *wheels]  # fmt: skip
    checked(ctx, "install-specforge", argv, log_path=paths.work / "install-specforge.log")
    if not ctx.args.dry_run:
        (paths.site / ".installed").write_text(stamp)


# ---------------------------------------------------------------- step 3: SpecForge's features


def capture_command(ctx: Context, route: str) -> tuple[list[str], dict]:
    paths, args = ctx.paths, ctx.args
    max_length = str(ctx.state.get("max_length", 1024))
    if route == "sglang":
        # From a copy beside its cache: the script puts its datasets cache two folders up.
        script = paths.specforge / "scripts" / "prepare_hidden_states.py"
        if not args.dry_run:
            script.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.wheels / "prepare_hidden_states.py", script)
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            "-m", "benchmarks.studies.specforge.capture",
            "--template-json", str(paths.template), "--script", str(script), "--",
            "--strategy", "eagle3", "--target-model-path", str(paths.target),
            "--draft-model-config", str(paths.draft_config), "--data-path", str(paths.data),
            "--output-path", str(paths.features), "--chat-template", "eaglepipe-target",
            "--max-length", max_length, "--tp-size", "1",
            # batch 1: SpecForge's capture loader drops the last rows of an incomplete batch
            "--batch-size", "1", "--build-dataset-num-proc", "1", "--num-io-threads", "8",
            "--cache-dir", str(paths.specforge / "cache"),
            "--sglang-attention-backend", "triton", "--sglang-mem-fraction-static", "0.5",
        ]  # fmt: skip
        return argv, specforge_env(paths, capture=True)
    argv = [
        sys.executable, "-m", "benchmarks.studies.specforge.hf_features",
        "--target", str(paths.target), "--draft-config", str(paths.draft_config),
        "--data", str(paths.data), "--template-json", str(paths.template),
        "--out", str(paths.features), "--max-length", max_length,
        "--cache-dir", str(paths.specforge / "cache"), "--batch-size", "8",
    ]  # fmt: skip
    return argv, specforge_env(paths, capture=False)


def step_features(ctx: Context, step: Step) -> dict:
    paths = ctx.paths
    install_specforge(ctx)
    tried = {}
    for route in ctx.args.features:
        # SpecForge resumes by "the file exists" and caches its tokenised data by the data
        # file's path: a fresh directory and cache for every attempt.
        if not ctx.args.dry_run:
            shutil.rmtree(paths.features, ignore_errors=True)
            shutil.rmtree(paths.specforge / "cache", ignore_errors=True)
            shutil.rmtree(paths.specforge / "scripts" / "cache", ignore_errors=True)
        argv, env = capture_command(ctx, route)
        started = time.monotonic()
        log_path = paths.specforge / f"features-{route}.log"
        code = run_command(ctx, f"{step.name}:{route}", argv, log_path=log_path, env=env)
        seconds = round(time.monotonic() - started, 1)
        if ctx.args.dry_run:
            continue
        if code == 0 and list(paths.features.glob("rows_*/data_*.ckpt*")):
            import pandas as pd

            from benchmarks.studies.specforge.data import compare_with_table

            table = pd.read_parquet(paths.run / "prepared" / "tokenized.parquet")
            check = compare_with_table(paths.features, table)
            return {"route": route, "seconds": seconds, "tried": tried, "vs_table": check}
        tried[route] = {"exit": code, "seconds": seconds, "log_tail": tail(log_path, 15)}
        log(f"[{step.name}] route {route} failed (exit {code}); last lines:\n{tail(log_path)}")
        if code == 124:
            raise StepFailed(f"{step.name}: route {route} ran out of time", 124)
    if ctx.args.dry_run:
        return {}
    raise StepFailed(f"{step.name}: every route failed: {sorted(tried)}")


# ---------------------------------------------------------------- step 4: SpecForge's training


def train_config(ctx: Context, seed: int, lm_head_key: str, output_dir: Path) -> str:
    """SpecForge's run config (YAML): its offline recipe with this run's paths, epochs, seed."""
    paths = ctx.paths
    recipe = {**RECIPE, "num_epochs": ctx.args.epochs, "seed": seed, "save_interval": 0}
    config = {
        "model": {
            "target_model_path": str(paths.target),
            "draft_model_config": str(paths.draft_config),
            "target_backend": "sglang",
            "embedding_key": "model.embed_tokens.weight",
            "lm_head_key": lm_head_key,
            "vocab_mapping_path": str(paths.features / "vocab_mapping" / "vocab_mapping.pt"),
            "torch_dtype": SERVING_DTYPE,
        },
        "data": {
            "hidden_states_path": str(paths.features),
            "max_length": int(ctx.state.get("max_length", 1024)),
            "cache_dir": str(paths.specforge / "cache"),
        },
        "training": {"strategy": "eagle3", **recipe},
        "run_id": "specforge-eagle3",
        "output_dir": str(output_dir),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }
    return json.dumps(config, indent=1)  # JSON is YAML: `specforge train -c` reads either


_STEP_LINE = re.compile(r"^step (\d+): (\{.*\})\s*$")


def specforge_training(train_log: Path) -> dict:
    """The last of `specforge train`'s "step N: {...}" lines, and how many it logged."""
    steps = []
    for line in train_log.read_text(errors="replace").splitlines():
        match = _STEP_LINE.match(line)
        if match:
            try:
                steps.append((int(match.group(1)), ast.literal_eval(match.group(2))))
            except (ValueError, SyntaxError):
                continue
    if not steps:
        return {"logged_steps": 0}
    number, last = steps[-1]
    wanted = ("loss", "acc", "acceptance_rate", "grad_norm", "lr", "epoch")
    return {"logged_steps": len(steps), "last_step": number, **{k: last.get(k) for k in wanted}}


def training_command(ctx: Context, step: Step) -> Command:
    """A seed's `specforge train`, its run config written (printed in a dry run)."""
    paths = ctx.paths
    keep, work = paths.kept(step, "specforge"), paths.specforge / step.tag
    lm_head = ctx.state.get("lm_head_key", "LM_HEAD_KEY (from the target view)")
    config = work / "train.json"
    text = train_config(ctx, step.seed, lm_head, work / "run")
    if ctx.args.dry_run:
        log(f"[{step.name}] {config}:\n{text}")
    else:
        for folder in (work, keep):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        config.write_text(text)
    argv = [sys.executable, "-m", "specforge.cli", "train", "-c", str(config)]
    env = specforge_env(paths, capture=False)
    return Command(f"{step.name}:train", argv, keep / "train.log", env=env)


def step_trainings(ctx: Context, steps: list[Step]) -> dict[str, dict]:
    """`specforge train` for several seeds at once (independent processes on the one GPU: a
    toy's training leaves it mostly idle), then each one's export; an entry per step."""
    install_specforge(ctx)
    commands = [training_command(ctx, step) for step in steps]
    started = time.monotonic()
    codes = run_commands(ctx, commands)
    seconds = round(time.monotonic() - started, 1)
    entries = {}
    for step, command, code in zip(steps, commands, codes, strict=True):
        if code != 0:
            log(f"[{command.name}] exit {code}; last lines:\n{tail(command.log_path)}")
            status = "timed out" if code == 124 else "failed"
            entries[step.name] = {"status": status, "error": f"exit {code} ({command.log_path})"}
            continue
        try:
            result = export_training(ctx, step)
        except StepFailed as exc:
            entries[step.name] = {"status": "failed", "error": str(exc)}
            continue
        if result is not None:
            result.update(seconds=seconds, trained_at_once=len(steps))
            result["training"] = specforge_training(command.log_path)
        entries[step.name] = {"status": "done", "result": result or {}}
    return entries


def export_training(ctx: Context, step: Step) -> dict | None:
    """`specforge export --to sglang` of a seed's last checkpoint, marked for the live harness."""
    paths = ctx.paths
    keep, work = paths.kept(step, "specforge"), paths.specforge / step.tag
    export = keep / "export"
    argv = [sys.executable, "-m", "specforge.cli", "export", "--to", "sglang",
            "--checkpoint", str(work / "run" / "specforge-eagle3-latest"),
            "--draft-config", str(paths.draft_config), "--output-dir", str(export)]  # fmt: skip
    env = specforge_env(paths, capture=False)
    checked(ctx, f"{step.name}:export", argv, log_path=keep / "export.log", env=env)
    if ctx.args.dry_run:
        return None
    mark_export(export, ctx.state["aux_layer_ids"])
    return {"export_bytes": sum(p.stat().st_size for p in export.rglob("*") if p.is_file())}


def mark_export(export: Path, aux_layer_ids: list[int]) -> None:
    """The `eaglepipe` block the live harness reads (eaglepipe/drafter/live_run.py ExportInfo);
    SGLang ignores it. SpecForge's and SGLang's Llama layer ids are both 0-based decoder-layer
    outputs, so the ids stand as SpecForge wrote them."""
    path = export / "config.json"
    config = json.loads(path.read_text())
    written = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if written != aux_layer_ids:
        raise StepFailed(f"{path}: aux layers {written}, not the run's {aux_layer_ids}")
    config["eaglepipe"] = {
        "engine": "sglang",
        "layer": "llama",
        "aux_layer_ids": written,
        "trained_by": "specforge-0.2.0",
    }
    path.write_text(json.dumps(config, indent=2))

"""The parts of one device call (`bash tools/h200.sh PART OUT [args]`), as a table: what each
part runs, its arguments, how much of the call it leaves itself before its deadline, what it
needs staged beside the repository, and what it keeps for the call to return.

tools/h200.sh installs the staged wheels and sets the environment (bash's job), then runs
`python3 tools/device_parts.py run PART OUT ...`, which plans the part's command from this
table, runs it under `timeout` (TERM, then KILL 20 s later) and keeps its results in OUT.
`python3 tools/device_parts.py plan PART OUT [args]` prints the commands without running them.

Every part's command gets the arguments given after OUT; with --dry-run among them a part whose
script has a dry run prints its commands.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = "/tmp/eaglepipe-h200"
DEFAULT_BUDGET_S = 570
# What the call keeps after its part ends (server cleanup, logs, the JIT cache), and the
# least a part is started with.
CALL_RESERVE_S = 30
MIN_PART_S = 60
KILL_AFTER_S = 20
RETURNED_FILE_MAX = 15 * 1024 * 1024  # a returned file's 16 MiB, less a margin
LOG_TAIL_LINES = 200


@dataclass
class Call:
    """One call's settings: where it writes, how long it has, what it was given."""

    part: str
    out: Path
    args: list[str]
    root: Path = Path(DEFAULT_ROOT)
    budget_s: int = DEFAULT_BUDGET_S
    elapsed_s: int = 0  # what the shell had spent before this process started
    environ: dict = field(default_factory=lambda: dict(os.environ))
    repo: Path = REPO
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    started: float = field(default_factory=time.monotonic)

    @property
    def dry_run(self) -> bool:
        return "--dry-run" in self.args

    def seconds(self) -> int:
        return self.elapsed_s + int(time.monotonic() - self.started)

    def left(self) -> int:
        return self.budget_s - self.seconds() - CALL_RESERVE_S

    def say(self, message: str) -> None:
        now = datetime.now(UTC).strftime("%H:%M:%S")
        print(f"[h200 {now} +{self.seconds()}s] {message}", flush=True)


@dataclass(frozen=True)
class Planned:
    """A command and the variables it adds to the environment."""

    argv: list[str]
    env: dict = field(default_factory=dict)

    def line(self) -> str:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(self.env.items()))
        return prefix + shlex.join(self.argv)


@dataclass(frozen=True)
class Part:
    """One row of the table. `command` is the part's command line, its `{placeholders}` filled from
    `fields` (out, root, repo, deadline, pipeline_limit, and what `extra_fields` adds); the
    call's own arguments follow it (without --dry-run where `drops_dry_run`)."""

    name: str
    summary: str
    command: str = ""  # split as a shell splits it, then each word's placeholders filled
    deadline_margin_s: int = 25  # --deadline-s: this much less than the part's limit
    needs: tuple[str, ...] = (".whl-sglang",)
    pipeline_site: bool = True  # the pipeline's transformers ahead of the machine's
    env: tuple[tuple[str, str], ...] = ()
    drops_dry_run: bool = False
    extra_fields: Callable[[Call], dict] | None = None
    prepare: Callable[[Call, dict], list[str]] | None = None  # extra args after the command's
    finish: Callable[[Call, dict], None] | None = None


def fields(part: Part, call: Call, left: int) -> dict:
    values = {
        "out": str(call.out),
        "root": str(call.root),
        "repo": str(call.repo),
        "deadline": str(left - part.deadline_margin_s),
        "pipeline_limit": str(left - KILL_AFTER_S),
        "cores": str(call.cores),
    }
    if part.extra_fields is not None:
        values.update(part.extra_fields(call))
    return values


def planned(part: Part, call: Call, left: int, extra: list[str] = ()) -> Planned:
    """The part's command for this call, `left` seconds before the call's reserve."""
    values = fields(part, call, left)
    given = [a for a in call.args if not (part.drops_dry_run and a == "--dry-run")]
    argv = [word.format(**values) for word in shlex.split(part.command)] + list(extra) + given
    return Planned(argv, {k: v.format(**values) for k, v in part.env})


def under_timeout(command: Planned, left: int) -> list[str]:
    return ["timeout", "--signal=TERM", f"--kill-after={KILL_AFTER_S}", str(left), *command.argv]


def run_part(part: Part, call: Call) -> int:
    left = call.left()
    if left < MIN_PART_S:
        call.say(f"only {left}s left for {part.name}: not started")
        return 1
    call.say(f"{part.name}: start (limit {left}s)")
    if not part.command:
        return 0
    missing = [n for n in staged_needs(part, call) if not (call.repo / n).is_dir()]
    if missing and not call.dry_run:
        call.say(f"{part.name} needs {', '.join(missing)} staged and carried: not started")
        return 1
    values = fields(part, call, left)
    try:
        extra = part.prepare(call, values) if part.prepare is not None else []
    except PartStopped as stopped:
        call.say(str(stopped))
        return 1
    left = call.left()  # what preparing took
    command = planned(part, call, left, extra)
    code = subprocess.run(
        under_timeout(command, left), env={**call.environ, **command.env}
    ).returncode
    if part.finish is not None:
        part.finish(call, values)
    return code


def staged_needs(part: Part, call: Call) -> list[str]:
    """What the part needs carried; the SpecForge parts' `--wheels DIR` names their own."""
    given_wheels = "--wheels" in call.args or any(a.startswith("--wheels=") for a in call.args)
    return [n for n in part.needs if not (n == ".whl-specforge" and given_wheels)]


class PartStopped(Exception):
    """A part's precondition failed: the message says which and what to do."""


# ---------------------------------------------------------------- what the parts keep


def keep_log_tails(root: Path, archive: Path) -> None:
    """The last lines of every log under `root` (snakemake's, the rules', the servers') into
    one archive, at their paths under `root`."""
    with tempfile.TemporaryDirectory() as tails, tarfile.open(archive, "w:gz") as tar:
        for log in sorted(root.rglob("*.log")) if root.is_dir() else []:
            if not log.is_file():
                continue
            copy = Path(tails) / log.relative_to(root)
            copy.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "rb") as source:
                copy.write_bytes(b"".join(source.readlines()[-LOG_TAIL_LINES:]))
        tar.add(tails, arcname=".")


def archive(source: Path, name: str, target: Path, *, excluded: Callable[[str], bool]) -> None:
    """`source/name` as a gzip'd tar at `target`, members named from `name`."""

    def keep(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if excluded(Path(member.name).name) else member

    with tarfile.open(target, "w:gz") as tar:
        tar.add(source / name, arcname=name, filter=keep)


def keep_mla_probe_logs(call: Call, values: dict) -> None:
    keep_log_tails(call.root, call.out / "mla_probe_logs.tgz")


def keep_regen_acceptance_logs(call: Call, values: dict) -> None:
    keep_log_tails(call.root / "regen-acceptance", call.out / "regen_acceptance_logs.tgz")


def keep_variants(call: Call, values: dict) -> None:
    variants = call.root / "variants"
    if (variants / "summary.json").is_file():
        shutil.copyfile(variants / "summary.json", call.out / "variants_summary.json")
    if variants.is_dir():
        archive(call.root, "variants", call.out / "variants_results.tgz",
                excluded=lambda n: n.endswith(".safetensors") or n == "checkpoints")  # fmt: skip


def keep_specforge_results(call: Call, values: dict) -> None:
    """Log tails, and each seed's drafters (both exports, eval.json, live-*.json: a toy's are
    small) when they fit a returned file."""
    work = call.root / "specforge"
    if not work.is_dir():
        return
    keep_log_tails(work, call.out / "specforge_logs.tgz")
    if not (work / "seeds").is_dir():
        return
    drafters = call.out / "specforge_drafters.tgz"
    archive(work, "seeds", drafters, excluded=lambda n: n.endswith(".tgz"))
    if drafters.stat().st_size > RETURNED_FILE_MAX:
        call.say(f"the drafters are too large to return: left in {work / 'seeds'}")
        drafters.unlink()


def keep_specforge_scale_logs(call: Call, values: dict) -> None:
    scale = Path(values["scale"])
    if scale.is_dir():
        keep_log_tails(scale, call.out / "specforge_scale_logs.tgz")


# ---------------------------------------------------------------- what some parts prepare


def variants_run(call: Call) -> dict:
    # The plain variant is the pipeline run's own drafter (same seed and data): its figures
    # are in that run's eval.json and live.json. EAGLEPIPE_VARIANTS_RUN names another finished
    # run on this machine (the specforge part's, for one).
    return {"run": call.environ.get("EAGLEPIPE_VARIANTS_RUN") or str(call.root / "pipeline-run")}


def variants_need_a_run(call: Call, values: dict) -> list[str]:
    if not (Path(values["run"]) / "drafter" / "eval.json").is_file():
        raise PartStopped(
            f"variants: no finished pipeline run in {values['run']}: run the pipeline part "
            "first, on the same warm machine"
        )
    return []


def specforge_resume_kit(call: Call, values: dict) -> list[str]:
    # A kit carried from an earlier call (.specforge-resume/, see
    # benchmarks/studies/specforge/resume.py) lets a fresh machine go on where a lost one stopped.
    kit = call.repo / ".specforge-resume" / "specforge_resume.tgz"
    return ["--resume-kit", str(kit)] if kit.is_file() else []


def specforge_scale_root(call: Call) -> dict:
    # On /dev/shm (the 16 GB target and both feature sets; EAGLEPIPE_SCALE_ROOT to move it); it
    # stays for a later call on the warm machine until every step is done.
    scale = Path(call.environ.get("EAGLEPIPE_SCALE_ROOT") or "/dev/shm/eaglepipe-specforge-scale")
    if not os.access(scale.parent, os.W_OK):
        scale = call.root / "specforge-scale"
    return {"scale": str(scale)}


MLA_TOY = (
    "python3 -u -m benchmarks.toy_targets.deepseek --corpus data/sample/conversations.jsonl "
    "--out {root}/deepseek-toy --device cuda"
)
TOY_BUILD_RESERVE_S = 200  # what the pipeline needs after the toy's build


def mla_toy_command(call: Call) -> list[str]:
    """The DeepSeek-V3-shaped toy's build; EAGLEPIPE_MLA_TOY_SHAPE=H,Q,KV,NOPE,ROPE,V picks its
    sizes (`--shape`: a shape mla-probe served)."""
    argv = [word.format(root=call.root) for word in shlex.split(MLA_TOY)]
    shape = call.environ.get("EAGLEPIPE_MLA_TOY_SHAPE") or "default"
    return argv if shape == "default" else [*argv, "--shape", shape]


def mla_toy_and_overrides(call: Call, values: dict) -> list[str]:
    """An MLA draft layer needs a target with MLA attention: the DeepSeek-V3-shaped toy,
    pre-trained on the GPU, then the pipeline on it in the pipeline part's run directory (so
    `variants --variants mla` finds it). Regeneration stays off: the toy's own replies are not
    what this run measures, and it saves a server start. A toy of other sizes left here is
    rebuilt."""
    toy = call.root / "deepseek-toy"
    shape = call.environ.get("EAGLEPIPE_MLA_TOY_SHAPE") or "default"
    toy_cmd = mla_toy_command(call)
    shape_file = toy / "shape.txt"
    if (shape_file.read_text().strip() if shape_file.is_file() else None) != shape:
        shutil.rmtree(toy, ignore_errors=True)
        shutil.rmtree(call.root / "pipeline-run", ignore_errors=True)
    if call.dry_run:
        # A real checkpoint of the same shape (2 steps, CPU), so the dry run checks the
        # pipeline's plan against it.
        call.say(f"(dry run) {' '.join(toy_cmd)}; here with --device cpu --steps 2")
        done = subprocess.run([*toy_cmd, "--device", "cpu", "--steps", "2"],
                              stdout=subprocess.DEVNULL, env=call.environ)  # fmt: skip
        if done.returncode != 0:
            raise PartStopped(f"pipeline-mla: the toy's build exited {done.returncode}")
        shape_file.write_text(shape + "\n")
    elif not (toy / "config.json").is_file():
        call.say(f"building the DeepSeek-V3-shaped toy target ({shape}) into {toy}")
        limit = call.left() - TOY_BUILD_RESERVE_S
        done = subprocess.run(under_timeout(Planned(toy_cmd), limit), env=call.environ)
        if done.returncode != 0:
            raise PartStopped(f"pipeline-mla: the toy's build exited {done.returncode}")
        shape_file.write_text(shape + "\n")
    overrides = call.root / "mla-overrides.yaml"
    overrides.write_text(
        f"model:\n  path: {toy}\ndataset:\n  regenerate:\n    enabled: false\n"
    )  # fmt: skip
    return ["--overrides", str(overrides)]


# ---------------------------------------------------------------- the table

PIPELINE = "bash benchmarks/checks/sglang_pipeline_h200.sh {out}"
PIPELINE_ENV = (("EAGLEPIPE_PIPELINE_LIMIT_S", "{pipeline_limit}"),)
SPECFORGE_NEEDS = (".whl-sglang", ".whl-specforge")


PARTS = [
    Part("check", "imports, versions, plugin registration (~1 min)"),
    Part(
        "fidelity",
        "live SGLang dumps vs a transformers forward (Llama, DeepSeek, Kimi)",
        "python3 -u -m benchmarks.checks.sglang_fidelity --out {out}/fidelity.json --deadline-s "
        "{deadline} --work-root {root} --keep",
    ),
    Part(
        "perf",
        "the extraction benchmark through SGLang (8B shape)",
        "python3 -u -m benchmarks.speed.sglang_extraction --out {out}/sglang_extraction.json "
        "--deadline-s {deadline} --work-root /tmp",
    ),
    Part(
        "perf-scale",
        "the same at realistic sizes on /dev/shm (5 M tokens, 1.25 M per shard, each shard "
        "verified then deleted; ~8 min)",
        "python3 -u -m benchmarks.speed.sglang_extraction --preset scale-shm --out "
        "{out}/sglang_extraction_scale-shm.json --deadline-s {deadline} --work-root /tmp",
    ),
    Part(
        "perf-scale-disk",
        "the same on disk (3 M tokens in 0.5 M-token shards, dumps bounded as the pipeline does "
        "by default; ~7 min)",
        "python3 -u -m benchmarks.speed.sglang_extraction --preset scale-disk --out "
        "{out}/sglang_extraction_scale-disk.json --deadline-s {deadline} --work-root /tmp",
    ),
    Part(
        "pipeline",
        "the whole pipeline with engine sglang (snakemake)",
        PIPELINE,
        env=PIPELINE_ENV,
    ),
    Part(
        "pipeline-mla",
        "the pipeline on a DeepSeek-V3-shaped toy target (MLA attention, pre-trained here on the "
        "GPU; EAGLEPIPE_MLA_TOY_SHAPE=H,Q,KV,NOPE,ROPE,V for other sizes), regeneration off (~6 "
        "min)",
        PIPELINE,
        env=PIPELINE_ENV,
        prepare=mla_toy_and_overrides,
    ),
    Part(
        "mla-probe",
        "which MLA shapes the capture and generation servers serve (--shapes "
        "H,Q,KV,NOPE,ROPE,V;...; ~2.5 min a shape)",
        "python3 -u -m benchmarks.checks.sglang_mla_probe --out {out}/mla_probe.json --deadline-s "
        "{deadline} --work-root {root}",
        finish=keep_mla_probe_logs,
    ),
    Part(
        "variants",
        "each drafter variant trained, evaluated, exported and served live on the run the "
        "pipeline part left ([--variants fc_norm,norm_output] [--epochs N]; ~3.5 min each; "
        "EAGLEPIPE_VARIANTS_RUN=DIR: another finished run)",
        "python3 -u -m benchmarks.studies.drafter_variants --run-dir {run} --variants "
        "fc_norm,norm_output --out {root}/variants",
        extra_fields=variants_run,
        prepare=variants_need_a_run,
        finish=keep_variants,
    ),
    Part(
        "live",
        "scripts/live_acceptance.py on a carried run's files (--config C --export-dir D --table T "
        "--eval E)",
        "python3 -u scripts/live_acceptance.py --out {out}/live.json",
    ),
    Part(
        "regen",
        "the regenerate stage vs SGLang's bench_serving, same batch (8B shape)",
        "python3 -u -m benchmarks.speed.sglang_regeneration --out {out}/sglang_regeneration.json "
        "--deadline-s {deadline} --work-root /tmp",
    ),
    Part(
        "regen-sweep",
        "the same at 64, 128, 256 requests in flight (~8 min)",
        "python3 -u -m benchmarks.speed.sglang_regeneration --sweep 64,128,256 --out "
        "{out}/sglang_regeneration_sweep.json --deadline-s {deadline} --work-root /tmp",
    ),
    Part(
        "ingest",
        "H = 7168 dumps to checksummed chunks with 1-16 workers vs raw writes, /dev/shm and disk "
        "(no GPU, no SGLang; ~5 min)",
        "python3 -u -m benchmarks.speed.ingest --hidden-size 7168 --gb-per-worker 2 --workers "
        "1,2,4,8,16 --storages shm,disk --out-dir /tmp --out {out}/ingest.json --deadline-s "
        "{deadline}",
    ),
    Part(
        # Needs neither GPU nor server, so a dry run runs it as is (without --dry-run, which the
        # script does not take).
        "job-start",
        "a shard job's imports in fresh interpreters and its row read (no GPU, no server; ~30 s; "
        "runs with --dry-run too); `--parts lease --writer-gb 12`: the job's server lease beside "
        "two chunk writers",
        "python3 -u -m benchmarks.speed.job_start --parts imports,read --dir /tmp --out "
        "{out}/job_start.json",
        drops_dry_run=True,
    ),
    Part(
        # --scheduler greedy: the ilp scheduler needs pulp, which is not staged.
        "regen-acceptance",
        "drafters trained on the dataset's and on the target's replies (two pipelines at once; a "
        "second call on the warm machine resumes them)",
        "python3 -u -m benchmarks.studies.regeneration_acceptance --overrides "
        "benchmarks/studies/h200_regeneration.yaml --work-root {root}/regen-acceptance --cores "
        "{cores} --parallel --cross-live 0 --deadline-s {deadline} --snakemake-arg=--scheduler "
        "--snakemake-arg=greedy --out {out}/regen_acceptance.json",
        deadline_margin_s=45,
        finish=keep_regen_acceptance_logs,
    ),
    Part(
        "train",
        "drafter training tokens/s on the 8B shape from synthetic shards of each store "
        "([--store-dtypes bf16,fp8]; ~3 min)",
        "python3 -u -m benchmarks.speed.train --out {out}/train.json",
    ),
    Part(
        # --scheduler greedy: the ilp scheduler needs pulp, which is not staged.
        "store-quality",
        "the pipeline per stored dtype and seed, offline and live acceptance at 7/1/8 and 3/1/4 "
        "([--store-dtypes bf16,fp8aux,fp8] [--seeds 0,1,2]; a later call on the warm machine "
        "resumes it)",
        "python3 -u -m benchmarks.studies.store_quality --overrides "
        "benchmarks/studies/h200_regeneration.yaml --work-root {root}/store-quality --cores "
        "{cores} --deadline-s {deadline} --snakemake-arg=--scheduler --snakemake-arg=greedy "
        "--out {out}/store_quality.json",
        deadline_margin_s=45,
    ),
    Part(
        "specforge",
        "this pipeline and SpecForge 0.2 on the same toy target and rows, both drafters through "
        "the same live harness ([--seeds 0,1,2] [--epochs 8] [--settings 7/1/8,3/1/4]; a later "
        "call continues)",
        "python3 -u -m benchmarks.studies.specforge.compare --out {out}/specforge.json "
        "--work-root {root}/specforge --deadline-s {deadline} --kit-out "
        "{out}/specforge_resume.tgz",
        needs=SPECFORGE_NEEDS,
        pipeline_site=False,
        prepare=specforge_resume_kit,
        finish=keep_specforge_results,
    ),
    Part(
        "specforge-scale",
        "on the 8B-shaped random Llama: SpecForge's generator vs this pipeline's extraction, each "
        "killed at half its rows and run again, both trainers, the feature sets compared ([--rows "
        "96] [--row-tokens 2048]; ~8 min; a later call finishes what is left)",
        "python3 -u -m benchmarks.studies.specforge.scale --out {out}/specforge_scale.json "
        "--work-root {scale} --deadline-s {deadline}",
        needs=SPECFORGE_NEEDS,
        pipeline_site=False,
        extra_fields=specforge_scale_root,
        finish=keep_specforge_scale_logs,
    ),
]
BY_NAME = {part.name: part for part in PARTS}


def the_part(name: str) -> Part:
    if name not in BY_NAME:
        raise SystemExit(f"tools/h200.sh: unknown part '{name}' ({', '.join(BY_NAME)})")
    return BY_NAME[name]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("names", help="the parts, one line")
    usage = sub.add_parser("usage", help="each part and what it does")
    usage.add_argument("--prefix", default="")
    sites = sub.add_parser("sites", help="the staged sites on the part's PYTHONPATH, in order")
    sites.add_argument("part")
    for name in ("run", "plan"):
        action = sub.add_parser(name)
        action.add_argument("part")
        action.add_argument("out", type=Path)
        action.add_argument("--root", type=Path, default=Path(DEFAULT_ROOT))
        action.add_argument("--budget-s", type=int, default=DEFAULT_BUDGET_S)
        action.add_argument("--elapsed-s", type=int, default=0)
        # (the options before PART: everything after OUT is the part's)
        action.add_argument("args", nargs=argparse.REMAINDER, help="-- then the part's arguments")
    args = parser.parse_args(argv)
    if args.action == "names":
        print(" ".join(BY_NAME))
        return 0
    if args.action == "usage":
        for part in PARTS:
            print(f"{args.prefix}{part.name}: {part.summary}")
        return 0
    if args.action == "sites":
        print("site-pipeline site" if the_part(args.part).pipeline_site else "site")
        return 0
    part = the_part(args.part)
    given = args.args[1:] if args.args[:1] == ["--"] else args.args
    call = Call(part.name, args.out, given, args.root, args.budget_s, args.elapsed_s)
    if args.action == "plan":
        for command in plan_lines(part, call):
            print(command)
        return 0
    return run_part(part, call)


def plan_lines(part: Part, call: Call) -> list[str]:
    """The part's commands for a call with its whole limit left, without running or
    preparing anything: the MLA toy's build first where the part has one."""
    left = call.left()
    values = fields(part, call, left)
    lines = []
    extra: list[str] = []
    if part.prepare is mla_toy_and_overrides:
        lines.append(Planned(mla_toy_command(call)).line())
        extra = ["--overrides", str(call.root / "mla-overrides.yaml")]
    elif part.prepare is specforge_resume_kit:
        extra = specforge_resume_kit(call, values)
    if not part.command:
        return ["# nothing beyond tools/h200.sh's own import check"]
    command = planned(part, call, left, extra)
    lines.append(Planned(under_timeout(command, left), command.env).line())
    return lines


if __name__ == "__main__":
    sys.exit(main())

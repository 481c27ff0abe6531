"""What the Snakefile runs around the rules: garbage-collector tuning for large DAGs, what the
per-shard jobs declare up front (input functions' parameters, the temporary directory), the
project's Python for rule commands, the run token, the warning about rerun triggers, the run's
record and the disk plan at start, and stopping the server this run started (onsuccess /
onerror)."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import tempfile
import uuid

from .. import __version__
from ..core.run import RunSpec

RUN_TOKEN_ENV = "EAGLEPIPE_RUN_TOKEN"


# Full (oldest-generation) collections: at most one per this many young-generation collections.
_GC_FULL_EVERY = 1000
_gc_tuned = False


def tune_gc_for_dag() -> None:
    """Keep Python's cyclic garbage collector from rescanning Snakemake's DAG over and over.

    A DAG of 10,000 jobs is about a million objects (jobs, files, wildcards) that all live
    until the process ends. With the default thresholds the collector rescans all of them each
    time the heap has grown by a quarter (about 3 s of a 14 s `snakemake -n` on 5,000 shards),
    and again while the interpreter shuts down (another 2.5 s). So: what exists at parse time
    (imported modules, the config) is frozen; a full collection waits for 1000 young-generation
    collections instead of 10, while young garbage is collected as often as before; and at exit
    everything is frozen, so the shutdown frees memory without walking the DAG first.
    """
    global _gc_tuned
    if _gc_tuned:
        return
    _gc_tuned = True
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _GC_FULL_EVERY)
    atexit.register(gc.freeze)


def known_parameters(func):
    """Give a per-job input function its parameters up front (returns `func`).

    Snakemake inspects an input function's signature twice on every call, once per job: about
    3 % of a 5,000-shard dry run (inspect.signature is slow). Its own
    `overwrite_function_params` stores them on the function, where it looks first; the value
    stored is the signature's own, so what Snakemake passes the function is unchanged.
    """
    import inspect

    try:
        from snakemake.common import overwrite_function_params
    except ImportError:  # a Snakemake without it inspects each call, as before
        return func
    overwrite_function_params(func, inspect.signature(func).parameters)
    return func


# Snakemake's own default for the tmpdir resource (snakemake.resources.Resources.DEFAULTS).
_STOCK_TMPDIR_EXPRESSION = "system_tmpdir"


def per_shard_job_resources(snakemake_workflow) -> dict:
    """Resources the per-shard rules declare: the temporary directory, as a constant.

    Snakemake evaluates its default `tmpdir` (the expression `system_tmpdir`, compiled and
    run with `eval`) anew for every job: about 0.8 s of a 5,000-shard dry run's 10.5 s on the
    2-core machine. Where this process would evaluate it, the constant is the same value. Not
    declared (the default stays) in a cluster job's own Snakemake, which evaluates the
    expression on its node, nor where the user gave a tmpdir of their own in
    `--default-resources` (a rule's resources would override it); `--set-resources` still
    overrides the constant.
    """
    from snakemake_interface_executor_plugins.settings import ExecMode

    if snakemake_workflow.exec_mode != ExecMode.DEFAULT:
        return {}
    defaults = snakemake_workflow.resource_settings.default_resources
    if defaults is not None and "tmpdir" in defaults:
        chosen = defaults["tmpdir"]
        if getattr(chosen, "raw", chosen) != _STOCK_TMPDIR_EXPRESSION:
            return {}
    return {"tmpdir": tempfile.gettempdir()}


def warn_about_rerun_triggers(snakemake_workflow) -> None:
    """The rerun policy assumes mtime-only triggers (profiles/default sets them)."""
    settings = getattr(snakemake_workflow, "dag_settings", None)
    if settings is None:  # settings are only known once the run starts
        return
    extra = sorted(t.name.lower() for t in settings.rerun_triggers if t.name != "MTIME")
    if extra:
        print(
            f"eaglepipe: warning: rerun triggers {', '.join(extra)} are on (no default profile?):"
            " a moved script, an edited rule or a new input path can then rerun prepare and"
            " hide stale shards from this run; use --rerun-triggers mtime (profiles/default)",
            file=sys.stderr,
            flush=True,
        )


def use_project_python() -> None:
    """Make `python` in rule shell commands the interpreter running snakemake.

    Jobs inherit this environment, so rules never reach a bare python3 from PATH (under
    `--sdm conda` Snakemake puts the rule's environment first instead). Unbuffered output
    keeps progress lines live in logs.
    """
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + path
    os.environ["PYTHONUNBUFFERED"] = "1"


def run_token() -> str:
    """One token per snakemake invocation; jobs inherit it through the environment."""
    return os.environ.setdefault(RUN_TOKEN_ENV, uuid.uuid4().hex)


def record_run(run: RunSpec) -> None:
    """At the start of a run that executes jobs (onstart; never in a dry run): write the
    resolved config the jobs load and the facts for people (`core.run.write_run`)."""
    from ..core.run import write_run

    write_run(run)


def state_disk_plan(snakemake_workflow, run: RunSpec):
    """At parse time, once the tokenized table exists: the bytes the plan stores per stage
    against the free space where each stage writes (`disk_plan`), on stderr, so `snakemake -n`
    states them. Returns the plan (None before the table exists, and in a cluster job's own
    Snakemake, which has its shard to make, not a plan)."""
    from snakemake_interface_executor_plugins.settings import ExecMode

    from .disk_plan import planned_disk

    if snakemake_workflow.exec_mode != ExecMode.DEFAULT:
        return None
    try:
        plan = planned_disk(run)
    except (KeyError, ValueError, TypeError) as exc:
        # A target config the drafter's shape cannot be read from (a stand-in model, say):
        # the plan is not judged, the run goes on and each shard job checks its own room.
        print(
            f"eaglepipe {__version__}: the disk plan was not judged ({type(exc).__name__}: {exc})",
            file=sys.stderr,
            flush=True,
        )
        return None
    if plan is not None:
        print(f"eaglepipe {__version__}: {plan.text()}", file=sys.stderr, flush=True)
    return plan


def refuse_plan_that_cannot_fit(plan, run: RunSpec, snakemake_workflow) -> None:
    """At the start of a run that executes jobs (onstart), before any job: a plan whose stages
    cannot fit where they write ends the run in one line naming the stage and the directory.
    A run of targets of its own (one shard, say) needs less than the whole plan: it is warned,
    not stopped (each shard job still checks its own room)."""
    from ..core.errors import PipelineError, one_line_errors

    if plan is None:
        return
    settings = getattr(snakemake_workflow, "dag_settings", None)
    targets = set(getattr(settings, "targets", ()) or ()) | set(
        getattr(settings, "target_jobs", ()) or ()
    )
    if targets - {"all"}:
        try:
            plan.check(run)
        except PipelineError as exc:
            print(
                f"eaglepipe: warning: {exc} (running only the targets asked for)",
                file=sys.stderr,
                flush=True,
            )
        return
    with one_line_errors():
        plan.check(run)


def stop_server_started_by_this_run() -> None:
    from ..server.lifecycle.shared_server import stop_if_started_by

    stop_if_started_by(run_token())

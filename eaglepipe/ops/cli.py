"""The `eaglepipe` command line: tools for people next to the Snakemake workflow.

    eaglepipe server start|status|stop [--config PATH]
    eaglepipe status [--config PATH] [--all]
    eaglepipe verify [--config PATH] [--hidden-states DIR] [--check-only]

Each subcommand is registered by one `add_*_command(subparsers)` function listed in
`SUBCOMMANDS`; it sets `run=<function(args) -> exit code>` on its parser. A new subcommand is
one more such function and one more entry in the list.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..core.config import HIDDEN_STATES_DIR, RESOLVED_CONFIG, VALIDATED_DIR, WORKFLOW_CONFIG
from ..core.errors import PipelineError
from ..core.run import RunSpec, load_run
from ..core.space import format_bytes

EXIT_NOT_RUNNING = 3


def default_config_path() -> Path:
    """The run's resolved config if a run wrote one here, else the embedded default."""
    return RESOLVED_CONFIG if RESOLVED_CONFIG.exists() else WORKFLOW_CONFIG


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config.yaml or a resolved .json (default: .eaglepipe/config.json, else config.yaml)",
    )


def load_run_arg(args: argparse.Namespace) -> RunSpec:
    return load_run(args.config or default_config_path())


# ---------------------------------------------------------------- eaglepipe server ...


def server_start(args: argparse.Namespace) -> int:
    from ..server.lifecycle.shared_server import start_server

    handle = start_server(load_run_arg(args))
    state = handle.state
    print(f"server running: {state['url']}")
    print(f"  engine      {state['engine']} {handle.info.get('engine_version', '')}".rstrip())
    print(f"  pid         {state['pid']} (process group {state['pgid']})")
    print(f"  log         {state['log']}")
    print(f"  dump dir    {state['dump_dir']}")
    print("it stays up until `eaglepipe server stop` (pipeline runs reuse it)")
    return 0


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def server_status(args: argparse.Namespace) -> int:
    from ..server.lifecycle.shared_server import server_status as read_status

    status = read_status()
    state = status["state"]
    print(f"state dir     {status['state_dir']} ({status['starts']} start(s) recorded)")
    if state is None:
        print("no server running on this node")
        return EXIT_NOT_RUNNING
    if not status["running"]:
        print(
            f"not running: supervisor PID {state['pid']} is gone (stale state; log {state['log']})"
        )
        return EXIT_NOT_RUNNING
    health = "healthy" if status["healthy"] else f"NOT ANSWERING ({status['health']})"
    print(f"server        {state['url']}: {health}")
    print(f"  engine      {state['engine']}")
    print(
        f"  pid         {state['pid']} (process group {state['pgid']}), engine pid "
        f"{state.get('engine_pid')}"
    )
    print(f"  port        {state['port']}")
    print(f"  fingerprint {state['fingerprint']}")
    print(f"  instance    {state['instance_id']}")
    print(f"  uptime      {_duration(status['uptime_s'])} (started {state['started_at']})")
    pinned = "yes (started by hand; only `eaglepipe server stop` ends it)"
    if state.get("pinned"):
        print(f"  pinned      {pinned}")
    else:
        print(f"  started by  {state['started_by']}; stopped when {state['owner_run']} ends")
    print(f"  log         {state['log']}")
    print(f"  dump dir    {state['dump_dir']}")
    handoff = status["handoff"]
    if handoff is None:
        print("  handoff     the dump dir is gone")
    else:
        notes = handoff["failed_notes"]
        print(
            f"  handoff     {handoff['dumps']} dump(s) waiting "
            f"({format_bytes(handoff['dump_bytes'])}); {format_bytes(handoff['free_bytes'])} "
            f"free of {format_bytes(handoff['total_bytes'])}"
            + (f"; {notes} failed write(s) not yet collected" if notes else "")
        )
    leases = status["leases"]
    print(f"  leases      {len(leases)} live")
    for lease in leases:
        print(
            f"    PID {lease['pid']} {lease['kind']}, run {lease['run_token']}, "
            f"since {lease['since']}"
        )
    if not leases and not state.get("pinned"):
        print(f"  idle stop   after {state['idle_timeout_s']:g}s without a live lease")
    return 0 if status["healthy"] else 1


def server_stop(args: argparse.Namespace) -> int:
    from ..server.lifecycle.shared_server import stop_server

    started = time.monotonic()
    state = stop_server()
    if state is None:
        print("no server running on this node")
        return 0
    print(
        f"stopped {state['engine']} server (PID {state['pid']}, port {state['port']}) "
        f"in {time.monotonic() - started:.1f}s; port {state['port']} is free"
    )
    return 0


def add_server_command(subparsers) -> None:
    server = subparsers.add_parser(
        "server", help="start, inspect or stop this node's hidden-state server by hand"
    )
    actions = server.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, run, help_text in (
        ("start", server_start, "start the server (or reuse a fitting one) and leave it running"),
        ("status", server_status, "show pid, port, fingerprint, uptime, leases and health"),
        ("stop", server_stop, "stop the server's whole process group and free its port"),
    ):
        parser = actions.add_parser(name, help=help_text)
        add_config_argument(parser)
        parser.set_defaults(run=run)


# ---------------------------------------------------------------- eaglepipe status / verify


def status_command(args: argparse.Namespace) -> int:
    from .status import print_status

    return print_status(load_run_arg(args), list_all=args.all)


def add_status_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "status", help="per-shard progress, failures, totals, throughput and ETA"
    )
    add_config_argument(parser)
    parser.add_argument("--all", action="store_true", help="list every shard, not a summary")
    parser.set_defaults(run=status_command)


def _planned_shards(args: argparse.Namespace, root: Path) -> list[str] | None:
    """The run's shard plan, or None (with a note) when no config is named and there is none
    here (copied shards without their run): then every shard directory is checked. A config
    named with --config, or the one here, must load: verifying without the plan and the stages
    it names would pass data it never looked at."""
    from .status import planned_shard_names

    try:
        return planned_shard_names(load_run_arg(args))
    except PipelineError as exc:
        if args.config is not None or default_config_path().exists():
            raise
        if not any(root.glob("rows_*")):
            raise PipelineError(
                f"nothing to verify: no config here ({exc}) and no shard directory under "
                f"{root}/; run it in the pipeline's working directory, or name the config with "
                "--config and the shards with --hidden-states"
            ) from None
        print(f"note: no shard plan ({exc}): every shard directory is checked", file=sys.stderr)
        return None


# At most this many stale outputs of one kind are named; the rest are counted.
STALE_LISTED = 20


def _stale_lines(found) -> list[str]:
    """`stale: ...` lines, one per output the next run would make again, with the command."""
    from ..core.config import PREPARED_DIR, REGENERATED_DIR

    kinds = [
        (
            [f"{REGENERATED_DIR}/{shard}" for shard in found.regenerated],
            "was made under other settings or source rows than this config: "
            "`snakemake --cores N` regenerates it",
        ),
        (
            [f"{PREPARED_DIR}/"] if found.prepared else [],
            "was made from other rows or settings than this config: `snakemake --cores N` "
            "prepares it again",
        ),
        (
            [f"{HIDDEN_STATES_DIR}/{shard}" for shard in found.hidden_states],
            "was extracted from other rows or settings than this config: `snakemake --cores N` "
            "extracts it again (keeping the chunks whose rows are unchanged)",
        ),
    ]
    lines = []
    for names, why in kinds:
        lines += [f"stale: {name} {why}" for name in names[:STALE_LISTED]]
        if len(names) > STALE_LISTED:
            lines.append(f"stale: ... and {len(names) - STALE_LISTED} more like these")
    reports = sorted(found.validations.items())
    for shard, why in reports[:STALE_LISTED]:
        lines.append(
            f"stale: {VALIDATED_DIR}/{shard}.json: {why}: `snakemake --cores N` validates it again"
        )
    if len(reports) > STALE_LISTED:
        lines.append(f"stale: ... and {len(reports) - STALE_LISTED} more validation reports")
    return lines


def verify_command(args: argparse.Namespace) -> int:
    from ..plan.freshness import Staleness, staleness
    from ..validate import invalidate_damaged, verify_shards
    from ..validate.stored import StoredReport, check_stored_stages

    root = args.hidden_states or HIDDEN_STATES_DIR
    if args.hidden_states is not None and not root.is_dir():
        raise PipelineError(f"--hidden-states {root} is not a directory: nothing to verify")
    planned = _planned_shards(args, root)
    report = verify_shards(root, planned=planned, progress=True)
    stored, found = StoredReport([], []), Staleness()
    if planned is not None:
        run = load_run_arg(args)
        stored = check_stored_stages(run, planned)
        try:
            found = staleness(run, planned)
        except PipelineError as exc:
            print(f"note: what is stale was not judged ({exc})", file=sys.stderr)
        # A damaged shard is named once, as damaged: an unreadable manifest also reads as
        # stale, and its repair is the same run.
        found.hidden_states = [s for s in found.hidden_states if s not in report.damaged]
        found.validations = {s: w for s, w in found.validations.items() if s not in report.damaged}
    for problem in report.problems:
        print(f"error: {problem}")
    for damage in stored.damaged:
        print(f"error: {damage.problem}")
    for line in _stale_lines(found):
        print(line)
    for path in stored.unchecked:
        print(f"note: {path} records no checksum (written by an older version): not checked")
    for shard in report.unplanned:
        print(
            f"warning: {root / shard} is not in the current shard plan (an earlier plan's): "
            f"training never reads it; remove it with `rm -r {root / shard} "
            f"{VALIDATED_DIR / shard}.json`"
        )
    if report.damaged or stored.damaged:
        if args.check_only:
            print(
                "repair: `eaglepipe verify` (without --check-only) sets the damaged files aside "
                "(a regenerated shard's rows are restored from its journal when they can be), "
                "then `snakemake --cores N` makes only those again (a shard's intact chunks are "
                "kept)"
            )
        else:
            for shard in invalidate_damaged(report, root):
                print(f"{shard}: manifest set aside ({root / shard}/manifest.invalid.json)")
            chunks = sorted(set(report.damaged) - report.bad_manifests)
            if chunks:
                print(
                    "repair: `snakemake --cores N` re-extracts the damaged chunks of "
                    f"{', '.join(chunks)} (intact chunks are kept) and revalidates and "
                    "retrains on them"
                )
            if report.bad_manifests:
                print(
                    "repair: `snakemake --cores N` rebuilds "
                    f"{', '.join(sorted(report.bad_manifests))} from the journalled chunks "
                    "(re-extracting only a chunk that fails its checksum) and revalidates and "
                    "retrains on them"
                )
            for damage in stored.damaged:
                print(f"repair: {damage.repair()}")
    return 1 if report.problems or stored.damaged or found.any else 0


def add_verify_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="re-check every stage's stored files against their manifests and checksums (e.g. "
        "after copying the data), name what is stale for the config; damaged files are "
        "restored or set aside for the next run",
    )
    add_config_argument(parser)
    parser.add_argument(
        "--hidden-states", type=Path, default=None, help="shard root (default: hidden_states/)"
    )
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="only report; leave damaged files in place",
    )
    parser.set_defaults(run=verify_command)


SUBCOMMANDS: list[Callable] = [add_server_command, add_status_command, add_verify_command]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglepipe", description=__doc__.split("\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in SUBCOMMANDS:
        add_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`eaglepipe status | head`): not a failure. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

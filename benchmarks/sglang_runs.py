"""What the SGLang benchmarks and checks share: the server flags that ran on the H200, the
options every one takes (a dry run for a given release, the reference engine on CPU), the
launcher's commands built without a server, the extraction benchmark's pipeline config,
stopping a server's process group, and reading SGLang's log."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from benchmarks.common import REPO_ROOT, free_port
from benchmarks.stores import STORE_VARIANTS


def planned_sglang_commands(config: dict, sglang_version: str) -> dict:
    """The launcher's SGLang commands for a validated config, without starting anything: the
    capture server's (extraction) and the generation server's (regeneration, live)."""
    from eaglepipe.core.run import resolve
    from eaglepipe.server.sglang.recipe import launch_command

    common = dict(
        host="127.0.0.1", port=config["server"]["port"],
        dump_dir=Path(config["server"]["dump_root"]) / "x", instance_id="dry-run",
        sglang_version=sglang_version,
    )  # fmt: skip
    return {
        "capture": launch_command(resolve(config), **common)[0],
        "generation": launch_command(resolve(config), capture=False, **common)[0],
    }


def add_engine_options(parser, reference_help: str) -> None:
    """The options every SGLang benchmark takes: a dry run that builds the commands for a
    given release without a server, and the reference engine on CPU to check the script."""
    parser.add_argument("--dry-run", action="store_true", help="tiny model, commands, no server")
    parser.add_argument(
        "--sglang-version", default=None, help="with --dry-run: the release to build argv for"
    )
    parser.add_argument(
        "--engine", choices=["sglang", "reference"], default="sglang", help=reference_help
    )


# The server flags that ran live on the H200 with SGLang 0.5.14 (../shared/sglang-h200):
# triton attention (no FA3 or flashinfer kernels), torch sampling, no grammar backend.
SGLANG_EXTRA_ARGS = [
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
]


_PREFILL_LINE = re.compile(
    r"Prefill batch[^\n]*?#new-seq: (\d+), #new-token: (\d+)"
    r"(?:[^\n]*?input throughput \(token/s\): ([0-9.]+))?"
)


_LOG_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]")


def prefill_batches(log_text: str) -> list[dict]:
    """SGLang's "Prefill batch" log lines: requests, tokens, (when logged) the input
    throughput SGLang measured for each prefill, and when (`at`: epoch seconds of the line's
    local-time stamp, to the second; None without one)."""
    batches = []
    for line in log_text.splitlines():
        batch = _PREFILL_LINE.search(line)
        if batch is None:
            continue
        stamp = _LOG_STAMP.match(line)
        batches.append({
            "seqs": int(batch.group(1)),
            "tokens": int(batch.group(2)),
            "tokens_per_s": float(batch.group(3)) if batch.group(3) else None,
            "at": datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            if stamp else None,
        })  # fmt: skip
    return batches


def log_between(path: Path, start: int, end: int | None = None) -> str:
    """A log file's text between two byte offsets (st_size readings taken during the run)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read() if end is None else f.read(max(0, end - start))
    return data.decode(errors="replace")


def shm_free_gb() -> float:
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return 0.0
    return shutil.disk_usage(shm).free / 1e9


def max_inflight_bytes(gb: str) -> int | None:
    """extract.max_inflight_bytes for an `--inflight-gb` value (None: the pipeline's default);
    ValueError for anything but `auto` or a positive number."""
    if gb == "auto":
        return None
    if not 0 < float(gb) < float("inf"):  # NaN fails too
        raise ValueError(gb)
    return int(float(gb) * 2**30)


def pipeline_config(
    run_dir: Path, model_dir: Path, dataset: Path, rows_per_shard: int, args
) -> dict:
    from eaglepipe.core.config import validate_config
    from eaglepipe.core.config_files import load_config

    dump_parent = "/dev/shm" if shm_free_gb() > 8 else str(run_dir)
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["dataset"]["path"] = str(dataset)
    config["shards"].update(
        rows_per_shard=rows_per_shard, chunk_max_bytes=max(4096, int(args.chunk_mb * 2**20))
    )
    config["server"].update(
        engine=args.engine,
        dtype="bfloat16" if args.engine == "sglang" else "float32",
        device="auto" if args.engine == "sglang" else "cpu",
        port=free_port(),
        dump_root=tempfile.mkdtemp(prefix="eaglepipe-bench-sglang-dumps-", dir=dump_parent),
        health_timeout_s=int(args.health_s),
        idle_timeout_s=900,
        sglang={
            "tp_size": 1,
            "mem_fraction_static": args.mem_fraction_static,
            "extra_args": list(SGLANG_EXTRA_ARGS),
        },
    )
    # Bounded per job (by default) so that the jobs' dumps, the chunks and the model fit on
    # /dev/shm; each variant sets its own.
    config["extract"].update(
        max_inflight_requests=args.inflight_requests,
        max_inflight_bytes=max_inflight_bytes(args.inflight_gb_variants[0]),
        chunk_writeback_mb=args.writeback_variants[0],
        # The extraction benchmark compares stores; the SpecForge study extracts bf16.
        store=STORE_VARIANTS[getattr(args, "store_variants", ["bf16"])[0]],
    )
    return validate_config(config)


def bare_command(
    config: dict, sglang_version: str | None = None, *, capture: bool = False
) -> tuple[list[str], dict]:
    """The launcher's command without the hook and the capture; every other flag the same.
    With `capture`, only without the hook: SGLang computes the aux hidden states and nothing
    takes them (what the capture alone costs a prefill)."""
    from eaglepipe.core.run import resolve
    from eaglepipe.server.sglang.plugin import CAPTURE_ENV
    from eaglepipe.server.sglang.recipe import launch_command

    argv, env = launch_command(
        resolve(config), host=config["server"]["host"], port=config["server"]["port"],
        dump_dir=Path(config["server"]["dump_root"]) / "bare", instance_id="bare",
        sglang_version=sglang_version,
    )  # fmt: skip
    if capture:
        hook_at = argv.index("--forward-hooks")
        return argv[:hook_at] + argv[hook_at + 2 :], env
    bare, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token in ("--forward-hooks", "--speculative-algorithm"):
            i += 2
        elif token == "--enable-return-aux-hidden-states":
            i += 1
        elif token == "--return-aux-hidden-state-layer-ids":
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
        else:
            bare.append(token)
            i += 1
    return bare, {**env, CAPTURE_ENV: ""}


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as response:
            return response.status == 200
    except OSError:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's whole process group (its schedulers too), SIGKILL what is left;
    return once none of it runs, so the GPU memory is free for the next server."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 15.0)):
        if not group_alive(proc.pid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, so the group can empty
            if not group_alive(proc.pid):
                break
            time.sleep(0.2)
    proc.poll()


def tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return []

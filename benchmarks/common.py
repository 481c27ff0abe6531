"""Shared pieces of the benchmarks: machine details, timing, result files.

Every benchmark records the machine it ran on next to its numbers (GPU name and driver, torch
and transformers versions, CPU count), times on the device's clock (a CUDA synchronise before
each reading), and writes its results as JSON plus a markdown table, atomically, so a killed
run never leaves a result file that looks complete.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from eaglepipe.core.atomic import atomic_write_bytes, atomic_write_json  # noqa: E402

# Keys real DeepSeek-V3 config.json files carry that transformers' DeepseekV3Config does not
# save; SGLang 0.5.14 (and 0.5.18) reads moe_layer_freq and topk_method without a default.
SGLANG_DEEPSEEK_KEYS = {
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "ep_size": 1,
}


def add_sglang_deepseek_keys(model_dir: Path) -> dict:
    """Write SGLANG_DEEPSEEK_KEYS into a saved DeepSeek-V3 checkpoint's config.json (those it
    lacks); returns the config as saved."""
    config_path = Path(model_dir) / "config.json"
    saved = json.loads(config_path.read_text())
    saved.update({k: v for k, v in SGLANG_DEEPSEEK_KEYS.items() if k not in saved})
    atomic_write_json(config_path, saved)
    return saved


def log(message: str) -> None:
    print(message, flush=True)


def _installed_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        out = subprocess.run(
            [tool, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def machine_info(device: torch.device | str | None = None) -> dict:
    """What the numbers were measured on."""
    import transformers

    device = torch.device(device) if device is not None else None
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "cuda_available": torch.cuda.is_available(),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        index = device.index if device is not None and device.index is not None else 0
        props = torch.cuda.get_device_properties(index)
        info.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            driver=_nvidia_driver(),
            triton=_installed_version("triton"),
        )
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device | None = None) -> Iterator[dict]:
    """`with timed(device) as t: ...` then `t["seconds"]`; the device is synchronised at both ends
    so queued kernels are counted where they belong."""
    if device is not None:
        sync(device)
    result: dict = {}
    start = time.perf_counter()
    try:
        yield result
    finally:
        if device is not None:
            sync(device)
        result["seconds"] = time.perf_counter() - start


def rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else float("nan")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


def command_line() -> str:
    """The command that produced a result, as it could be typed again."""
    return shlex.join([Path(sys.executable).name, "-u", *sys.argv])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.0f}"
        return "" if value is None else str(value)

    lines = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def machine_line(machine: dict) -> str:
    where = machine.get("gpu") or f"CPU ({machine.get('cpu')})"
    driver = f", driver {machine['driver']}" if machine.get("driver") else ""
    return (
        f"{where}{driver}, {machine['cpu_count']} CPUs, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, Python {machine['python']}"
    )


def write_results(json_path: str | os.PathLike | None, results: dict, markdown: str = "") -> None:
    """Write the JSON results (and the markdown beside them, `.md`) atomically."""
    if json_path is None:
        return
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(json_path, results)
    if markdown:
        atomic_write_bytes(json_path.with_suffix(".md"), markdown.encode())
    log(f"results: {json_path}" + (f" and {json_path.with_suffix('.md')}" if markdown else ""))


def random_model_on(config, device, dtype):
    """A random-weight causal LM made directly on `device` in `dtype` (no download, no copy)."""
    import torch
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def random_llama(
    device,
    dtype,
    *,
    seed: int,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_pos: int,
):
    """A random-weight Llama of the given shape, made on `device` (see `random_model_on`)."""
    import torch
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return random_model_on(config, device, dtype)


# ----------------------------------------------------------------------------- extraction runs


def seeded_rows(tokens: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[np.ndarray]:
    """Seeded rows of uniform length in [min_len, max_len] until `tokens` is reached."""
    rng = np.random.default_rng(seed)
    rows, total = [], 0
    while total < tokens:
        n = int(rng.integers(min_len, max_len + 1))
        rows.append(rng.integers(0, vocab, n, dtype=np.int64).astype(np.int32))
        total += n
    return rows


def train_table_bytes(rows, *, rows_per_shard: int, loss_masks=None) -> bytes:
    """The prepared table's bytes for `rows` (token id arrays; all train, none truncated) as
    prepare writes it: one row group per shard of `rows_per_shard` rows, so a shard job reads
    only its own rows. The loss masks are all ones unless given (one per row)."""
    from eaglepipe.prepare.table import prepared_table_bytes

    masks = [
        np.ones(len(ids), np.uint8) if loss_masks is None else np.asarray(loss_masks[i], np.uint8)
        for i, ids in enumerate(rows)
    ]
    return prepared_table_bytes(
        list(range(len(rows))),
        ["train"] * len(rows),
        [np.asarray(ids, np.int32) for ids in rows],
        masks,
        [False] * len(rows),
        [()] * len(rows),
        rows_per_shard,
    )


def write_prepared(
    run_dir: Path, rows, *, rows_per_shard: int, loss_masks=None, records=None
) -> Path:
    """A run directory's dataset and prepared table for `rows` as the pipeline sees them
    (conversations.jsonl, prepared/tokenized.parquet as `train_table_bytes` writes it,
    prepared/summary.json); returns the dataset path (the shard plan counts its rows).
    `records` are the dataset's JSON objects, one per row (default: a two-turn ShareGPT
    conversation each)."""
    prepared = run_dir / "prepared"
    prepared.mkdir(parents=True)
    dataset = run_dir / "conversations.jsonl"
    if records is None:
        records = [
            {"conversations": [{"from": "human", "value": f"row {i}"},
                               {"from": "gpt", "value": "ok"}]}
            for i in range(len(rows))
        ]  # fmt: skip
    with open(dataset, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    table = train_table_bytes(rows, rows_per_shard=rows_per_shard, loss_masks=loss_masks)
    (prepared / "tokenized.parquet").write_bytes(table)
    provenance = {"dataset_hash": "bench", "tokenizer_fingerprint": "bench"}
    (prepared / "summary.json").write_text(json.dumps({"rows": len(rows), **provenance}))
    return dataset


def free_port() -> int:
    """A free local port that SGLang accepts too (its gRPC port, +10000, must exist)."""
    from eaglepipe.server.sglang import free_server_port

    return free_server_port("127.0.0.1")


@contextmanager
def working_directory(path: Path):
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def shard_jobs_in_parallel(
    run_dir: Path,
    config: dict,
    names: list[str],
    jobs: int,
    *,
    stage: str = "extract",
    finish=None,
) -> list[dict]:
    """Each shard as its own `scripts/<stage>.py` process, `jobs` at a time (Snakemake's way);
    their manifests, each with the job's whole wall time. Extracted shards are removed once
    read (the disk holds only the shards in progress); regenerated ones are small and kept.

    `finish(shard_dir, manifest)`, if given, takes over an extracted shard once its job has
    exited, in one thread of its own (so the next job starts at once): what a user does when
    moving a finished shard to bulk storage (see `verify_and_delete`). All finish before this
    returns; the first error of one is raised."""
    from eaglepipe.core.config import write_resolved

    resolved = write_resolved(config, run_dir / ".eaglepipe" / "config.json")
    outputs = {"extract": "hidden_states", "regenerate": "regenerated"}[stage]
    finishing = ThreadPoolExecutor(1) if finish is not None else None
    pending = []

    def one(name: str) -> dict:
        argv = [sys.executable, "-u", str(REPO_ROOT / "scripts" / f"{stage}.py")]
        argv += ["--config", str(resolved), "--shard", name]
        started = time.perf_counter()
        born = time.time()
        done = subprocess.run(argv, cwd=run_dir, capture_output=True, text=True)
        ended = time.time()
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
        shard_dir = run_dir / outputs / name
        manifest = json.loads((shard_dir / "manifest.json").read_text())
        # The job's whole life (interpreter start, imports, lease) beside the manifest's timing.
        manifest["job_wall_s"] = round(time.perf_counter() - started, 3)
        # Wall-clock life of the job's process, to line up with the server's log and the GPU.
        manifest["job_window"] = [born, ended]
        if stage == "extract":
            if finishing is None:
                shutil.rmtree(shard_dir)
            else:
                pending.append(finishing.submit(finish, shard_dir, manifest))
        return manifest

    try:
        with ThreadPoolExecutor(jobs) as pool:
            manifests = list(pool.map(one, names))
    finally:
        if finishing is not None:
            finishing.shutdown(wait=True)
    for future in pending:
        future.result()
    return manifests


JOB_START_STEPS = ("entered_s", "lease_asked_s", "leased_s", "first_request_s", "lease_via")


def first_request_summary(manifests: list[dict]) -> dict | None:
    """The jobs' start-up, from their manifests (`timing.first_request_s`: process start to
    first request): sum, median and max over the shards, None where none records it; with the
    medians of its steps where the manifests record them (extraction: `entered_s`, the
    library's code entered after interpreter and imports; `lease_asked_s`, the shard's rows
    read and its chunks planned; `leased_s`, the server's lease held) and how many leases had
    the server's info each way (`lease_via`: started it, another job's answer note, asked);
    `jobs`: each job's own steps, in the order given."""
    timings = [m.get("timing", {}) for m in manifests]
    values = sorted(t["first_request_s"] for t in timings if t.get("first_request_s") is not None)
    if not values:
        return None
    summary = {
        "shards": len(values),
        "sum_s": round(sum(values), 3),
        "median_s": values[len(values) // 2],
        "max_s": values[-1],
    }
    for step in ("entered_s", "lease_asked_s", "leased_s"):
        steps = sorted(t[step] for t in timings if t.get(step) is not None)
        if steps:
            summary[f"{step[:-2]}_median_s"] = steps[len(steps) // 2]
    via = Counter(t["lease_via"] for t in timings if t.get("lease_via"))
    if via:
        summary["lease_via"] = dict(sorted(via.items()))
    # Each job's own steps, in the order given (the plan's): a first wave that starts together
    # and a job that starts beside running ones can differ, which medians hide.
    births = [m["job_window"][0] for m in manifests if m.get("job_window")]
    summary["jobs"] = []
    for manifest, timing in zip(manifests, timings, strict=True):
        if timing.get("first_request_s") is None:
            continue
        job = {"shard": manifest.get("shard")}
        if manifest.get("job_window"):  # its process start after the first job's
            job["started_s"] = round(manifest["job_window"][0] - min(births), 3)
        job.update({k: timing[k] for k in JOB_START_STEPS if timing.get(k) is not None})
        summary["jobs"].append(job)
    return summary


def verify_and_delete(shard_dir: Path, manifest: dict) -> dict:
    """The validation stage's integrity check of a finished shard (every chunk present with its
    size, re-hashed against the manifest, none unlisted), then the shard deleted: a benchmark
    that writes more than the storage holds keeps only the shards in progress. Returns what was
    checked; raises on a failed check (the shard is kept for a look)."""
    from eaglepipe.validate.integrity import (
        check_chunk_checksum,
        check_chunk_file,
        check_no_stray_chunks,
        read_manifest,
    )

    started = time.perf_counter()
    shard = manifest["shard"]
    listed = read_manifest(shard_dir, shard)
    for entry in listed["chunks"]:
        check_chunk_file(shard_dir, shard, entry)
        check_chunk_checksum(shard_dir, shard, entry)
    check_no_stray_chunks(shard_dir, shard, listed)
    shutil.rmtree(shard_dir)
    manifest["verified"] = {
        "chunks": len(listed["chunks"]),
        "bytes": listed["num_bytes"],
        "seconds": round(time.perf_counter() - started, 3),
    }
    return manifest["verified"]


class GpuUtilisation:
    """Samples `nvidia-smi` GPU utilisation every 200 ms while in use (mean and samples; each
    sample's wall-clock time in `points`)."""

    def __init__(self):
        self.samples: list[int] = []
        self.points: list[tuple[float, int]] = []
        self._proc = None

    def __enter__(self) -> GpuUtilisation:
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu",
                 "--format=csv,noheader,nounits", "-lms", "200", "-i", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        self.points = [p for p in map(_gpu_sample, out.splitlines()) if p is not None]
        self.samples = [util for _, util in self.points]

    def summary(self) -> dict:
        if not self.samples:
            return {}
        return {
            "gpu_util_mean_pct": round(sum(self.samples) / len(self.samples), 1),
            "gpu_util_samples": len(self.samples),
        }


def _gpu_sample(line: str) -> tuple[float, int] | None:
    """One `timestamp, utilization.gpu` line of nvidia-smi (local time) as (epoch s, percent)."""
    stamp, _, util = line.rpartition(",")
    if not util.strip().isdigit():
        return None
    try:
        when = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None
    return when, int(util)


BREAKDOWN_KEYS = (
    "budget_wait_s",
    "bytes_wait_s",
    "dump_wait_s",
    "read_dump_s",
    "lookahead_wait_s",
    "chunk_write_s",
)


def chunk_storage(run_dir: Path, storage: str) -> Path | None:
    """Point run_dir/hidden_states at the storage under test; returns a dir to remove after."""
    target = run_dir / "hidden_states"
    if target.is_symlink():
        target.unlink()
    else:
        shutil.rmtree(target, ignore_errors=True)
    if storage == "disk":
        return None
    if storage != "shm":
        raise ValueError(f"storage {storage!r}: choose disk or shm")
    shm_dir = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-chunks-", dir="/dev/shm"))
    target.symlink_to(shm_dir)
    return shm_dir


# ----------------------------------------------------------------------------- SGLang runs


def planned_sglang_commands(config: dict, sglang_version: str) -> dict:
    """The launcher's SGLang commands for a validated config, without starting anything: the
    capture server's (extraction) and the generation server's (regeneration, live)."""
    from eaglepipe.core.run import resolve
    from eaglepipe.server.sglang import launch_command

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


def prefill_timeline(log_text: str) -> list[tuple[float, int]]:
    """(epoch second, tokens) of each prefill batch whose log line carries a timestamp."""
    return [(b["at"], b["tokens"]) for b in prefill_batches(log_text) if b["at"] is not None]


def split_by_jobs_alive(
    windows: Sequence[Sequence[float]],
    gpu_points: Sequence[tuple[float, int]],
    prefill_points: Sequence[tuple[float, int]],
) -> dict:
    """A run's whole seconds grouped by how many shard-job processes were alive at mid-second:
    per group the seconds, the tokens the server prefilled in them (from its log, to the
    second) and the mean GPU utilisation. It separates the steady state (every job slot busy)
    from the start-up, turnover and tail of the run."""
    if not windows:
        return {}
    first = int(min(start for start, _ in windows))
    last = int(max(end for _, end in windows))
    groups: dict[int, dict] = {}
    second_group: dict[int, dict] = {}
    for second in range(first, last + 1):
        alive = sum(1 for start, end in windows if start <= second + 0.5 < end)
        group = groups.setdefault(alive, {"seconds": 0, "prefill_tokens": 0, "util": []})
        group["seconds"] += 1
        second_group[second] = group
    for when, tokens in prefill_points:
        if int(when) in second_group:
            second_group[int(when)]["prefill_tokens"] += tokens
    for when, util in gpu_points:
        if int(when) in second_group:
            second_group[int(when)]["util"].append(util)
    return {
        str(alive): {
            "seconds": g["seconds"],
            "prefill_tokens": g["prefill_tokens"],
            "prefill_tokens_per_s": round(g["prefill_tokens"] / g["seconds"], 1),
            "gpu_util_mean_pct": round(sum(g["util"]) / len(g["util"]), 1) if g["util"] else None,
        }
        for alive, g in sorted(groups.items(), reverse=True)
    }


def log_between(path: Path, start: int, end: int | None = None) -> str:
    """A log file's text between two byte offsets (st_size readings taken during the run)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read() if end is None else f.read(max(0, end - start))
    return data.decode(errors="replace")


# ----------------------------------------------------------------------------- FP8 stores

# The stores the benchmarks compare side by side (`--store-dtypes bf16,fp8,fp8aux`):
# extract.store values (eaglepipe/core/hidden_store.py).
STORE_VARIANTS = {
    "bf16": {"aux": "bf16", "final": "bf16"},
    "fp8": {"aux": "fp8_e4m3", "final": "fp8_e4m3"},
    "fp8aux": {"aux": "fp8_e4m3", "final": "bf16"},
}
# (hidden size, aux layers) of the shapes whose bytes per token the issue asks for.
BYTE_SHAPES = {"8b": (4096, 3), "kimi_k2.5": (7168, 3)}


def store_variants(parser, option: str, value: str) -> list[str]:
    """The names of a `--store-dtypes` comma list, checked."""
    names = [v.strip() for v in str(value).split(",") if v.strip()]
    unknown = [n for n in names if n not in STORE_VARIANTS]
    if not names or unknown:
        parser.error(f"{option}: a comma list of {', '.join(STORE_VARIANTS)}, got {value!r}")
    return names


def bytes_per_token(names: Sequence[str]) -> dict:
    """Chunk bytes per token of each store at the 8B shape and Kimi-K2.5's (the chunk file's
    own byte function), and each one's ratio to bf16."""
    from eaglepipe.core.hidden_store import HiddenStore
    from eaglepipe.extract.chunk_file import token_bytes

    table = {}
    for name in names:
        store = HiddenStore(**STORE_VARIANTS[name])
        table[name] = {}
        for shape, (hidden, aux) in BYTE_SHAPES.items():
            per_token = token_bytes(hidden, aux, store)
            table[name][shape] = {
                "bytes_per_token": per_token,
                "vs_bf16": round(per_token / token_bytes(hidden, aux), 4),
            }
    return table


def bytes_per_token_lines(table: dict) -> list[str]:
    return [
        f"bytes per token, {name}: "
        + ", ".join(
            f"{shape} {v['bytes_per_token']:,} ({v['vs_bf16']}x bf16)" for shape, v in row.items()
        )
        for name, row in table.items()
    ]


# ----------------------------------------------------------------------------- whole runs

SNAKEMAKE = [sys.executable, "-m", "snakemake"]  # also where snakemake has no script on PATH


def workflow_env() -> dict:
    env = dict(os.environ)
    env.pop("EAGLEPIPE_RUN_TOKEN", None)  # each run is its own (it stops its own server)
    return env


def run_workflow(
    run_dir: Path, cores: int, log_path: Path, *extra: str, timeout_s: float | None = None
) -> float:
    """One snakemake run in `run_dir` (its config.yaml) to the end; past `timeout_s` it is
    stopped as Ctrl-C stops it (its jobs end, its lock goes), so the next call with the same
    directory resumes it. Returns its seconds."""
    argv = [
        *SNAKEMAKE,
        "--snakefile",
        str(REPO_ROOT / "Snakefile"),
        "--directory",
        str(run_dir),
        "--configfile",
        str(run_dir / "config.yaml"),
        "--cores",
        str(cores),
        "--rerun-incomplete",
        *extra,
    ]
    started = time.monotonic()
    with open(log_path, "a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=workflow_env())
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise SystemExit(
                f"snakemake in {run_dir} stopped after {timeout_s:.0f}s (--deadline-s); "
                f"rerun with the same --work-root to resume; log: {log_path}"
            ) from None
    if proc.returncode != 0:
        raise SystemExit(f"snakemake failed in {run_dir}; log: {log_path}")
    return time.monotonic() - started

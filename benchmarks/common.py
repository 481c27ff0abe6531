"""What every benchmark shares: machine details, timing, result files, a free port.

Every benchmark records the machine it ran on next to its numbers (GPU name and driver, torch
and transformers versions, CPU count), times on the device's clock (a CUDA synchronise before
each reading), and writes its results as JSON plus a markdown table, atomically, so a killed
run never leaves a result file that looks complete.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

from eaglepipe.core.atomic import atomic_write_bytes, atomic_write_json  # noqa: E402


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


# ----------------------------------------------------------------------------- extraction runs


def free_port() -> int:
    """A free local port that SGLang accepts too (its gRPC port, +10000, must exist)."""
    from eaglepipe.server.sglang.recipe import free_server_port

    return free_server_port("127.0.0.1")


@contextmanager
def working_directory(path: Path):
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


# ----------------------------------------------------------------------------- SGLang runs

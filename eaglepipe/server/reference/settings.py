"""The reference engine's device, dtype and batch layout resolved by name, and its version.

Kept apart from `engine.py`, which imports torch: a shard job computes the engine's identity
(`lifecycle.identity.engine_identity`) before its first request, and on `server.device: cpu`
nothing in it needs torch or transformers, whose imports take seconds. `auto` and `cuda` ask
torch whether CUDA is there, as the server itself does (`resolve_device`, torch imported there).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ... import __version__
from ...core.atomic import atomic_write_json
from ...core.errors import PipelineError
from ...core.fingerprint import hash_json
from ...core.user_cache import user_cache_dir

if TYPE_CHECKING:
    import torch

ATTENTION_LAYOUTS = ("auto", "packed", "padded")
DTYPE_NAMES = ("bfloat16", "float16", "float32")


# Device nodes of the drivers through which torch can see a GPU (NVIDIA, AMD's ROCm, WSL).
# Without any of them torch.cuda.is_available() is False, and `auto` is the CPU.
ACCELERATOR_NODES = (
    "/dev/nvidiactl",
    "/dev/nvidia0",
    "/proc/driver/nvidia",
    "/dev/kfd",
    "/dev/dxg",
)


def accelerator_driver_present() -> bool:
    return any(os.path.exists(node) for node in ACCELERATOR_NODES)


def resolve_device(name: str) -> torch.device:
    """The torch device the server runs on: `auto` is CUDA where torch sees it, else the CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise PipelineError(f"--device {name!r} is not a torch device (auto, cpu, cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PipelineError(
            f"server.device {name} (the server's --device): CUDA is not available on this "
            "machine (no GPU, or a CPU build of torch): use auto or cpu"
        )
    return device


def resolve_device_type(name: str) -> str:
    """The device type (`cpu`, `cuda`) `resolve_device(name)` gives. `auto` answers without
    importing torch (seconds per job) on a machine with no GPU driver, and elsewhere from
    torch's answer kept for this boot of this machine (`cuda_answer_cached`)."""
    if name == "cpu" or (name == "auto" and not accelerator_driver_present()):
        return "cpu"
    if name == "auto":
        return "cuda" if cuda_answer_cached() else "cpu"
    return resolve_device(name).type


def _answer_key() -> str:
    """What torch's CUDA answer depends on: the machine and its boot, the devices made visible,
    and the interpreter with its torch."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "unknown"
    visible = [os.environ.get(v) for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                           "ROCR_VISIBLE_DEVICES")]  # fmt: skip
    return hash_json([socket.gethostname(), boot, *visible, sys.executable, torch_version])


def _kept_answer(path: Path) -> bool | None:
    try:
        return bool(json.loads(path.read_text())["cuda_available"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none kept yet, or a damaged file: torch is asked again


def cuda_answer_cached() -> bool:
    """torch.cuda.is_available(), asked once per key (`_answer_key`) and kept in the user's
    cache: the server asks torch itself, and both answers agree while the key does."""
    path = user_cache_dir("devices", f"{_answer_key()}.json")
    kept = _kept_answer(path)
    if kept is not None:
        return kept
    import torch

    available = bool(torch.cuda.is_available())
    with contextlib.suppress(OSError):  # only a saving: the next job asks torch again
        atomic_write_json(path, {"cuda_available": available})
    return available


def resolve_dtype_name(name: str, device_type: str) -> str:
    """`auto` is bf16 on a GPU and fp32 on CPU."""
    if name == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    if name not in DTYPE_NAMES:
        raise PipelineError(f"--dtype {name!r}: choose auto, {', '.join(DTYPE_NAMES)}")
    return name


def flex_attention_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_layout(layout: str, device_type: str) -> str:
    """The batch layout: `auto` packs rows on CUDA with flex_attention, pads them elsewhere."""
    if layout not in ATTENTION_LAYOUTS:
        raise PipelineError(f"--attention {layout!r}: choose {', '.join(ATTENTION_LAYOUTS)}")
    if layout == "auto":
        return "packed" if device_type == "cuda" and flex_attention_available() else "padded"
    return layout


def engine_version() -> str:
    """The project's version and the transformers release that runs the model, read from the
    installed distribution (importing transformers takes seconds)."""
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        import transformers  # on the path without distribution metadata

        transformers_version = transformers.__version__
    return f"{__version__}+transformers-{transformers_version}"

"""SGLang wheels' source trees, for contract tests that read them (never import them).

The supported range's ends (patch/sglang.toml: oldest and newest) are each downloaded once with
pip (no dependencies, the CPython 3.11 manylinux build, whatever Python runs the tests) into a
cache directory, `$EAGLEPIPE_WHEEL_CACHE` or `~/.cache/eaglepipe/wheels`, and their Python files
are extracted beside them. Tests skip only when PyPI cannot be reached at all; any other failure
is an error.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock

REPO_ROOT = Path(__file__).resolve().parent.parent
RANGE_FILE = REPO_ROOT / "patch" / "sglang.toml"
PYPI_HOST = "pypi.org"


def supported() -> dict:
    """patch/sglang.toml: oldest, newest, recommended."""
    return tomllib.loads(RANGE_FILE.read_text())


def range_ends() -> list[str]:
    """The releases every contract test runs against."""
    data = supported()
    return [data["oldest"], data["newest"]]


def cache_dir() -> Path:
    configured = os.environ.get("EAGLEPIPE_WHEEL_CACHE")
    base = Path(configured) if configured else Path.home() / ".cache" / "eaglepipe" / "wheels"
    base.mkdir(parents=True, exist_ok=True)
    return base


def _pypi_reachable() -> bool:
    try:
        with socket.create_connection((PYPI_HOST, 443), timeout=10):
            return True
    except OSError:
        return False


def _download_wheel(version: str, into: Path) -> Path:
    found = sorted(into.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(dir=into) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps",
            "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
            "--platform", "manylinux_2_34_x86_64", "--disable-pip-version-check", "-q",
            "-d", tmp,
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob(f"sglang-{version}-*.whl"))
        if result.returncode != 0 or not wheels:
            if not _pypi_reachable():
                pytest.skip(f"PyPI ({PYPI_HOST}) is unreachable: cannot fetch sglang=={version}")
            raise RuntimeError(
                f"pip download sglang=={version} failed:\n{result.stdout}\n{result.stderr}"
            )
        target = into / wheels[0].name
        os.replace(wheels[0], target)
        return target


def sglang_source_root(version: str) -> Path:
    """The extracted `sglang` package directory of that release's wheel (Python files only)."""
    base = cache_dir()
    extracted = base / f"sglang-{version}-src"
    with FileLock(str(base / f"sglang-{version}.lock")):
        if not (extracted / "sglang" / "srt").is_dir():
            wheel = _download_wheel(version, base)
            staging = Path(tempfile.mkdtemp(dir=base, prefix=".extract-"))
            try:
                with zipfile.ZipFile(wheel) as archive:
                    members = [n for n in archive.namelist() if n.endswith(".py")]
                    members += [n for n in archive.namelist() if n.endswith("METADATA")]
                    archive.extractall(staging, members=members)
                shutil.rmtree(extracted, ignore_errors=True)
                os.replace(staging, extracted)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return extracted / "sglang"


def wheel_metadata_version(version: str) -> str:
    """The Version field of the extracted wheel's METADATA."""
    root = sglang_source_root(version).parent
    for meta in root.glob("sglang-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    raise RuntimeError(f"no METADATA with a Version under {root}")

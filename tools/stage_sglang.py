#!/usr/bin/env python3
"""Stage the wheels that run the pipeline with SGLang on the lent H200 machine.

    .venv/bin/python tools/stage_sglang.py    # into .whl-sglang/ (ignored by git), ~1 minute

Downloads every wheel of tools/h200_wheels.txt with pip (no dependencies, CPython 3.12,
manylinux x86_64: the H200 machine's Python), repacks the three marked `repack` without the
parts the runs never load, builds the project's own wheel (its `sglang.srt.plugins` entry point
is what SGLang's plugin loader finds there), and writes them to DEST/common/ and DEST/server/
with DEST/manifest.json. It then adds up what one device call carries (the repository's tracked
files, DEST and the JIT cache in .jit-sglang/ when present) and fails when that is over
--limit-mib: the device machine takes at most 64 MiB per call. tools/h200.sh installs DEST there.

Downloads are cached in --cache (default ~/.cache/eaglepipe/h200-wheels), so a second run only
repacks.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WHEEL_LIST = REPO_ROOT / "tools" / "h200_wheels.txt"
DEFAULT_DEST = REPO_ROOT / ".whl-sglang"
JIT_CACHE_DIR = REPO_ROOT / ".jit-sglang"
SITES = ("common", "server", "pipeline")
MIB = 1 << 20
CALL_LIMIT_MIB = 64  # what one device call carries at most, the repository included

# What each repacked wheel leaves out (regular expressions on archive member names).
REPACK_DROP = {
    # FA3 (1.76 GB), the Blackwell ops and FlashMLA: the runs use --attention-backend triton.
    "sglang-kernel": [
        r"^sgl_kernel/flash_ops\.abi3\.so$",
        r"^sgl_kernel/sm100/",
        r"^sgl_kernel/flashmla_ops\.abi3\.so$",
    ],
    # The JIT sources (cutlass, cccl, csrc; 74 MB). Without them flashinfer's JIT kernels cannot
    # build: tools/h200.sh sets EAGLEPIPE_SGLANG_SLIM_FLASHINFER=1, and the eaglepipe SGLang
    # plugin routes norm and DeepSeek top-k to sgl_kernel's precompiled kernels.
    "flashinfer-python": [r"^flashinfer/data/"],
    # Diffusion, SGLang's own tests and the gRPC core.
    "sglang": [r"^sglang/multimodal_gen/", r"^sglang/test/", r"^sglang/srt/grpc/_core\..*\.so$"],
    # Every model's files but the ones the pipeline's processes and the benchmarks load there
    # (Llama targets and drafters, the DeepSeek-V3 and Kimi-K2.5 fidelity references; the
    # encoder-decoder config the auto classes import): 12 -> 3 MiB. Each model's __init__.py
    # and tokenizer stay: transformers imports them while it loads any tokenizer.
    "transformers": [
        r"^transformers/models/(?!(auto|llama|deepseek_v2|deepseek_v3|kimi_k25|encoder_decoder)/)"
        r"[^/]+/(?!(__init__|tokenization_[^/]*)\.py$)[^/]+$"
    ],
    # SQLAlchemy's optional Cython speed-ups (it falls back to pure Python): Snakemake's
    # bookkeeping only.
    "sqlalchemy": [r"^sqlalchemy/cyextension/.*\.so$"],
}

PLATFORM_ARGS = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
    "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_24_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
    "--platform", "manylinux1_x86_64",
]  # fmt: skip


@dataclass(frozen=True)
class WheelSpec:
    name: str
    version: str
    site: str
    repack: bool = False
    # Published as a source distribution only: built here into a pure-Python wheel.
    build: bool = False

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_wheel_list(path: Path = WHEEL_LIST) -> list[WheelSpec]:
    """The list's entries; a malformed line is an error naming its line number."""
    specs: list[WheelSpec] = []
    seen: set[tuple[str, str]] = set()
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)", parts[0])
        if not match or len(parts) not in (2, 3) or parts[1] not in SITES:
            raise ValueError(
                f"{path}:{number}: expected 'NAME==VERSION SITE [repack|build]': {raw!r}"
            )
        flag = parts[2] if len(parts) == 3 else None
        if flag not in (None, "repack", "build"):
            raise ValueError(f"{path}:{number}: unknown flag {flag!r} (repack or build)")
        name = canonical(match.group(1))
        # One version per site: transformers has one for the server and one for the pipeline.
        if (name, parts[1]) in seen:
            raise ValueError(f"{path}:{number}: {name} is listed twice for site {parts[1]}")
        if flag == "repack" and name not in REPACK_DROP:
            raise ValueError(f"{path}:{number}: no repack rule for {name}")
        seen.add((name, parts[1]))
        specs.append(WheelSpec(name, match.group(2), parts[1], flag == "repack", flag == "build"))
    return specs


def wheel_dist_name(filename: str) -> str:
    return canonical(filename.split("-")[0])


def repack(source: Path, target: Path, patterns: list[str]) -> int:
    """Rewrite a wheel without the members matching `patterns`; RECORD lists what is left.

    Returns how many members were dropped. Name, version and dist-info are kept as they are.
    """
    compiled = [re.compile(p) for p in patterns]
    with zipfile.ZipFile(source) as zin:
        names = zin.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        keep = [n for n in names if n != record and not any(p.search(n) for p in compiled)]
        rows = []
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for name in keep:
                data = zin.read(name)
                zout.writestr(zin.getinfo(name), data, zipfile.ZIP_DEFLATED, 9)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
                rows.append((name, "sha256=" + digest.rstrip(b"=").decode(), str(len(data))))
            buffer = io.StringIO()
            writer = csv.writer(buffer, lineterminator="\n")
            writer.writerows(rows)
            writer.writerow((record, "", ""))
            zout.writestr(record, buffer.getvalue())
        os.replace(partial, target)
    return len(names) - 1 - len(keep)


def download(spec: WheelSpec, cache: Path) -> Path:
    """The wheel for `spec` from the cache, fetched with pip when absent."""
    found = [p for p in cache.glob("*.whl") if wheel_dist_name(p.name) == spec.name]
    found = [p for p in found if p.name.split("-")[1] == spec.version]
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        if spec.build:
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                   "--disable-pip-version-check", "-w", tmp, spec.requirement]  # fmt: skip
        else:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                   "--disable-pip-version-check", *PLATFORM_ARGS, "-d", tmp,
                   spec.requirement]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise SystemExit(f"pip download {spec.requirement} failed:\n{done.stderr[-2000:]}")
        if spec.build and not wheels[0].name.endswith("-py3-none-any.whl"):
            raise SystemExit(f"{spec.requirement} built {wheels[0].name}, not a pure-Python wheel")
        target = cache / wheels[0].name
        os.replace(wheels[0], target)
    return target


def build_project_wheel(into: Path) -> Path:
    """The project's own wheel (pure Python): its dist-info registers the SGLang plugin.

    Built from a copy of what the wheel holds, so no build/ or egg-info lands in the checkout
    (an untracked build/ would travel to the device with every call). Built with pip's build
    isolation, which installs pyproject.toml's build requirements (setuptools>=68) for the
    build: a fresh machine's python3 (3.11, setuptools 65 without the `wheel` package) has no
    `bdist_wheel` of its own.
    """
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copyfile(REPO_ROOT / name, source / name)
        shutil.copytree(
            REPO_ROOT / "eaglepipe",
            source / "eaglepipe",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
               "--disable-pip-version-check", "-w", tmp, str(source)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("eaglepipe-*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise SystemExit(f"building the eaglepipe wheel failed:\n{done.stderr[-2000:]}")
        target = into / wheels[0].name
        shutil.copyfile(wheels[0], target)
    return target


def tracked_bytes() -> int:
    """Bytes of the repository's tracked files: what every device call carries anyway."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout.decode()
    return sum(
        (REPO_ROOT / rel).stat().st_size
        for rel in filter(None, listed.split("\0"))
        if (REPO_ROOT / rel).is_file()
    )


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def stage(dest: Path, cache: Path, specs: list[WheelSpec]) -> list[dict]:
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=dest.parent))
    try:
        for site in SITES:
            (staging / site).mkdir()
        entries = []
        for spec in specs:
            source = download(spec, cache)
            target = staging / spec.site / source.name
            if spec.repack:
                dropped = repack(source, target, REPACK_DROP[spec.name])
                print(
                    f"repacked {source.name}: {dropped} files dropped, "
                    f"{source.stat().st_size / MIB:.1f} -> {target.stat().st_size / MIB:.1f} MiB",
                    flush=True,
                )
            else:
                shutil.copyfile(source, target)
            entries.append({**spec.__dict__, "file": f"{spec.site}/{target.name}"})
        own = build_project_wheel(staging / "common")
        entries.append(
            {
                "name": "eaglepipe",
                "version": own.name.split("-")[1],
                "site": "common",
                "repack": False,
                "file": f"common/{own.name}",
            }  # fmt: skip
        )
        for entry in entries:
            entry["bytes"] = (staging / entry["file"]).stat().st_size
        (staging / "manifest.json").write_text(json.dumps(entries, indent=1) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return entries


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--list", type=Path, default=WHEEL_LIST)
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache" / "eaglepipe" / "h200-wheels"
    )
    parser.add_argument("--limit-mib", type=float, default=60.0)
    args = parser.parse_args(argv)
    specs = read_wheel_list(args.list)
    args.cache.mkdir(parents=True, exist_ok=True)
    args.dest.parent.mkdir(parents=True, exist_ok=True)
    entries = stage(args.dest.resolve(), args.cache, specs)
    wheels, repo, jit = tree_bytes(args.dest), tracked_bytes(), tree_bytes(JIT_CACHE_DIR)
    for site in SITES:
        count = sum(1 for e in entries if e["site"] == site)
        size = sum(e["bytes"] for e in entries if e["site"] == site)
        print(f"{site}: {count} wheels, {size / MIB:.1f} MiB", flush=True)
    print(
        f"one device call carries {(wheels + repo) / MIB:.1f} MiB: wheels {wheels / MIB:.1f}, "
        f"tracked files {repo / MIB:.1f} (limit {args.limit_mib:g}); with the JIT cache in "
        f"{JIT_CACHE_DIR.name}/ ({jit / MIB:.1f} MiB): {(wheels + repo + jit) / MIB:.1f} MiB",
        flush=True,
    )
    if wheels + repo > args.limit_mib * MIB:
        print(
            f"over the {args.limit_mib:g} MiB limit: a device call takes at most 64 MiB",
            file=sys.stderr,
        )
        return 1
    if wheels + repo + jit > CALL_LIMIT_MIB * MIB:
        print(
            f"with {JIT_CACHE_DIR.name}/ a call would carry more than {CALL_LIMIT_MIB} MiB: "
            f"leave it out of the call's carry list",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

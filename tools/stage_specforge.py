#!/usr/bin/env python3
"""Stage SpecForge 0.2.0 for the lent H200 machine, beside the staged SGLang (issue 27).

    .venv/bin/python tools/stage_sglang.py       # first: .whl-sglang/
    .venv/bin/python tools/stage_specforge.py --script-from PATH   # then: .whl-specforge/

What the SpecForge runs of benchmarks/studies/specforge/compare.py install there (`pip install
--no-deps --target`, a directory of their own, so the trainer sees only these beside the
machine's own packages): the set that ran on the H200 on 2026-12-01 (../shared/specforge-h200),
SpecForge's wheel, cuda-tile (OWN_EXTRAS: what its in-process capture imports beyond the server)
and seven wheels the SGLang staging already holds with the same versions (datasets, dill,
multiprocess, pydantic and its three parts). Only SpecForge's wheel and OWN_EXTRAS are copied
into DEST; the manifest names the other seven in .whl-sglang/common/ with their sha256, so a
call carries them once. The staging stops when they are missing there or differ in version, and
when SpecForge's wheel pins another SGLang than tools/h200_wheels.txt.

SpecForge's feature generator, scripts/prepare_hidden_states.py, is in neither its wheel nor its
source distribution. It is taken at commit SCRIPT_COMMIT, checked against SCRIPT_SHA256: from
GitHub when this machine reaches it, else from --script-from (a copy of that file, e.g.
../shared/specforge-h200/specforge_scripts/prepare_hidden_states.py). SpecForge is MIT licensed:
its LICENSE (from the wheel) is staged beside the script. Nothing of SpecForge is committed to
this repository: DEST is ignored by git.

DEST/manifest.json lists every wheel (file relative to the repository, sha256, bytes) and the
script's commit and source. The staging then adds up what one device call carries (tracked
files, .whl-sglang, DEST, and .jit-sglang when present) and fails above 64 MiB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_sglang import (  # noqa: E402
    CALL_LIMIT_MIB,
    JIT_CACHE_DIR,
    MIB,
    REPO_ROOT,
    WheelSpec,
    canonical,
    download,
    read_wheel_list,
    tracked_bytes,
    tree_bytes,
)
from stage_sglang import DEFAULT_DEST as SGLANG_DEST  # noqa: E402

DEFAULT_DEST = REPO_ROOT / ".whl-specforge"
SPECFORGE = WheelSpec("specforge", "0.2.0", "common")
# Staged with SpecForge's wheel, not with SGLang's: flashinfer requires cuda-tile, and only
# SpecForge's in-process capture reaches the module that imports it (SGLang's MoE token
# dispatcher, through its DP-attention scheduler code); the server never does. Without it that
# route stopped on the H200 on 2026-12-03 with "No module named 'cuda.tile'".
OWN_EXTRAS = (WheelSpec("cuda-tile", "1.7.0", "common"),)
# What SpecForge's offline route imports that the H200 image lacks: the set that ran there.
# Each must be staged for SGLang with this version (tests/test_h200_tools.py checks the list).
SHARED_WITH_SGLANG = {
    "datasets": "5.2.0",
    "dill": "0.4.1",
    "multiprocess": "0.70.19",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "typing-inspection": "0.4.5",
    "annotated-types": "0.8.0",
}
SCRIPT_NAME = "prepare_hidden_states.py"
SCRIPT_COMMIT = "a6b6b023"
SCRIPT_SHA256 = "37bed64cf70d6042f696079c624b6eecc974711fe6d90c7f98b0e07c03d37cb9"
SCRIPT_URL = (
    f"https://raw.githubusercontent.com/sgl-project/SpecForge/{SCRIPT_COMMIT}/scripts/{SCRIPT_NAME}"
)
LICENSE_NAME = "LICENSE.SpecForge"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_requirements(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def check_sglang_pin(wheel: Path, wheel_list: Path) -> str:
    """SpecForge's SGLang pin, which must be the SGLang staged for the machine."""
    pins = [r for r in wheel_requirements(wheel) if canonical(r.split("==")[0]) == "sglang"]
    staged = {s.name: s.version for s in read_wheel_list(wheel_list)}["sglang"]
    if pins != [f"sglang=={staged}"]:
        raise SystemExit(
            f"{wheel.name} requires {pins or 'no pinned sglang'}, but {wheel_list.name} stages "
            f"sglang=={staged}: SpecForge and the pipeline must be served by the same SGLang"
        )
    return staged


def shared_wheels(sglang_dest: Path) -> list[dict]:
    """The seven wheels SpecForge shares with the SGLang staging, found in its manifest."""
    manifest_path = sglang_dest / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit(
            f"{manifest_path} does not exist: stage SGLang first "
            "(.venv/bin/python tools/stage_sglang.py)"
        )
    staged = {e["name"]: e for e in json.loads(manifest_path.read_text())}
    entries = []
    for name, version in SHARED_WITH_SGLANG.items():
        entry = staged.get(name)
        if entry is None or entry["version"] != version or entry["site"] != "common":
            found = f"{entry['version']} in {entry['site']}/" if entry else "not staged"
            raise SystemExit(
                f"SpecForge needs {name}=={version} from {sglang_dest.name}/common: {found}"
            )
        path = sglang_dest / entry["file"]
        if not path.is_file():
            raise SystemExit(f"{path} is listed in {manifest_path} but missing: stage SGLang again")
        entries.append(
            {
                "name": name,
                "version": version,
                "file": path.relative_to(REPO_ROOT).as_posix(),
                "sha256": sha256(path),
                "bytes": path.stat().st_size,
            }
        )
    return entries


def fetch_script(target: Path, script_from: Path | None) -> str:
    """prepare_hidden_states.py at SCRIPT_COMMIT into `target`; returns where it came from."""
    if script_from is not None:
        source = script_from / SCRIPT_NAME if script_from.is_dir() else script_from
        if not source.is_file():
            raise SystemExit(f"--script-from {script_from}: no {SCRIPT_NAME} there")
        shutil.copyfile(source, target)
        origin = str(source)
    else:
        try:
            with urllib.request.urlopen(SCRIPT_URL, timeout=60) as answer:
                target.write_bytes(answer.read())
        except (urllib.error.URLError, OSError) as exc:
            raise SystemExit(
                f"cannot download {SCRIPT_URL} ({exc}): pass --script-from with a copy of "
                f"SpecForge's scripts/{SCRIPT_NAME} at commit {SCRIPT_COMMIT}"
            ) from None
        origin = SCRIPT_URL
    found = sha256(target)
    if found != SCRIPT_SHA256:
        raise SystemExit(
            f"{origin}: sha256 {found}, not that of SpecForge's scripts/{SCRIPT_NAME} at commit "
            f"{SCRIPT_COMMIT} ({SCRIPT_SHA256})"
        )
    return origin


def copy_license(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE"))
        target.write_bytes(archive.read(name))


def stage(dest: Path, cache: Path, sglang_dest: Path, wheel_list: Path, script_from) -> dict:
    shared = shared_wheels(sglang_dest)
    wheel = download(SPECFORGE, cache)
    sglang = check_sglang_pin(wheel, wheel_list)
    extras = [(spec, download(spec, cache)) for spec in OWN_EXTRAS]
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=dest.parent))
    try:
        own = []
        for spec, path in [(SPECFORGE, wheel), *extras]:
            shutil.copyfile(path, staging / path.name)
            own.append(
                {
                    "name": spec.name,
                    "version": spec.version,
                    "file": f"{dest.relative_to(REPO_ROOT).as_posix()}/{path.name}",
                    "sha256": sha256(staging / path.name),
                    "bytes": path.stat().st_size,
                }
            )
        origin = fetch_script(staging / SCRIPT_NAME, script_from)
        copy_license(wheel, staging / LICENSE_NAME)
        manifest = {
            "specforge": SPECFORGE.version,
            "sglang": sglang,
            "wheels": [*own, *shared],
            "script": {
                "file": SCRIPT_NAME,
                "commit": SCRIPT_COMMIT,
                "sha256": SCRIPT_SHA256,
                "source": origin,
                "license": LICENSE_NAME,
            },
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--sglang-dest", type=Path, default=SGLANG_DEST)
    parser.add_argument("--list", type=Path, default=REPO_ROOT / "tools" / "h200_wheels.txt")
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache" / "eaglepipe" / "h200-wheels"
    )
    parser.add_argument(
        "--script-from",
        type=Path,
        default=None,
        help=f"a copy of SpecForge's scripts/{SCRIPT_NAME} at {SCRIPT_COMMIT} (or its folder), "
        "when GitHub is out of reach",
    )
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    dest = args.dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    manifest = stage(dest, args.cache, args.sglang_dest.resolve(), args.list, args.script_from)
    own, sglang, jit = tree_bytes(dest), tree_bytes(args.sglang_dest), tree_bytes(JIT_CACHE_DIR)
    repo = tracked_bytes()
    total = own + sglang + repo
    print(
        f"{dest.name}: SpecForge {manifest['specforge']} and {len(OWN_EXTRAS)} more "
        f"({own / MIB:.2f} MiB), {len(SHARED_WITH_SGLANG)} wheels shared with "
        f"{args.sglang_dest.name}; prepare_hidden_states.py at {SCRIPT_COMMIT} from "
        f"{manifest['script']['source']}",
        flush=True,
    )
    print(
        f"a SpecForge call carries {total / MIB:.1f} MiB: {args.sglang_dest.name} "
        f"{sglang / MIB:.1f}, {dest.name} {own / MIB:.2f}, tracked files {repo / MIB:.1f}; "
        f"with {JIT_CACHE_DIR.name}/ ({jit / MIB:.1f} MiB): {(total + jit) / MIB:.1f} MiB "
        f"(limit {CALL_LIMIT_MIB})",
        flush=True,
    )
    if total > CALL_LIMIT_MIB * MIB:
        print(f"over the {CALL_LIMIT_MIB} MiB a device call carries", file=sys.stderr)
        return 1
    if total + jit > CALL_LIMIT_MIB * MIB:
        print(
            f"with {JIT_CACHE_DIR.name}/ a call would carry more than {CALL_LIMIT_MIB} MiB: "
            "leave it out of the call's carry list",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

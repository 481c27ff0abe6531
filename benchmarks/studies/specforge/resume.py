"""A comparison that outlives its machine (issue 27): what the next call needs, carried back.

The lent H200 keeps its files only while it stays warm between calls; on 2026-12-03 it was lost
after the pipelines and trainings, and the live runs had nothing to run on. So after every
group of steps `write_kit` packs what the remaining live runs need into one small tarball in
the call's results: the state of the steps whose products it holds (the pipelines', the
trainings' and the finished live runs'), the drafters (`seeds/`), the greedy references, and
the run's resolved config and prepared table. The toy target (6 MB, over what a call can carry
beside the wheels) is not in it: a hash of each of its files is, and `restore_kit` rebuilds
it on the new machine (the build is deterministic) and refuses to go on if a byte differs.

A kit is restored only on a machine without the comparison's state (a warm machine has it all)
and only when every pipeline step is done: a pipeline still to run rebuilds the run directory
from the start, and live runs on its new regenerated rows would not be the same comparison.

    bash tools/h200.sh specforge $OUT ...                  # writes $OUT/specforge_resume.tgz
    mkdir -p .specforge-resume && cp .../specforge_resume.tgz .specforge-resume/
    # the next call carries .specforge-resume; tools/h200.sh passes it as --resume-kit
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.studies.specforge.steps import REPO_ROOT, Paths, Step
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.fingerprint import hash_file

KIT_STATE = "kit-state.json"
RESTORABLE_KINDS = ("pipeline", "train", "live")
RUN_FILES = (".eaglepipe/config.json", "prepared/tokenized.parquet")
TOY_DIR = "models/toy-target"


def toy_fingerprint(run: Path) -> dict[str, str]:
    toy = run / TOY_DIR
    return {p.name: hash_file(p) for p in sorted(toy.iterdir()) if p.is_file()}


def write_kit(paths: Paths, state: dict, plan: list[Step], kit: Path) -> bool:
    """Pack the kit into `kit` (atomically); False when there is nothing a later call could
    use yet (the first pipeline has not finished)."""
    kinds = {step.name: step.kind for step in plan}
    steps = {
        name: entry
        for name, entry in state.get("steps", {}).items()
        if entry.get("status") == "done" and kinds.get(name) in RESTORABLE_KINDS
    }
    run = paths.run
    if not any(kinds[name] == "pipeline" for name in steps) or not (run / TOY_DIR).is_dir():
        return False
    kit_state = {"state": {**state, "steps": steps}, "toy_hashes": toy_fingerprint(run)}
    members = [paths.work / "seeds", *sorted(paths.work.glob("greedy-reference*.json"))]
    members += [run / name for name in RUN_FILES]
    kit.parent.mkdir(parents=True, exist_ok=True)
    partial = kit.with_name(f".{kit.name}.tmp-{os.getpid()}")
    with tarfile.open(partial, "w:gz") as tar:
        body = json.dumps(kit_state, indent=1).encode()
        info = tarfile.TarInfo(KIT_STATE)
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
        for member in members:
            if member.exists():
                tar.add(member, arcname=str(member.relative_to(paths.work)))
    os.replace(partial, kit)
    return True


def restore_kit(paths: Paths, kit: Path, plan: list[Step], dry_run: bool = False) -> dict | None:
    """The state a kit carries, with its files put back under the work root and the toy
    rebuilt; None when it does not apply (the state is here already, or a pipeline is left)."""
    if paths.state.is_file():
        return None
    with tarfile.open(kit) as tar:
        kit_state = json.loads(tar.extractfile(KIT_STATE).read())
        steps = kit_state["state"]["steps"]
        pipelines = [s.name for s in plan if s.kind == "pipeline"]
        if any(name not in steps for name in pipelines):
            return None
        if dry_run:
            return kit_state["state"]
        paths.work.mkdir(parents=True, exist_ok=True)
        tar.extractall(paths.work, filter="data")
    (paths.work / KIT_STATE).unlink()
    rebuild_toy(paths.run, kit_state["toy_hashes"])
    return kit_state["state"]


def rebuild_toy(run: Path, expected: dict[str, str]) -> None:
    """The toy target the drafters were trained on, rebuilt here and checked byte for byte."""
    done = subprocess.run(
        [sys.executable, "-u", str(REPO_ROOT / "scripts" / "build_toy_target.py"),
         "--config", ".eaglepipe/config.json", "--out", TOY_DIR],
        cwd=run, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise PipelineError(
            f"rebuilding the toy target in {run} failed: {done.stderr.strip()[-2000:]}"
        )
    found = toy_fingerprint(run)
    differing = sorted(
        name for name in expected.keys() | found.keys() if expected.get(name) != found.get(name)
    )
    if differing:
        raise PipelineError(
            f"the toy target rebuilt in {run / TOY_DIR} differs from the one the drafters were "
            f"trained on ({', '.join(differing)}): the kit cannot be used, start over with --fresh"
        )

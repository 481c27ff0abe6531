"""The rerun policy at parse time: which stage outputs are fresh (their recorded provenance is
the current one), which validation reports no longer describe their shard, and which missing
per-shard files must become targets (see `provenance.py` for why)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.config import HIDDEN_STATES_DIR, VALIDATED_DIR
from ..core.fingerprint import hash_file
from ..core.run import RunSpec
from .provenance import (
    PROVENANCE_DIR,
    identity_or_none,
    not_in_plan_error,
    prepare_provenance,
    regenerated_facts,
    regenerated_manifest_path,
    regeneration_enabled,
    regeneration_provenances,
    shard_provenances,
    shards,
    stage_settings,
    stage_stamp,
    validation_settings,
)


def regeneration_freshness(run: RunSpec) -> Callable[[str], bool]:
    """Whether a regenerated shard's manifest records the current regeneration provenance."""
    provenances = regeneration_provenances(run)
    facts = regenerated_facts(list(provenances))

    def is_fresh(shard: str) -> bool:
        if shard not in provenances:
            raise not_in_plan_error(run, shard)
        recorded = facts.get(shard)
        return recorded is not None and recorded["workflow"] == provenances[shard]

    return is_fresh


# --- runs left inconsistent: a missing or changed file upstream of a finished output ----------
#
# Snakemake 9 rebuilds a missing file only if it is a target, or if a job that needs it must run
# for a reason of its own; a newer input is such a reason, a missing one is not. So after a
# finished run, deleting a manifest (or a failed training run deleting the model) would leave
# `snakemake` saying "Nothing to be done". The parse therefore (1) lists every single-job stage's
# output as a target of `all` (cheap), (2) lists a shard's missing manifest or validation report
# as a target when what consumes it exists, and (3) finds validation reports that no longer
# describe their manifest (changed bytes, even with an old mtime) or the validate settings, and
# gives those validate jobs a freshly written stamp as input, so they rerun.
#
# The other way round, a missing input reruns its consumer even when it is `ancient()`: so a
# fresh shard's extraction takes the prepared table as input only while the table exists.
# After a failed prepare (Snakemake removes its outputs) the table is made again and only jobs
# that are stale for their own reasons follow it; a fresh shard's hidden states and validation
# report stay (their provenance holds the shard's rows, not the table). A fresh extraction
# runs only when forced (`--forcerun`); without the table it then stops in one line naming it.

VALIDATION_STAMP_DIR = PROVENANCE_DIR / "validate"
VALIDATION_CACHE = Path(".eaglepipe/cache/validations.json")


def validation_stamp(shard: str) -> Path:
    return VALIDATION_STAMP_DIR / f"{shard}.json"


def validation_report_path(shard: str) -> str:
    return os.path.join(VALIDATED_DIR, f"{shard}.json")


def failed_checks(report: dict) -> list[str] | None:
    """The checks a validation report records as not passed (None when it records none at all).
    The validate job writes a report only when every check passed: anything else was edited."""
    checks = report.get("checks")
    if not isinstance(checks, dict) or not checks:
        return None
    return sorted(
        name
        for name, check in checks.items()
        if not (isinstance(check, dict) and check.get("ok") is True)
    )


def _report_facts(manifest: str, report: str) -> dict:
    """What a validation report says of its shard: does it describe this manifest, under which
    validate settings, did every check pass. Unreadable reports describe nothing."""
    try:
        recorded = json.loads(Path(report).read_text())
        manifest_hash = recorded["manifest_xxh3_128"]
        settings = recorded.get("validation_settings")
        failed = failed_checks(recorded)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"describes_manifest": False, "settings": None, "passed": False}
    return {
        "describes_manifest": manifest_hash == hash_file(manifest),
        "settings": settings,
        "passed": failed == [],
    }


def _validation_staleness(run: RunSpec, shard_names: list[str]) -> tuple[dict, dict, dict]:
    """({shard: (why, files key)} of stale reports, the facts cache as read, as it should be)."""
    try:
        cache = json.loads(VALIDATION_CACHE.read_text())
    except (FileNotFoundError, ValueError):
        cache = {}
    settings = validation_settings(run)
    stale: dict[str, tuple[str, list]] = {}
    new_cache: dict[str, dict] = {}
    for shard in shard_names:
        manifest, report = manifest_path(shard), validation_report_path(shard)
        key = [identity_or_none(manifest), identity_or_none(report)]
        if key[1] is None:
            continue  # no report: a target of `all` instead (incomplete_targets)
        if key[0] is None:
            # Set aside (`eaglepipe verify`, a damaged chunk) or deleted: its validate job reruns,
            # which makes Snakemake extract the shard first, whatever the targets.
            why = "its manifest is missing"
        else:
            facts = cache.get(shard)
            if not facts or facts.get("key") != key or "passed" not in facts:
                facts = {"key": key, **_report_facts(manifest, report)}
            new_cache[shard] = facts
            why = None
            if not facts["describes_manifest"]:
                why = "its manifest changed after it was validated"
            elif facts["settings"] != settings:
                why = "the validate settings changed"
            elif not facts.get("passed", False):
                why = "it records a check that did not pass (edited by hand?)"
        if why is not None:
            stale[shard] = (why, key)
    return stale, cache, new_cache


def stale_validations(run: RunSpec, shard_names: list[str]) -> dict[str, str]:
    """`{shard: why}` for each shard whose validation report exists but is stale.

    Facts are cached by both files' identity (inode, size, mtime, ctime): a warm parse only
    stats 2 files per shard. Each stale shard's stamp is rewritten when what makes it stale
    changes, so its validate job sees a new input.
    """
    from ..core.atomic import write_json_if_changed

    stale, cache, new_cache = _validation_staleness(run, shard_names)
    settings = validation_settings(run)
    for shard, (why, key) in stale.items():
        write_json_if_changed(
            validation_stamp(shard), {"why": why, "files": key, "settings": settings}, durable=False
        )
    if new_cache != cache:
        write_json_if_changed(VALIDATION_CACHE, new_cache, durable=False)
    return {shard: why for shard, (why, _) in stale.items()}


@dataclass
class Staleness:
    """Which existing outputs the workflow would make again for a config, and why: the same
    decisions as the parse (`regeneration_freshness`, `prepare_is_fresh`, `shard_freshness`,
    stale validation reports, the single-job stages' settings stamps), taken without writing a
    stamp (`eaglepipe status`, `verify`). Missing outputs are not listed: they are simply not
    done. `any` covers the data stages (what `eaglepipe verify` reports)."""

    regenerated: list[str] = field(default_factory=list)
    prepared: bool = False
    hidden_states: list[str] = field(default_factory=list)
    validations: dict[str, str] = field(default_factory=dict)
    # {stage: why} of the single-job stages (vocab, train, evaluate, export, live_acceptance).
    single_job: dict[str, str] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return bool(self.regenerated or self.prepared or self.hidden_states or self.validations)


@dataclass(frozen=True)
class SingleJobStage:
    """A single-job stage as rules/train.smk wires it: its outputs, and the stages whose outputs
    are its plain inputs (mtime-checked). The prepared table is a plain input only while prepare
    is stale (`prepared_table`: ancient() otherwise), so "prepare" counts only then."""

    name: str
    outputs: tuple[Path, ...]
    after: tuple[str, ...]


def single_job_stages(run: RunSpec, live_export_engine: str | None) -> list[SingleJobStage]:
    """The single-job stages in workflow order (`live_export_engine`: the export the live check
    reads, None when it is skipped: then no export is its input)."""
    from ..core import config as paths

    exports = tuple(
        paths.EXPORT_DIR / engine / name
        for engine in run.export.engines
        for name in paths.EXPORT_FILES
    )
    return [
        SingleJobStage("vocab", (paths.DRAFT_VOCAB,), ("prepare",)),
        SingleJobStage(
            "train", (paths.DRAFTER_MODEL, paths.TRAIN_LOG), ("prepare", "vocab", "validate")
        ),
        SingleJobStage(
            "evaluate", (paths.EVAL_REPORT, paths.EVAL_PLOT), ("prepare", "vocab", "train")
        ),
        SingleJobStage("export", exports, ("vocab", "train")),
        SingleJobStage(
            "live_acceptance",
            (paths.LIVE_REPORT,),
            ("prepare", "evaluate", *(("export",) if live_export_engine else ())),
        ),
    ]


def _mtime(path: str | Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def _stamp_settings(stage: str) -> dict | None:
    try:
        return json.loads(stage_stamp(stage).read_text()).get("settings")
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def single_job_staleness(
    run: RunSpec,
    found: Staleness,
    shard_names: list[str],
    *,
    live_export_engine: str | None,
) -> dict[str, str]:
    """`{stage: why}` for each single-job stage whose outputs all exist but which the workflow
    runs again, judged as Snakemake judges it under the wiring of rules/train.smk with the
    mtime trigger: its settings stamp would be rewritten (`write_stamps`: other settings) or is
    newer than its oldest output, an earlier stage it reads runs again (stale or missing), or a
    plain input is newer than its oldest output. Nothing is written."""
    from ..core.config import PREPARED_TABLE

    settings = stage_settings(run)
    # Each earlier stage either runs again (why) or has outputs of a newest mtime.
    runs_again: dict[str, str] = {}
    newest: dict[str, float] = {}
    if found.prepared or not PREPARED_TABLE.exists():
        runs_again["prepare"] = "prepare runs again"
    report_mtimes = [_mtime(validation_report_path(shard)) for shard in shard_names]
    redone = set(found.validations) | set(found.hidden_states)
    if redone or None in report_mtimes:
        runs_again["validate"] = "shards are validated again"
    else:
        newest["validate"] = max(report_mtimes, default=0.0)
    stale: dict[str, str] = {}
    for stage in single_job_stages(run, live_export_engine):
        mtimes = [_mtime(path) for path in stage.outputs]
        if None in mtimes:
            runs_again[stage.name] = f"{stage.name} runs again"
            continue
        oldest = min(mtimes, default=0.0)
        why = None
        stamp_mtime = _mtime(stage_stamp(stage.name))
        if _stamp_settings(stage.name) != settings[stage.name]:
            why = "its settings changed"
        elif stamp_mtime is not None and stamp_mtime > oldest:
            why = f"its settings stamp {stage_stamp(stage.name)} is newer than its outputs"
        for earlier in stage.after:
            if why is not None:
                break
            if earlier in runs_again:
                why = runs_again[earlier]
            elif newest.get(earlier, 0.0) > oldest:
                why = f"the outputs of {earlier} are newer"
        if why is None:
            newest[stage.name] = max(mtimes, default=0.0)
        else:
            stale[stage.name] = why
            runs_again[stage.name] = f"{stage.name} runs again"
    return stale


def staleness(
    run: RunSpec, shard_names: list[str], *, live_export_engine: str | None = None
) -> Staleness:
    """`Staleness` of the run in the working directory, for `run`'s config."""
    from ..core.config import PREPARED_SUMMARY

    found = Staleness()
    if regeneration_enabled(run):
        is_fresh = regeneration_freshness(run)
        found.regenerated = [
            shard
            for shard in shard_names
            if os.path.exists(regenerated_manifest_path(shard)) and not is_fresh(shard)
        ]
    found.prepared = PREPARED_SUMMARY.exists() and not prepare_is_fresh(run)
    is_fresh = shard_freshness(run)
    found.hidden_states = [
        shard
        for shard in shard_names
        if os.path.exists(manifest_path(shard)) and not is_fresh(shard)
    ]
    stale, _, _ = _validation_staleness(run, shard_names)
    found.validations = {
        shard: why
        for shard, (why, _) in stale.items()
        if why != "its manifest is missing"  # the shard is not done: no stale report
    }
    found.single_job = single_job_staleness(
        run, found, shard_names, live_export_engine=live_export_engine
    )
    return found


def incomplete_targets(shard_names: list[str], *, regenerate: bool = False) -> list[str]:
    """Missing per-shard files whose consumers exist, as extra targets of `all`."""
    from ..core.config import DRAFTER_MODEL, PREPARED_SUMMARY

    trained = DRAFTER_MODEL.exists()
    targets = []
    if regenerate and PREPARED_SUMMARY.exists():
        # prepare read every regenerated shard: one deleted since is made again (its journalled
        # rows are kept), then prepare and the hidden states of that shard follow.
        targets += [
            regenerated_manifest_path(shard)
            for shard in shard_names
            if not os.path.exists(regenerated_manifest_path(shard))
        ]
    for shard in shard_names:
        manifest, report = manifest_path(shard), validation_report_path(shard)
        has_manifest, has_report = os.path.exists(manifest), os.path.exists(report)
        if not has_manifest and has_report:
            targets.append(manifest)  # its extraction reruns, then (plain input) its validation
        elif not has_report and (has_manifest or trained):
            targets.append(report)
    return targets


def _recorded_provenance(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("provenance", {}).get("workflow")
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def prepare_is_fresh(run: RunSpec) -> bool:
    from ..core.config import PREPARED_SUMMARY

    return _recorded_provenance(PREPARED_SUMMARY) == prepare_provenance(run)


def shard_is_fresh(run: RunSpec, shard: str) -> bool:
    return shard_freshness(run)(shard)


def shard_freshness(run: RunSpec) -> Callable[[str], bool]:
    """`shard_is_fresh` for one config, as a function of the shard name.

    The extract rule's input function asks once per shard job; this hashes the config and
    looks up the shard provenances once, and reads each manifest only when its job is built.
    """
    provenances = shard_provenances(run)

    def is_fresh(shard: str) -> bool:
        current = provenances.get(shard)
        if current is None:
            raise not_in_plan_error(run, shard)
        return _recorded_provenance(Path(manifest_path(shard))) == current

    return is_fresh


def manifest_path(shard: str) -> str:
    return os.path.join(HIDDEN_STATES_DIR, shard, "manifest.json")


def planned_manifests(run: RunSpec) -> list[str]:
    """Every shard's manifest, for steps that read all shards (too many for a command line)."""
    return [manifest_path(shard) for shard in shards(run)]


def planned_validations(run: RunSpec) -> list[str]:
    return [str(VALIDATED_DIR / f"{shard}.json") for shard in shards(run)]


def remaining_shards(run: RunSpec) -> list[str]:
    return [s for s in shards(run) if not Path(manifest_path(s)).exists()]

"""Parse-time logic of the Snakemake workflow (rules/common.smk only wires these up).

Rerun policy. Snakemake's mtime trigger would re-extract every shard whenever the prepared
table is rewritten or the dataset file is touched; for multi-terabyte runs that is not
acceptable. Instead each data stage has a *provenance stamp*: a small JSON file under
`.eaglepipe/provenance/` holding everything its output depends on (model and tokenizer
fingerprints, aux layer ids, tokenization settings, the shard's own source rows), rewritten at
parse time only when that content changes. Outputs record the provenance hash they were built
from. A stage whose recorded hash equals the current one is *fresh*: its inputs are wired as
`ancient()`, so nothing upstream can trigger it. A stale stage gets plain inputs, so it reruns
(the dry run names its stamp as the updated input), and so does anything downstream of it.

With `dataset.regenerate.enabled`, each regenerated shard has a stamp of its own (the model,
the regeneration settings and the shard's source rows), and the hidden states of a shard
depend on its *regenerated* rows instead: their checksum, read from the regenerated shard's
manifest while that shard is fresh. A regenerated shard that is stale or missing makes its
hidden-state shard stale too (its rows are not known until it has run), and makes prepare stale.

Why not Snakemake's params trigger: a job downstream of a job that must rerun is never
checked for its own reasons when its only link is an `ancient()` input (snakemake's DAG masks
it), so a changed shard would silently survive a run that also re-prepares the table.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import uuid
from collections.abc import Callable
from functools import cache
from pathlib import Path

from . import __version__
from .config import HIDDEN_STATES_DIR, REGENERATED_DIR, TOY_MODEL_DIR, VALIDATED_DIR
from .errors import PipelineError
from .fingerprint import file_identity, hash_file, hash_json
from .run import RunSpec
from .shard_plan import count_source_rows, plan_shards, shard_source_digests

RUN_TOKEN_ENV = "EAGLEPIPE_RUN_TOKEN"


# Full (oldest-generation) collections: at most one per this many young-generation collections.
_GC_FULL_EVERY = 1000
_gc_tuned = False


def tune_gc_for_dag() -> None:
    """Keep Python's cyclic garbage collector from rescanning Snakemake's DAG over and over.

    A DAG of 10,000 jobs is about a million objects (jobs, files, wildcards) that all live
    until the process ends. With the default thresholds the collector rescans all of them each
    time the heap has grown by a quarter (about 3 s of a 14 s `snakemake -n` on 5,000 shards),
    and again while the interpreter shuts down (another 2.5 s). So: what exists at parse time
    (imported modules, the config) is frozen; a full collection waits for 1000 young-generation
    collections instead of 10, while young garbage is collected as often as before; and at exit
    everything is frozen, so the shutdown frees memory without walking the DAG first.
    """
    global _gc_tuned
    if _gc_tuned:
        return
    _gc_tuned = True
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _GC_FULL_EVERY)
    atexit.register(gc.freeze)


def warn_about_rerun_triggers(snakemake_workflow) -> None:
    """The rerun policy assumes mtime-only triggers (profiles/default sets them)."""
    settings = getattr(snakemake_workflow, "dag_settings", None)
    if settings is None:  # settings are only known once the run starts
        return
    extra = sorted(t.name.lower() for t in settings.rerun_triggers if t.name != "MTIME")
    if extra:
        print(
            f"eaglepipe: warning: rerun triggers {', '.join(extra)} are on (no default profile?):"
            " a moved script, an edited rule or a new input path can then rerun prepare and"
            " hide stale shards from this run; use --rerun-triggers mtime (profiles/default)",
            file=sys.stderr,
            flush=True,
        )


def use_project_python() -> None:
    """Make `python` in rule shell commands the interpreter running snakemake.

    Jobs inherit this environment, so rules never reach a bare python3 from PATH (under
    `--sdm conda` Snakemake puts the rule's environment first instead). Unbuffered output
    keeps progress lines live in logs.
    """
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + path
    os.environ["PYTHONUNBUFFERED"] = "1"


def run_token() -> str:
    """One token per snakemake invocation; jobs inherit it through the environment."""
    return os.environ.setdefault(RUN_TOKEN_ENV, uuid.uuid4().hex)


def model_config_file(run: RunSpec) -> str:
    return str(run.model.config_file)


def _dataset_path(run: RunSpec) -> Path:
    path = Path(run.dataset.path)
    if not path.exists():
        raise PipelineError(f"dataset.path: {path} does not exist")
    return path


@cache
def _cached_file_hash(path: str, identity: tuple) -> str:
    return hash_file(path)


def dataset_hash(run: RunSpec) -> str:
    path = _dataset_path(run)
    return _cached_file_hash(str(path.resolve()), file_identity(path))


def shards(run: RunSpec) -> list[str]:
    """Shard names planned from the source's row count (no checkpoint needed)."""
    rows = count_source_rows(_dataset_path(run))
    return [s.name for s in plan_shards(rows, run.shards.rows_per_shard)]


def model_fingerprint(run: RunSpec) -> str:
    """Identity of the target model and tokenizer, computable before the toy target exists."""
    model = run.model
    if model.is_toy:
        # The toy build is seeded: its settings and corpus path identify it (it is not rebuilt
        # on data edits).
        return hash_json(toy_target_settings(run))
    return hash_json(
        {
            "config": model.config_hash,
            "tokenizer": model.tokenizer_fingerprint,
            # config.json alone cannot tell a base model from its fine-tune.
            "weights": model.weights_fingerprint,
        }
    )


def _tokenization_settings(run: RunSpec) -> dict:
    dataset = run.dataset
    return {
        "max_length": dataset.max_length,
        "format": dataset.format,
        "bad_rows": dataset.bad_rows,
        "trust_remote_code": run.model.trust_remote_code,
    }


def prepare_provenance(run: RunSpec) -> str:
    """Hash of everything the prepared table depends on (with regeneration: every regenerated
    shard's rows, or that it is still to be regenerated)."""
    regenerated = None
    if regeneration_enabled(run):
        regenerated = regenerated_contents(run, shards(run))
    return hash_json(
        {
            "model": model_fingerprint(run),
            "dataset": dataset_hash(run),
            "tokenization": _tokenization_settings(run),
            "holdout": run.dataset.holdout.as_dict(),
            "rows_per_shard": run.shards.rows_per_shard,
            "regenerated": regenerated,
        }
    )


@cache
def _shard_digests(path: str, rows_per_shard: int, identity: tuple) -> dict:
    return shard_source_digests(path, rows_per_shard)


def _not_in_plan(run: RunSpec, shard: str) -> PipelineError:
    return PipelineError(
        f"shard {shard} is not in the plan of {run.dataset.path} with "
        f"shards.rows_per_shard={run.shards.rows_per_shard}"
    )


def shard_provenance(run: RunSpec, shard: str) -> str:
    """Hash of everything a shard's hidden states depend on; a change makes only it stale."""
    shared, digests = _shard_provenance_inputs(run)
    if shard not in digests:
        raise _not_in_plan(run, shard)
    if regeneration_enabled(run):
        return hash_json({**shared, **regenerated_contents(run, [shard])[shard]})
    return hash_json({**shared, "source_rows": digests[shard]})


_PROVENANCE_MEMO: dict[str, tuple[dict, dict[str, str]]] = {}


def _shard_provenance_inputs(run: RunSpec) -> tuple[dict, dict[str, str]]:
    """(what every shard's provenance shares, each shard's source rows digest)."""
    # Parse time asks once per shard: fingerprint the model and read the source only once.
    config_key = run.config_hash
    if config_key not in _PROVENANCE_MEMO:
        path = _dataset_path(run)
        digests = _shard_digests(str(path), run.shards.rows_per_shard, file_identity(path))
        shared = {
            "model": model_fingerprint(run),
            "aux_layer_ids": run.aux_layer_ids,
            "tokenization": _tokenization_settings(run),
            "chunk_max_bytes": run.shards.chunk_max_bytes,
        }
        _PROVENANCE_MEMO[config_key] = (shared, digests)
    return _PROVENANCE_MEMO[config_key]


def shard_source_rows_digest(run: RunSpec, shard: str) -> str:
    """The xxh3-128 of a shard's raw source rows (`shard_plan.shard_source_digests`)."""
    _, digests = _shard_provenance_inputs(run)
    if shard not in digests:
        raise _not_in_plan(run, shard)
    return digests[shard]


def _shard_provenances(run: RunSpec) -> dict[str, str]:
    shared, digests = _shard_provenance_inputs(run)
    if not regeneration_enabled(run):
        return {shard: hash_json({**shared, "source_rows": d}) for shard, d in digests.items()}
    contents = regenerated_contents(run, list(digests))
    return {shard: hash_json({**shared, **contents[shard]}) for shard in digests}


# --- regeneration (dataset.regenerate): one stamp per shard, content read from manifests -------

REGENERATION_CACHE = Path(".eaglepipe/cache/regenerated.json")


def regeneration_enabled(run: RunSpec) -> bool:
    return run.dataset.regenerate.enabled


def regeneration_stamp(shard: str) -> Path:
    return REGENERATION_STAMP_DIR / f"{shard}.json"


def regenerated_manifest_path(shard: str) -> str:
    return os.path.join(REGENERATED_DIR, shard, "manifest.json")


def regeneration_settings(run: RunSpec) -> dict:
    """What every regenerated shard depends on besides its source rows."""
    dataset = run.dataset
    return {
        "model": model_fingerprint(run),
        **dataset.regenerate.output_settings(),
        # A turn whose prompt reaches max_length ends the regenerated conversation.
        "max_length": dataset.max_length,
        "format": dataset.format,
        "trust_remote_code": run.model.trust_remote_code,
    }


_REGENERATION_MEMO: dict[str, dict[str, str]] = {}


def _regeneration_provenances(run: RunSpec) -> dict[str, str]:
    config_key = run.config_hash
    if config_key not in _REGENERATION_MEMO:
        _, digests = _shard_provenance_inputs(run)
        shared = regeneration_settings(run)
        _REGENERATION_MEMO[config_key] = {
            shard: hash_json({**shared, "source_rows": digest}) for shard, digest in digests.items()
        }
    return _REGENERATION_MEMO[config_key]


def regeneration_provenance(run: RunSpec, shard: str) -> str:
    """Hash of everything a regenerated shard depends on; a change makes only it stale."""
    provenances = _regeneration_provenances(run)
    if shard not in provenances:
        raise _not_in_plan(run, shard)
    return provenances[shard]


def _regenerated_facts(shard_names: list[str]) -> dict[str, dict | None]:
    """What each regenerated manifest records (`workflow` provenance, rows checksum), or None
    when it is missing or unreadable. Cached by the manifest's identity: a warm parse only stats."""
    from .atomic import write_json_if_changed

    try:
        cache = json.loads(REGENERATION_CACHE.read_text())
    except (FileNotFoundError, ValueError):
        cache = {}
    facts: dict[str, dict | None] = {}
    updated = dict(cache)
    for shard in shard_names:
        path = regenerated_manifest_path(shard)
        identity = _identity_or_none(path)
        if identity is None:
            facts[shard] = None
            updated.pop(shard, None)
            continue
        cached = cache.get(shard)
        if not cached or cached.get("key") != identity:
            try:
                manifest = json.loads(Path(path).read_text())
                cached = {
                    "key": identity,
                    "workflow": manifest["provenance"]["workflow"],
                    "rows": manifest["xxh3_128"],
                }
            except (OSError, ValueError, KeyError, TypeError):
                cached = {"key": identity, "workflow": None, "rows": None}
            updated[shard] = cached
        facts[shard] = cached
    if updated != cache:
        write_json_if_changed(REGENERATION_CACHE, updated, durable=False)
    return facts


def regeneration_freshness(run: RunSpec) -> Callable[[str], bool]:
    """Whether a regenerated shard's manifest records the current regeneration provenance."""
    provenances = _regeneration_provenances(run)
    facts = _regenerated_facts(list(provenances))

    def is_fresh(shard: str) -> bool:
        if shard not in provenances:
            raise _not_in_plan(run, shard)
        recorded = facts.get(shard)
        return recorded is not None and recorded["workflow"] == provenances[shard]

    return is_fresh


def regenerated_contents(run: RunSpec, shard_names: list[str]) -> dict[str, dict]:
    """Per shard, what its regenerated rows are: their checksum while the regenerated shard is
    fresh, else that it is still to be regenerated (so anything built on it is stale)."""
    provenances = _regeneration_provenances(run)
    facts = _regenerated_facts(shard_names)
    contents = {}
    for shard in shard_names:
        recorded = facts.get(shard)
        if recorded is not None and recorded["workflow"] == provenances[shard]:
            contents[shard] = {"regenerated_rows": recorded["rows"]}
        else:
            contents[shard] = {"regeneration_pending": provenances[shard]}
    return contents


PROVENANCE_DIR = Path(".eaglepipe/provenance")
REGENERATION_STAMP_DIR = PROVENANCE_DIR / "regenerate"
PREPARE_STAMP = PROVENANCE_DIR / "prepare.json"
TOY_STAMP = PROVENANCE_DIR / "toy-target.json"


def shard_stamp(shard: str) -> Path:
    return PROVENANCE_DIR / f"{shard}.json"


def toy_target_settings(run: RunSpec) -> dict:
    # The toy's tokenizer is trained on the dataset file: another file is another toy. (Edits
    # of the same file are not: a rebuilt toy would make every shard stale.)
    return {"toy": run.model.toy.as_dict(), "corpus": str(Path(run.dataset.path))}


def stage_settings(run: RunSpec) -> dict[str, dict]:
    """The settings each single-job stage's outputs depend on, besides its input files.

    Each stage's stamp (`stage_stamp`) holds them and is a plain input of its rule: a changed
    setting rewrites the stamp, which reruns exactly that stage and, through their inputs, the
    stages after it.
    """
    evaluate, server = run.evaluate, run.server
    return {
        "vocab": {"draft_vocab_size": run.train.draft_vocab_size},
        "train": run.train.as_dict(),
        "evaluate": {"max_rows": evaluate.max_rows},
        "export": {"engines": list(run.export.engines)},
        "live_acceptance": {
            "live_prompts": evaluate.live_prompts,
            "live_new_tokens": evaluate.live_new_tokens,
            "engine": server.engine,
            "device": server.device,
            "dtype": server.dtype,
            "sglang": server.sglang.as_dict() if server.engine == "sglang" else None,
        },
    }


def stage_stamp(stage: str) -> Path:
    return PROVENANCE_DIR / f"stage-{stage}.json"


def validation_settings(run: RunSpec) -> str:
    """Hash of the validate settings; each report records it (a change revalidates every shard)."""
    return hash_json(run.validate.as_dict())


def write_stamps(run: RunSpec) -> None:
    """Rewrite each provenance stamp whose content changed (mtime moves only then)."""
    from .atomic import write_json_if_changed

    # No fsync: a stamp lost in a crash is rewritten at the next parse, and freshness is
    # decided by the hash the outputs record, not by the stamp surviving.
    write_json_if_changed(TOY_STAMP, toy_target_settings(run), durable=False)
    write_json_if_changed(PREPARE_STAMP, {"provenance": prepare_provenance(run)}, durable=False)
    for stage, settings in stage_settings(run).items():
        write_json_if_changed(stage_stamp(stage), {"settings": settings}, durable=False)
    provenances = _shard_provenances(run)
    for shard in shards(run):
        write_json_if_changed(shard_stamp(shard), {"provenance": provenances[shard]}, durable=False)
    if regeneration_enabled(run):
        for shard, provenance in _regeneration_provenances(run).items():
            write_json_if_changed(
                regeneration_stamp(shard), {"provenance": provenance}, durable=False
            )


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

VALIDATION_STAMP_DIR = PROVENANCE_DIR / "validate"
VALIDATION_CACHE = Path(".eaglepipe/cache/validations.json")


def validation_stamp(shard: str) -> Path:
    return VALIDATION_STAMP_DIR / f"{shard}.json"


def validation_report_path(shard: str) -> str:
    return os.path.join(VALIDATED_DIR, f"{shard}.json")


def _identity_or_none(path: str | Path) -> list | None:
    try:
        return list(file_identity(path))
    except FileNotFoundError:
        return None


def _report_facts(manifest: str, report: str) -> dict:
    """What a validation report says of its shard: does it describe this manifest, under which
    validate settings. Unreadable reports describe nothing."""
    try:
        recorded = json.loads(Path(report).read_text())
        manifest_hash = recorded["manifest_xxh3_128"]
        settings = recorded.get("validation_settings")
    except (OSError, ValueError, KeyError, TypeError):
        return {"describes_manifest": False, "settings": None}
    return {"describes_manifest": manifest_hash == hash_file(manifest), "settings": settings}


def stale_validations(run: RunSpec, shard_names: list[str]) -> dict[str, str]:
    """`{shard: why}` for each shard whose validation report exists but is stale.

    Facts are cached by both files' identity (inode, size, mtime, ctime): a warm parse only
    stats 2 files per shard. Each stale shard's stamp is rewritten when what makes it stale
    changes, so its validate job sees a new input.
    """
    from .atomic import write_json_if_changed

    try:
        cache = json.loads(VALIDATION_CACHE.read_text())
    except (FileNotFoundError, ValueError):
        cache = {}
    settings = validation_settings(run)
    stale: dict[str, str] = {}
    new_cache: dict[str, dict] = {}
    for shard in shard_names:
        manifest, report = manifest_path(shard), validation_report_path(shard)
        key = [_identity_or_none(manifest), _identity_or_none(report)]
        if key[1] is None:
            continue  # no report: a target of `all` instead (incomplete_targets)
        if key[0] is None:
            # Set aside (`eaglepipe verify`, a damaged chunk) or deleted: its validate job reruns,
            # which makes Snakemake extract the shard first, whatever the targets.
            why = "its manifest is missing"
        else:
            facts = cache.get(shard)
            if not facts or facts.get("key") != key:
                facts = {"key": key, **_report_facts(manifest, report)}
            new_cache[shard] = facts
            why = None
            if not facts["describes_manifest"]:
                why = "its manifest changed after it was validated"
            elif facts["settings"] != settings:
                why = "the validate settings changed"
        if why is None:
            continue
        stale[shard] = why
        write_json_if_changed(
            validation_stamp(shard), {"why": why, "files": key, "settings": settings}, durable=False
        )
    if new_cache != cache:
        write_json_if_changed(VALIDATION_CACHE, new_cache, durable=False)
    return stale


def incomplete_targets(shard_names: list[str], *, regenerate: bool = False) -> list[str]:
    """Missing per-shard files whose consumers exist, as extra targets of `all`."""
    from .config import DRAFTER_DIR, PREPARED_SUMMARY

    trained = (DRAFTER_DIR / "model.safetensors").exists()
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
    from .config import PREPARED_SUMMARY

    return _recorded_provenance(PREPARED_SUMMARY) == prepare_provenance(run)


def shard_is_fresh(run: RunSpec, shard: str) -> bool:
    return shard_freshness(run)(shard)


def shard_freshness(run: RunSpec) -> Callable[[str], bool]:
    """`shard_is_fresh` for one config, as a function of the shard name.

    The extract rule's input function asks once per shard job; this hashes the config and
    looks up the shard provenances once, and reads each manifest only when its job is built.
    """
    provenances = _shard_provenances(run)

    def is_fresh(shard: str) -> bool:
        current = provenances.get(shard)
        if current is None:
            raise _not_in_plan(run, shard)
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


def print_space_plan(run: RunSpec) -> None:
    """At workflow start: will the shards still to extract fit on the output filesystem?"""
    from .config import PREPARED_SUMMARY
    from .shard_store import plan_bytes, space_summary

    if not PREPARED_SUMMARY.exists() or not run.model.exists:
        return
    remaining = set(remaining_shards(run))
    if not remaining:
        return
    summary = json.loads(PREPARED_SUMMARY.read_text())
    tokens = [s["tokens"] for s in summary.get("shards", []) if s["shard"] in remaining]
    needed = plan_bytes(tokens, run.model.hidden_size)
    print(
        f"eaglepipe {__version__}: {len(remaining)} shard(s) to extract, {sum(tokens):,} tokens; "
        + space_summary(needed, HIDDEN_STATES_DIR),
        flush=True,
    )


def stop_server_started_by_this_run() -> None:
    from .server.lifecycle import stop_if_started_by

    stop_if_started_by(run_token())


__all__ = [
    "TOY_MODEL_DIR",
    "manifest_path",
    "model_config_file",
    "prepare_provenance",
    "print_space_plan",
    "run_token",
    "shard_provenance",
    "shards",
    "stop_server_started_by_this_run",
]

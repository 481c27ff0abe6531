"""Parse-time logic of the Snakemake workflow (rules/common.smk only wires these up).

Rerun policy. Snakemake's mtime trigger would re-extract every shard whenever the prepared
table is rewritten or the dataset file is touched; for multi-terabyte runs that is not
acceptable. Instead each data stage has a *provenance stamp*: a small JSON file under
`.eaglepipe/provenance/` holding everything its output depends on (model and tokenizer
fingerprints, aux layer ids, tokenization settings, the stored dtypes, the shard's own source
rows), rewritten at parse time only when that content changes. Outputs record the provenance
hash they were built from. A stage whose recorded hash equals the current one is *fresh*: its
inputs are wired as `ancient()`, so nothing upstream can trigger it. A stale stage gets plain
inputs, so it reruns (the dry run names its stamp as the updated input), and so does anything
downstream of it.

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

import json
import os
import sys
from functools import cache
from pathlib import Path

from ..core.config import REGENERATED_DIR
from ..core.errors import PipelineError
from ..core.fingerprint import file_identity, hash_file, hash_json
from ..core.run import RunSpec
from ..data.dataset import bad_row_error
from ..data.loss_counts import check_unusable_rows
from .shard_plan import (
    check_holdout,
    count_source_rows,
    plan_for_source,
    planned_near,
    shard_source_digests,
    source_bad_rows,
    source_cut,
)


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
    return [s.name for s in plan_for_source(_dataset_path(run), run.shards.rows_per_shard)]


def check_shard_plan(run: RunSpec) -> None:
    """What the shard plan makes plainly wrong, refused when the workflow starts (not after a
    toy target's build or every shard's regeneration): a dataset without a row, a JSON array
    cut off under `bad_rows: error`, more unusable rows than `dataset.unusable_limit.rows`, and
    a held-out split that names shards not in the plan or leaves evaluation or training without
    a row. A cut-off array under `skip` is named in one line and its whole records used."""
    path = _dataset_path(run)
    rows = count_source_rows(path)
    cut = source_cut(path)
    if cut is not None:
        if run.dataset.bad_rows == "error":
            raise PipelineError(
                f"{cut.describe()} (set dataset.bad_rows: skip to use the whole records)"
            )
        print(f"eaglepipe: warning: {cut.describe()}; they are used", file=sys.stderr, flush=True)
    if rows == 0:
        raise PipelineError(f"dataset.path {path} has no rows: there is nothing to extract")
    # Else the first regenerate (or prepare) job to reach a bad row stops, hours into a run;
    # under skip, one that drops every row, or every held-out one, stops evaluation after it.
    bad = source_bad_rows(path, run.dataset.format, run.dataset.turn_order)
    if bad.first is not None and run.dataset.bad_rows == "error":
        raise bad_row_error(path, bad.first)
    if len(bad.row_ids) == rows:
        raise PipelineError(
            f"dataset.path {path}: all {rows} rows are bad rows that dataset.bad_rows: skip "
            f"drops, the first: {bad.first.describe(path)}; check dataset.format "
            f"({run.dataset.format}) and the file"
        )
    check_unusable_rows(path, rows, bad.reasons, run.dataset.unusable_limit)
    check_holdout(run.dataset.holdout, rows, run.shards.rows_per_shard, bad.row_ids)


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
        "turn_order": dataset.turn_order,
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


def not_in_plan_error(run: RunSpec, shard: str) -> PipelineError:
    """The error for a shard name the plan does not hold, naming the plan's nearest shards."""
    planned = plan_for_source(_dataset_path(run), run.shards.rows_per_shard)
    return PipelineError(
        f"shard {shard} is not in the plan of {run.dataset.path} with "
        f"shards.rows_per_shard={run.shards.rows_per_shard}: {planned_near(shard, planned)}"
    )


def require_planned(run: RunSpec, shard: str) -> None:
    """A shard name the plan does not hold, refused naming the plan (not its missing files)."""
    if shard not in shards(run):
        raise not_in_plan_error(run, shard)


def shard_provenance(run: RunSpec, shard: str) -> str:
    """Hash of everything a shard's hidden states depend on; a change makes only it stale."""
    shared, digests = _shard_provenance_inputs(run)
    if shard not in digests:
        raise not_in_plan_error(run, shard)
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
        if not run.extract.store.is_default:
            # What the shard stores (changing it re-extracts); absent for bf16, so a bf16
            # shard stays as fresh as it was before stores could differ.
            shared["store"] = run.extract.store.as_dict()
        _PROVENANCE_MEMO[config_key] = (shared, digests)
    return _PROVENANCE_MEMO[config_key]


def shard_source_rows_digest(run: RunSpec, shard: str) -> str:
    """The xxh3-128 of a shard's raw source rows (`shard_plan.shard_source_digests`)."""
    _, digests = _shard_provenance_inputs(run)
    if shard not in digests:
        raise not_in_plan_error(run, shard)
    return digests[shard]


def shard_provenances(run: RunSpec) -> dict[str, str]:
    """`shard_provenance` of every planned shard."""
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
        # Which turns of a source row are regenerated.
        "turn_order": dataset.turn_order,
        "trust_remote_code": run.model.trust_remote_code,
    }


_REGENERATION_MEMO: dict[str, dict[str, str]] = {}


def regeneration_provenances(run: RunSpec) -> dict[str, str]:
    """`regeneration_provenance` of every planned shard, computed once per configuration."""
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
    provenances = regeneration_provenances(run)
    if shard not in provenances:
        raise not_in_plan_error(run, shard)
    return provenances[shard]


def regenerated_facts(shard_names: list[str]) -> dict[str, dict | None]:
    """What each regenerated manifest records (`workflow` provenance, rows checksum), or None
    when it is missing or unreadable. Cached by the manifest's identity: a warm parse only stats."""
    from ..core.atomic import write_json_if_changed

    try:
        cache = json.loads(REGENERATION_CACHE.read_text())
    except (FileNotFoundError, ValueError):
        cache = {}
    facts: dict[str, dict | None] = {}
    updated = dict(cache)
    for shard in shard_names:
        path = regenerated_manifest_path(shard)
        identity = identity_or_none(path)
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


def regenerated_contents(run: RunSpec, shard_names: list[str]) -> dict[str, dict]:
    """Per shard, what its regenerated rows are: their checksum while the regenerated shard is
    fresh, else that it is still to be regenerated (so anything built on it is stale)."""
    provenances = regeneration_provenances(run)
    facts = regenerated_facts(shard_names)
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
    from ..core.atomic import write_json_if_changed

    # No fsync: a stamp lost in a crash is rewritten at the next parse, and freshness is
    # decided by the hash the outputs record, not by the stamp surviving.
    write_json_if_changed(TOY_STAMP, toy_target_settings(run), durable=False)
    write_json_if_changed(PREPARE_STAMP, {"provenance": prepare_provenance(run)}, durable=False)
    for stage, settings in stage_settings(run).items():
        write_json_if_changed(stage_stamp(stage), {"settings": settings}, durable=False)
    provenances = shard_provenances(run)
    for shard in shards(run):
        write_json_if_changed(shard_stamp(shard), {"provenance": provenances[shard]}, durable=False)
    if regeneration_enabled(run):
        for shard, provenance in regeneration_provenances(run).items():
            write_json_if_changed(
                regeneration_stamp(shard), {"provenance": provenance}, durable=False
            )


def identity_or_none(path: str | Path) -> list | None:
    """The file's identity (`file_identity`) as a list, or None when it is missing."""
    try:
        return list(file_identity(path))
    except FileNotFoundError:
        return None

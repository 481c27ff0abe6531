"""provenance: the manifest's model and tokenizer hashes, layer ids, conventions and stored
dtypes equal the current run's (its rows are checked by coverage, as the rerun policy decides
per shard): a shard of another store than `extract.store` never passes."""

from __future__ import annotations

import json
from pathlib import Path

from ..core import config as cfg
from ..core.errors import PipelineError
from ..core.hidden_store import HiddenStore
from ..core.layers import CONVENTION, FINAL_CONVENTION
from ..core.run import RunSpec
from .checks import PROVENANCE_FIELDS, ValidationFailure
from .schema import manifest_store


def expected_provenance(run: RunSpec, summary_path: Path = cfg.PREPARED_SUMMARY) -> dict:
    """The provenance the current configuration would give a freshly extracted shard."""
    try:
        summary = json.loads(Path(summary_path).read_text())
    except FileNotFoundError:
        raise PipelineError(
            f"prepared summary {summary_path} does not exist: run prepare"
        ) from None
    summary_provenance = summary.get("provenance", summary)
    model = run.model
    if model.has_tokenizer:
        tokenizer = model.tokenizer_fingerprint
    else:
        tokenizer = summary_provenance.get("tokenizer_fingerprint")
    return {
        "model_config_hash": model.config_hash,
        "tokenizer_fingerprint": tokenizer,
        "aux_layer_ids": run.aux_layer_ids,
        "layer_convention": CONVENTION,
        "final_convention": FINAL_CONVENTION,
        "stored_dtypes": run.extract.store.manifest_dtypes(),
    }


def check_provenance(shard: str, manifest: dict, expected: dict) -> dict:
    """Every provenance field equals the current configuration's, naming the first that differs."""
    recorded = dict(manifest["provenance"])
    stored_ids = manifest["aux_layer_ids"]
    if stored_ids != recorded.get("aux_layer_ids"):
        raise ValidationFailure(
            shard,
            "provenance",
            f"manifest aux_layer_ids {stored_ids} disagree with its provenance.aux_layer_ids "
            f"{recorded.get('aux_layer_ids')}",
        )
    _check_store(shard, manifest, recorded, expected["stored_dtypes"])
    for name in PROVENANCE_FIELDS:
        if recorded.get(name) != expected[name]:
            raise ValidationFailure(
                shard,
                "provenance",
                f"field {name} is {recorded.get(name)!r} in the manifest but {expected[name]!r} "
                "for the current configuration (the shard was made from another "
                f"{'layer set' if name == 'aux_layer_ids' else 'model or tokenizer'}; "
                "re-extract it)",
            )
    return {"ok": True, "fields": [*PROVENANCE_FIELDS, "stored_dtypes"]}


def _check_store(shard: str, manifest: dict, recorded: dict, expected: dict) -> None:
    """The store the manifest lists its chunks in is the one the shard was extracted with
    (absent in both: bf16, from before stores could differ), and the configured one."""
    listed = manifest_store(shard, manifest).manifest_dtypes()
    extracted = recorded.get("stored_dtypes") or HiddenStore().manifest_dtypes()
    if listed != extracted:
        raise ValidationFailure(
            shard,
            "provenance",
            f"manifest stored_dtypes {listed} disagree with its provenance.stored_dtypes "
            f"{extracted}",
        )
    if extracted != expected:
        raise ValidationFailure(
            shard,
            "provenance",
            f"the shard stores {extracted}, the current configuration (extract.store) stores "
            f"{expected}: one run never mixes stores; re-extract it",
        )

"""Validating the pipeline configuration, and the resolved copy a run writes for its jobs (config
files are read in `config_files.py`; `run.py` resolves the result).

The schema in schemas/config.schema.yaml is the single description of every key: its types,
bounds and defaults. The Snakefile validates `config` with it at workflow start and resolves it
into the run description (`eaglepipe.core.run`), whose resolved copy is written to
`.eaglepipe/config.json`, so a job sees exactly the configuration its run parsed. Beside it,
`config.json.validated` ties its bytes to the schema that validated them: a job that reads an
unchanged copy under an unchanged schema skips validating it again, and with it the import of
jsonschema and yaml (a sixth of an extraction job's imports before its first request): so
both are imported where they are used, and config files (YAML) are read in
`eaglepipe.core.config_files`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import PipelineError

if TYPE_CHECKING:
    import jsonschema

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = PROJECT_ROOT / "schemas" / "config.schema.yaml"
RESOLVED_CONFIG = Path(".eaglepipe/config.json")
# The config the Snakefile loads first (`configfile:`), relative to the run's directory.
WORKFLOW_CONFIG = Path("config.yaml")

# Where each stage writes, relative to the working directory of the run.
TOY_MODEL_DIR = Path("models/toy-target")
TOY_MODEL_CONFIG = TOY_MODEL_DIR / "config.json"
PREPARED_DIR = Path("prepared")
PREPARED_TABLE = PREPARED_DIR / "tokenized.parquet"
PREPARED_SUMMARY = PREPARED_DIR / "summary.json"
PREPARED_SKIPPED = PREPARED_DIR / "skipped.json"
HIDDEN_STATES_DIR = Path("hidden_states")
REGENERATED_DIR = Path("regenerated")
REGENERATION_SUMMARY = REGENERATED_DIR / "summary.json"
VALIDATED_DIR = Path("validated")
DRAFTER_DIR = Path("drafter")
DRAFT_VOCAB = DRAFTER_DIR / "vocab.safetensors"
DRAFTER_MODEL = DRAFTER_DIR / "model.safetensors"
TRAIN_LOG = DRAFTER_DIR / "train_log.jsonl"
TRAIN_CHECKPOINTS = DRAFTER_DIR / "checkpoints"
EVAL_REPORT = DRAFTER_DIR / "eval.json"
EVAL_PLOT = DRAFTER_DIR / "eval.png"
LIVE_REPORT = DRAFTER_DIR / "live.json"
# One directory per engine (`export.engines`), each holding EXPORT_FILES.
EXPORT_DIR = DRAFTER_DIR / "export"
EXPORT_FILES = ("config.json", "model.safetensors")
REPORT_DIR = Path("report")
LOG_DIR = Path("logs")
STATE_DIR = Path(".eaglepipe")


def load_schema() -> dict:
    import yaml

    # libyaml's loader when pyyaml has it: the same result, a quarter of the time (a job whose
    # resolved config is no longer sealed validates it before its first request).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(SCHEMA_PATH.read_text(), Loader=loader)


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    if error.validator == "additionalProperties":
        # jsonschema reports the parent; name the offending key itself.
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        parts.append(",".join(extra))
    if error.validator == "required":
        parts.append(error.message.split("'")[1])
    return ".".join(parts) or "<top level>"


def _is_integer(checker, instance) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


def _strict_validator(schema: dict):
    """The schema's validator, except that `integer` means an int: JSON Schema also counts a
    whole float (`epochs: 8.0`), which passed the check and then failed a job with a traceback
    (and, hashed as a float, made every shard of an unchanged setting stale)."""
    import jsonschema

    base = jsonschema.validators.validator_for(schema)
    checker = base.TYPE_CHECKER.redefine("integer", _is_integer)
    return jsonschema.validators.extend(base, type_checker=checker)(schema)


def validate_config(config: dict) -> dict:
    """Check `config` against the schema, fill defaults, and return it.

    Raises PipelineError naming the offending key, e.g. `config key shards.rows_per_shard: ...`.
    """
    import jsonschema

    schema = load_schema()
    errors = sorted(_strict_validator(schema).iter_errors(config), key=lambda e: e.path)
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        raise PipelineError(f"config key {_key_path(error)}: {error.message}{_hint(error)}")
    resolved = copy.deepcopy(config)
    _fill_defaults(resolved, schema)
    return resolved


def _hint(error: jsonschema.ValidationError) -> str:
    """What to write instead, where the schema's own message does not say: the key's `x-hint`
    in the schema, or, for a number that arrives as text, its spelling that works (YAML 1.1,
    PyYAML's and Snakemake's, reads an exponent without a dot, `3e-4`, as a string)."""
    if error.schema.get("x-hint"):
        return f" ({error.schema['x-hint']})"
    value, wanted = error.instance, error.validator_value
    wanted = [wanted] if isinstance(wanted, str) else wanted or []
    if error.validator != "type" or not isinstance(value, str) or "number" not in wanted:
        return ""
    mantissa, _, exponent = value.strip().lower().partition("e")
    try:
        number = float(value)
    except ValueError:
        return ""
    if not exponent or "." in mantissa:
        return ""
    return f" (YAML reads {value} as text: write {mantissa}.0e{exponent} or {number!r})"


def _fill_defaults(node: dict, schema: dict) -> None:
    properties = schema.get("properties", {})
    for key, sub in properties.items():
        if key not in node and "default" in sub:
            node[key] = copy.deepcopy(sub["default"])
        if isinstance(node.get(key), dict) and sub.get("type") == "object":
            _fill_defaults(node[key], sub)
    # A mapping of user-named entries (benchmarks.run): each entry gets its schema's defaults.
    entry = schema.get("additionalProperties")
    if isinstance(entry, dict) and entry.get("type") == "object":
        for key, value in node.items():
            if key not in properties and isinstance(value, dict):
                _fill_defaults(value, entry)


def merge_config(base: dict, override: dict) -> dict:
    """`override` over `base`, section by section, as Snakemake merges its config files."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def text_config(model_config: dict) -> dict:
    """The language-model part of a config (multimodal wrappers such as Kimi-K2.5 nest it)."""
    return model_config.get("text_config") or model_config


def _seal_path(path: Path) -> Path:
    return path.with_name(path.name + ".validated")


def _seal(config_bytes: bytes) -> str:
    """What ties a resolved config's bytes to the schema that validated them (the project's
    content hash: it detects a change, which is all a seal is for)."""
    from .fingerprint import hash_bytes

    return hash_bytes(SCHEMA_PATH.read_bytes() + b"\0" + config_bytes)


def write_resolved(config: dict, path: str | os.PathLike = RESOLVED_CONFIG) -> Path:
    """Write `config`, validated (defaults filled), for the run's jobs, and seal it (each file
    only when its content changes)."""
    from .atomic import write_if_changed, write_json_if_changed

    path = Path(path)
    write_json_if_changed(path, validate_config(config))
    write_if_changed(_seal_path(path), _seal(path.read_bytes()).encode())
    return path


def read_resolved(path: str | os.PathLike = RESOLVED_CONFIG) -> dict:
    from .jsonio import read_json_object_bytes

    path = Path(path)
    if not path.exists():
        raise PipelineError(
            f"resolved config {path} is missing: run the step through snakemake, "
            "or pass --config config.yaml"
        )
    # Written by the workflow: a damaged one is a hand edit or a torn copy.
    repair = f"delete {path} (config.yaml is then used) or rerun snakemake, which writes it again"
    try:
        config, raw = read_json_object_bytes(path, what="resolved config")
    except PipelineError as exc:
        raise PipelineError(f"{exc}: {repair}") from None
    seal = _seal_path(path)
    if seal.is_file() and seal.read_bytes() == _seal(raw).encode():
        return config  # validated as it is, by this schema, when it was written
    try:
        return validate_config(config)
    except PipelineError as exc:
        raise PipelineError(f"resolved config {path}: {exc}: {repair}") from None

"""Loading and validating the pipeline configuration (the loader; `run.py` resolves it).

The schema in schemas/config.schema.yaml is the single description of every key: its types,
bounds and defaults. The Snakefile validates `config` with it at workflow start and resolves it
into the run description (`eaglepipe.core.run`), whose resolved copy is written to
`.eaglepipe/config.json`, so a job sees exactly the configuration its run parsed. Beside it,
`config.json.validated` ties its bytes to the schema that validated them: a job that reads an
unchanged copy under an unchanged schema skips validating it again, and with it the import of
jsonschema and yaml (a sixth of an extraction job's imports before its first request). Those
two are imported where they are used for that reason.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
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
PREPARED_DIR = Path("prepared")
PREPARED_TABLE = PREPARED_DIR / "tokenized.parquet"
PREPARED_SUMMARY = PREPARED_DIR / "summary.json"
PREPARED_SKIPPED = PREPARED_DIR / "skipped.json"
HIDDEN_STATES_DIR = Path("hidden_states")
REGENERATED_DIR = Path("regenerated")
REGENERATION_SUMMARY = REGENERATED_DIR / "summary.json"
VALIDATED_DIR = Path("validated")
DRAFTER_DIR = Path("drafter")
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
    for key, sub in schema.get("properties", {}).items():
        if key not in node and "default" in sub:
            node[key] = copy.deepcopy(sub["default"])
        if isinstance(node.get(key), dict) and sub.get("type") == "object":
            _fill_defaults(node[key], sub)


# --- what Snakemake's command line hands over ----------------------------------------------------


def check_unique_keys(paths) -> None:
    """Every config file Snakemake loaded names each key once per mapping (Snakemake's own
    loader keeps the last of two silently)."""
    import yaml

    from .config_yaml import DuplicateKeyError, read_config_yaml

    for path in paths:
        try:
            read_config_yaml(path)
        except DuplicateKeyError as exc:
            raise PipelineError(f"config file {_as_typed(path)}: {exc}") from None
        except (OSError, yaml.YAMLError):
            continue  # Snakemake read it; its own error is the better one


def _as_typed(path) -> str:
    """`path` as the user typed it (Snakemake made it absolute)."""
    shown = os.path.relpath(path)
    return str(path) if shown.startswith("..") else shown


def check_config_files(paths) -> None:
    """Every file given with `--configfile` must be a config: a mapping of config sections.

    Snakemake merges them before the workflow sees the result, so an unknown key would be
    reported without the file that holds it; a target written after `--configfile f.yaml` is
    the usual way to get one (Snakemake reads it as a second config file).
    """
    import yaml

    sections = set(load_schema()["properties"])
    for path in paths:
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue  # Snakemake read it; its own error is the better one
        if isinstance(raw, dict) and set(raw) <= sections:
            continue
        shown = _as_typed(path)
        unknown = sorted(map(str, set(raw) - sections)) if isinstance(raw, dict) else []
        guesses = [difflib.get_close_matches(key, sections, n=1) for key in unknown]
        if unknown and set(raw) & sections and all(guesses):
            # Known sections and near-misses of others: a misspelt config, not a target.
            named = ", ".join(
                f"{key} (did you mean {guess[0]}?)"
                for key, guess in zip(unknown, guesses, strict=True)
            )
            raise PipelineError(
                f"--configfile {shown}: unknown config section {named} "
                f"(known: {', '.join(sorted(sections))})"
            )
        if isinstance(raw, dict):
            unknown = ", ".join(sorted(map(str, set(raw) - sections)))
            what = f"its keys {unknown} are no config sections"
        else:
            what = f"it holds a {type(raw).__name__}, not a mapping of config sections"
        raise PipelineError(
            f"--configfile {shown}: {what} (known: {', '.join(sorted(sections))}). If it is a "
            "target, not a config file: Snakemake's --configfile takes every word after it as "
            "one more config file, so write the targets first (`snakemake "
            f"{shown} --configfile FILE`) or end the config files with `--` (`snakemake "
            f"--configfile FILE -- {shown}`)"
        )


def type_command_line_values(config: dict, command_line: dict) -> None:
    """Give the values set with `--config` the types the schema wants, in place.

    Snakemake reads `--config server='{port: 31000}'` with YAML's base loader, so every value
    inside a section arrives as a string ('31000'); each such string where the schema expects
    no string is read again as YAML. (`--config server.port=31000` never reaches the workflow:
    Snakemake's own parser refuses a dotted key.)
    """
    _type_values(config, command_line, load_schema())


# YAML's spellings of null (the core schema's), which Snakemake's `--config` hands over as text.
YAML_NULLS = frozenset({"null", "Null", "NULL", "~"})


def _type_values(target: dict, given: dict, schema: dict) -> None:
    properties = schema.get("properties", {})
    for key in given:
        if key in target and key in properties:  # else validation names the unknown key
            target[key] = _typed(target[key], given[key], properties[key])


def _typed(value, given, schema: dict):
    """`value` (merged config) typed where it came from the command line (`given`)."""
    if isinstance(value, dict) and isinstance(given, dict):
        _type_values(value, given, schema)
        return value
    if isinstance(value, list):
        items = schema.get("items", {})
        return [_typed(item, item, items) for item in value]
    if not isinstance(value, str):
        return value
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if "null" in types and value in YAML_NULLS:
        return None  # as `key: null` (or `~`) in a config file reads
    if "string" in types or not types:
        return value
    import yaml

    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return value if isinstance(parsed, str) else parsed


def load_config(path: str | os.PathLike, *, base: str | os.PathLike | None = None) -> dict:
    """Read a YAML or JSON config file and validate it. With `base` (a config file that
    exists), the file is read as `snakemake --configfile` reads it: over `base`, so the
    sections and keys it leaves out keep `base`'s."""
    raw = _read_config_mapping(path)
    if base is not None:
        raw = merge_config(_read_config_mapping(base), raw)
    return validate_config(raw)


def _read_config_mapping(path: str | os.PathLike) -> dict:
    """A config file's mapping; anything else is one PipelineError naming the file."""
    import yaml

    from .config_yaml import DuplicateKeyError, read_config_yaml

    path = Path(path)
    try:
        raw = read_config_yaml(path)
    except FileNotFoundError:
        raise PipelineError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise PipelineError(f"config file {path} is a directory, not a config file") from None
    except DuplicateKeyError as exc:
        raise PipelineError(f"config file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise PipelineError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise PipelineError(f"config file {path} must hold a mapping of keys")
    return raw


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
    """What ties a resolved config's bytes to the schema that validated them."""
    digest = hashlib.sha256(SCHEMA_PATH.read_bytes())
    digest.update(b"\0")
    digest.update(config_bytes)
    return digest.hexdigest()


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
    if seal.is_file() and seal.read_text() == _seal(raw):
        return config  # validated as it is, by this schema, when it was written
    try:
        return validate_config(config)
    except PipelineError as exc:
        raise PipelineError(f"resolved config {path}: {exc}: {repair}") from None


def config_from_arg(path: str | os.PathLike) -> dict:
    """What a script's or `eaglepipe`'s `--config` names: the resolved JSON the workflow wrote,
    or a config file as `snakemake --configfile` takes one (YAML or JSON): read over the
    working directory's config.yaml, which the Snakefile loads first, so one that sets only a
    few keys describes the same run as the workflow does."""
    path = Path(path)
    if path.suffix == ".json" and path.resolve() == RESOLVED_CONFIG.resolve():
        return read_resolved(path)
    base = WORKFLOW_CONFIG
    if not base.is_file() or base.resolve() == path.resolve():
        base = None
    return load_config(path, base=base)

"""Config files as Snakemake reads them (YAML; JSON is YAML too): a key given twice in one
mapping refused, `--configfile` files that are no configs named, `--config` values typed by the
schema, and a file read over the workflow's config.yaml and validated (`load_config`).

Apart from eaglepipe.core.config so that a job, which reads the resolved JSON its run wrote
(sealed, so not validated again), imports neither yaml nor jsonschema before its first request.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import yaml

from .config import load_schema, merge_config, validate_config
from .errors import PipelineError


class DuplicateKeyError(yaml.YAMLError):
    """A config file names one key twice in one mapping (`_UniqueKeyLoader`)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice: the plain loader keeps
    the last one, and a second `train:` section would silently drop the first one's settings."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges are meant to be overridden
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(
                    f"key {key} appears twice in one mapping (lines {seen[key]} and {line}): "
                    "YAML keeps only the last, and the settings under the first would be lost; "
                    "merge them into one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_config_yaml(path: str | os.PathLike):
    """A config file's YAML (JSON is YAML too); a key given twice in one mapping is an error."""
    return yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)


# --- what Snakemake's command line hands over ----------------------------------------------------


def check_config_files(config_files, loaded_files=()) -> None:
    """Every config file Snakemake loaded (`loaded_files`, the Snakefile's `configfile:` too)
    names each key once per mapping (Snakemake's own loader keeps the last of two silently),
    and every file given with `--configfile` (`config_files`) is a config: a mapping of config
    sections. Each file is read once.

    Snakemake merges the files before the workflow sees the result, so an unknown key would be
    reported without the file that holds it; a target written after `--configfile f.yaml` is
    the usual way to get one (Snakemake reads it as a second config file).
    """
    parsed = {}
    for path in dict.fromkeys(map(os.path.abspath, [*loaded_files, *config_files])):
        try:
            parsed[path] = read_config_yaml(path)
        except DuplicateKeyError as exc:
            raise PipelineError(f"config file {_as_typed(path)}: {exc}") from None
        except (OSError, yaml.YAMLError):
            continue  # Snakemake read it; its own error is the better one
    sections = set(load_schema()["properties"])
    for path in map(os.path.abspath, config_files):
        if path not in parsed:
            continue
        raw = parsed[path]
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


def _as_typed(path) -> str:
    """`path` as the user typed it (Snakemake made it absolute)."""
    shown = os.path.relpath(path)
    return str(path) if shown.startswith("..") else shown


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

"""The one reader of every benchmark's prompts: a JSONL file, gzip-compressed or not, whose rows
hold a prompt (a string, or a list of user turns), a category and an id under configured field
names (FastChat's MT-bench `question.jsonl` is one such file: `turns`, `category`,
`question_id`).

What is read is checked against what the benchmark must hold (row count, sha256 of the file as
stored) before anything is scored, so a changed file is named instead of silently scored. A
malformed row follows `dataset.bad_rows`: the stage stops naming the file and line, or skips the
row and lists it in the results.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import PipelineError
from ..core.run import BenchmarkSettings
from ..data.dataset import BadRow, bad_row_error
from .known import KNOWN_BENCHMARKS

GZIP_MAGIC = b"\x1f\x8b"
NO_CATEGORY = "all"
BAD_JSON = "not a JSON object"
MISSING_FIELD = "missing field"
BAD_PROMPT = "prompt is not a string or a list of strings"
EMPTY_PROMPT = "empty prompt"
DUPLICATE_ID = "duplicate id"


@dataclass(frozen=True)
class PromptSource:
    """Where one configured benchmark's prompts come from and how they are read."""

    name: str
    path: Path
    prompt_field: str
    category_field: str | None
    id_field: str | None
    sha256: str | None  # what the file must hash to, None: not checked
    count: int | None  # how many rows it must hold, None: not checked
    how_to_get: str

    def key(self, what: str) -> str:
        return f"benchmarks.run.{self.name}.{what}"


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: its user turns, asked one after the other."""

    index: int  # position among the prompts read, in file order
    id: str
    category: str
    turns: tuple[str, ...]
    line: int


@dataclass
class PromptSet:
    source: PromptSource
    prompts: list[BenchPrompt]  # the subset measured
    rows: int  # rows in the file
    sha256: str
    skipped: list[dict] = field(default_factory=list)  # bad rows under dataset.bad_rows: skip

    @property
    def categories(self) -> list[str]:
        return list(dict.fromkeys(p.category for p in self.prompts))

    @property
    def prompts_by_index(self) -> dict[int, BenchPrompt]:
        return {p.index: p for p in self.prompts}


def prompt_source(benchmark: BenchmarkSettings) -> PromptSource:
    """The benchmark's file and fields: a known benchmark's own, with what the config sets over
    them; any other name must give a path and the prompt field."""
    known = KNOWN_BENCHMARKS.get(benchmark.name)
    fields = benchmark.fields
    if known is None:
        if benchmark.path is None:
            raise PipelineError(
                f"config key benchmarks.run.{benchmark.name}: unknown benchmark "
                f"{benchmark.name!r} (known: {', '.join(sorted(KNOWN_BENCHMARKS))}); another "
                "name needs a path (a JSONL prompt file) and fields.prompt"
            )
        if fields.prompt is None:
            raise PipelineError(
                f"config key benchmarks.run.{benchmark.name}.fields.prompt: name the field of "
                f"{benchmark.path} that holds the prompt (a string or a list of turns)"
            )
    return PromptSource(
        name=benchmark.name,
        path=Path(benchmark.path or known.path),
        prompt_field=fields.prompt or known.prompt_field,
        category_field=fields.category or (known.category_field if known else None),
        id_field=fields.id or (known.id_field if known else None),
        sha256=benchmark.sha256 or (known.sha256 if known else None),
        count=benchmark.count or (known.count if known else None),
        how_to_get=known.how_to_get if known else f"set benchmarks.run.{benchmark.name}.path",
    )


def require_file(source: PromptSource) -> None:
    """A missing or unsupported prompt file, named with its key and how to get it."""
    path, key = source.path, source.key("path")
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise PipelineError(
            f"config key {key}: the prompt file {path} of benchmark {source.name!r} {what}; "
            f"to get it: {source.how_to_get}"
        )
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        raise PipelineError(
            f"config key {key}: {path} is not a JSONL prompt file (.jsonl or .jsonl.gz)"
        )


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of every non-blank line; gzip is recognised by its magic."""
    with open(path, "rb") as probe:
        compressed = probe.read(2) == GZIP_MAGIC
    opener = gzip.open if compressed else open
    try:
        with opener(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield number, line.rstrip(b"\r\n")
    except (OSError, EOFError) as exc:  # a truncated or corrupt gzip stream
        raise PipelineError(f"{path} cannot be read: {exc}") from None


def lookup(record: dict, dotted: str):
    """`record[a][b]` for the field name `a.b`; KeyError when a part is missing."""
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def check_fields(source: PromptSource) -> None:
    """A mapping that names a field the file lacks, judged on its first row that is a JSON
    object (a malformed row is the reader's, under dataset.bad_rows)."""
    require_file(source)
    for _, line in iter_lines(source.path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        named = {"prompt": source.prompt_field, "category": source.category_field}
        named["id"] = source.id_field
        for what, name in named.items():
            if name is None:
                continue
            try:
                lookup(record, name)
            except KeyError:
                raise PipelineError(
                    f"config key {source.key('fields.' + what)}: {source.path} has no field "
                    f"{name!r} (its first row has {', '.join(sorted(record)) or 'no fields'})"
                ) from None
        return


def _turns(value) -> tuple[str, ...]:
    if isinstance(value, str):
        turns = (value,)
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        turns = tuple(value)
    else:
        raise ValueError(BAD_PROMPT)
    if not turns or not all(t.strip() for t in turns):
        raise ValueError(EMPTY_PROMPT)
    return turns


def parse_row(source: PromptSource, index: int, number: int, line: bytes) -> BenchPrompt:
    """One row as a prompt; ValueError (the reason, with its detail) when it cannot be one."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ValueError(BAD_JSON, str(exc)) from None
    if not isinstance(record, dict):
        raise ValueError(BAD_JSON, type(record).__name__)
    values = {}
    for what, name in (
        ("prompt", source.prompt_field),
        ("category", source.category_field),
        ("id", source.id_field),
    ):
        if name is None:
            continue
        try:
            values[what] = lookup(record, name)
        except KeyError:
            raise ValueError(MISSING_FIELD, name) from None
    try:
        turns = _turns(values["prompt"])
    except ValueError as exc:
        raise ValueError(str(exc), source.prompt_field) from None
    category = str(values.get("category", NO_CATEGORY))
    prompt_id = str(values["id"]) if "id" in values else f"line-{number}"
    return BenchPrompt(index, prompt_id, category, turns, number)


def read_prompts(source: PromptSource, *, bad_rows: str, per_category: int | None) -> PromptSet:
    """Every row of the prompt file, checked against the expected count and sha256, then the
    first `per_category` of each category (all when None)."""
    require_file(source)
    digest = hashlib.sha256()
    with open(source.path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    sha256 = digest.hexdigest()
    rows = sum(1 for _ in iter_lines(source.path))
    if source.count is not None and rows != source.count:
        raise PipelineError(
            f"{source.path} (benchmark {source.name!r}) holds {rows} rows, not the "
            f"{source.count} it must hold ({source.key('count')}); to get the original: "
            f"{source.how_to_get}"
        )
    if source.sha256 is not None and sha256 != source.sha256:
        raise PipelineError(
            f"{source.path} (benchmark {source.name!r}) has sha256 {sha256}, not the "
            f"{source.sha256} it must have ({source.key('sha256')}): a changed file is not "
            f"scored as {source.name}; to get the original: {source.how_to_get}"
        )
    prompts: list[BenchPrompt] = []
    skipped: list[dict] = []
    seen: set[str] = set()
    for row_id, (number, line) in enumerate(iter_lines(source.path)):
        try:
            prompt = parse_row(source, len(prompts), number, line)
            if prompt.id in seen:
                raise ValueError(DUPLICATE_ID, prompt.id)
        except ValueError as exc:
            reason, *detail = exc.args
            bad = BadRow(row_id, reason, ": ".join(str(d) for d in detail), number)
            if bad_rows != "skip":
                raise bad_row_error(source.path, bad) from None
            skipped.append({"line": number, "reason": reason, "detail": bad.detail})
            print(f"skipped: {bad.describe(source.path)}", flush=True)
            continue
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise PipelineError(f"{source.path} (benchmark {source.name!r}) holds no usable prompt")
    return PromptSet(source, subset(prompts, per_category), rows, sha256, skipped)


def subset(prompts: list[BenchPrompt], per_category: int | None) -> list[BenchPrompt]:
    """The first `per_category` prompts of each category, in file order."""
    if per_category is None:
        return list(prompts)
    taken: dict[str, int] = {}
    chosen = []
    for prompt in prompts:
        if taken.get(prompt.category, 0) < per_category:
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            chosen.append(prompt)
    return chosen

"""Reading conversation datasets (JSONL or Parquet; ShareGPT or OpenAI style) into one form.

Every row becomes a list of `{"role", "content"}` messages with roles `system`, `user` and
`assistant`. Row ids are the 0-based index of the row among the file's data rows: for JSONL,
blank lines are not rows, so the id is the index among non-blank lines; for Parquet, the row
index. The same definition drives the shard plan (`shard_plan.count_source_rows`), so a row
keeps its id and its shard whatever happens to the rows around it.

A row that cannot be used is not an exception by itself: `iter_rows` yields a `BadRow`
naming the row and the problem, and the caller decides (stop with `bad_row_error`, or count
and skip). The problems are short fixed reasons, so skipped rows can be counted per reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import PipelineError
from ..core.fingerprint import hash_file

FORMATS = ("auto", "sharegpt", "openai")

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}

# The fixed reasons a row is bad (skipped.json counts rows per reason).
INVALID_JSON = "invalid JSON"
NOT_AN_OBJECT = "row is not an object"
NO_KNOWN_KEY = "no known key"
MALFORMED_CONVERSATION = "malformed conversation"
EMPTY_CONVERSATION = "empty conversation"
MALFORMED_MESSAGE = "malformed message"
UNKNOWN_ROLE = "unknown role"
NON_STRING_CONTENT = "non-string content"
# A lone surrogate (JSON's "\ud800" escape) decodes to a str no tokenizer can encode.
UNENCODABLE_CONTENT = "content not encodable as UTF-8"
EMPTY_ASSISTANT_REPLY = "empty assistant reply"
TURN_ORDER = "turns out of order"
NO_ASSISTANT_TURN = "no assistant turn"
# Found while tokenizing (eaglepipe.data.chat_mask), listed here so all reasons live in one place.
NO_ASSISTANT_TOKENS = "no assistant tokens"
ASSISTANT_TRUNCATED = "assistant tokens truncated away"
TEMPLATE_ERROR = "chat template error"


class RowProblem(Exception):
    """Why one row cannot be used: a fixed `reason` plus a `detail` for the message."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Conversation:
    row_id: int
    messages: list[dict]
    line: int | None = None  # 1-based line number in a JSONL file
    # Ordinals (among the assistant turns) of regenerated replies cut at max_new_tokens.
    length_limited_turns: tuple[int, ...] = ()


@dataclass(frozen=True)
class BadRow:
    row_id: int
    reason: str
    detail: str = ""
    line: int | None = None  # 1-based line number in a JSONL file

    def where(self, path: str | os.PathLike) -> str:
        line = f" (line {self.line})" if self.line is not None else ""
        return f"{path} row {self.row_id}{line}"

    def describe(self, path: str | os.PathLike) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.where(path)}: {self.reason}{detail}"


def bad_row_error(path: str | os.PathLike, bad: BadRow) -> PipelineError:
    """The error the default policy (dataset.bad_rows: error) stops with."""
    return PipelineError(
        f"{bad.describe(path)} (set dataset.bad_rows: skip to skip and count such rows)"
    )


def dataset_hash(path: str | os.PathLike) -> str:
    return hash_file(path)


def source_kind(path: str | os.PathLike) -> str:
    """`jsonl` or `parquet`, from the file name."""
    name = str(path).lower()
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise PipelineError(f"dataset.path {path}: unsupported file type (expected .jsonl or .parquet)")


def _require_file(path: Path) -> None:
    if path.is_dir():
        raise PipelineError(f"dataset.path {path} is a directory, not a .jsonl or .parquet file")
    if not path.is_file():
        raise PipelineError(f"dataset.path {path} does not exist")


def iter_jsonl_lines(path: str | os.PathLike) -> Iterator[tuple[int, int, bytes]]:
    """(row_id, 1-based line number, raw line without its newline) for every non-blank line."""
    path = Path(path)
    _require_file(path)
    row_id = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            yield row_id, line_no, line.rstrip(b"\r\n")
            row_id += 1


def iter_parquet_records(path: str | os.PathLike, batch_size: int = 1024) -> Iterator[dict]:
    """Rows of a Parquet file as plain Python dicts, streamed in batches."""
    import pyarrow.parquet as pq

    path = Path(path)
    _require_file(path)
    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=batch_size):
            yield from batch.to_pylist()
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise PipelineError(f"dataset.path {path}: cannot read Parquet: {exc}") from None


def normalize_record(record: object, fmt: str = "auto") -> list[dict]:
    """One source row as `[{"role", "content"}, ...]`; raises RowProblem when it is unusable."""
    if fmt not in FORMATS:
        raise PipelineError(f"dataset.format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if not isinstance(record, dict):
        raise RowProblem(NOT_AN_OBJECT, f"got {type(record).__name__}")
    if fmt == "auto":
        # A key whose value is null names no format: exports that merge both formats (Parquet
        # especially) carry the other key empty.
        if record.get("conversations") is not None:
            fmt = "sharegpt"
        elif record.get("messages") is not None:
            fmt = "openai"
        elif "conversations" in record:
            fmt = "sharegpt"
        elif "messages" in record:
            fmt = "openai"
        else:
            keys = ", ".join(sorted(map(str, record))) or "none"
            raise RowProblem(
                NO_KNOWN_KEY, f"expected 'conversations' or 'messages', found keys: {keys}"
            )
    if fmt == "sharegpt":
        return _normalize(record, "conversations", "from", "value", SHAREGPT_ROLES)
    return _normalize(record, "messages", "role", "content", OPENAI_ROLES)


def _normalize(
    record: dict, list_key: str, role_key: str, content_key: str, roles: dict[str, str]
) -> list[dict]:
    if list_key not in record:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise RowProblem(NO_KNOWN_KEY, f"expected {list_key!r}, found keys: {keys}")
    turns = record[list_key]
    if turns is None or (isinstance(turns, list | tuple) and len(turns) == 0):
        raise RowProblem(EMPTY_CONVERSATION, f"{list_key!r} has no messages")
    if not isinstance(turns, list | tuple):
        raise RowProblem(
            MALFORMED_CONVERSATION, f"{list_key!r} is a {type(turns).__name__}, not a list"
        )
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise RowProblem(
                MALFORMED_MESSAGE,
                f"message {index} needs {role_key!r} and {content_key!r} keys",
            )
        role = turn[role_key]
        if not isinstance(role, str) or role.lower() not in roles:
            raise RowProblem(
                UNKNOWN_ROLE,
                f"message {index} has role {role!r} (known: {', '.join(sorted(roles))})",
            )
        content = turn[content_key]
        if not isinstance(content, str):
            raise RowProblem(
                NON_STRING_CONTENT,
                f"message {index} {content_key!r} is {type(content).__name__}, not a string",
            )
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RowProblem(
                UNENCODABLE_CONTENT,
                f"message {index} {content_key!r} holds {exc.object[exc.start]!r} at character "
                f"{exc.start} ({exc.reason})",
            ) from None
        role = roles[role.lower()]
        if role == "assistant" and not content.strip():
            # It would train on nothing but an end-of-turn token.
            raise RowProblem(EMPTY_ASSISTANT_REPLY, f"message {index} (assistant) is empty")
        messages.append({"role": role, "content": content})
    check_turn_order(messages)
    if not any(message["role"] == "assistant" for message in messages):
        # Nothing to train on, and nothing for regeneration to answer: found at the start.
        raise RowProblem(NO_ASSISTANT_TURN, "the conversation has no assistant message")
    return messages


def check_turn_order(messages: list[dict]) -> None:
    """Raise RowProblem unless the roles are: an optional system message first, then user and
    assistant turns alternating, starting with user.

    That is the order every chat template renders as one conversation (Mistral's and Gemma's
    refuse any other); a reply to no prompt, or two prompts in a row, would train the drafter
    on a turn the target never answers that way, and regeneration would answer nothing.
    """
    expected = "user"
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "system" and index == 0:
            continue
        if role != expected:
            if role == "system":
                why = "a system message is allowed only as the first message"
            elif index == 0 or (index == 1 and messages[0]["role"] == "system"):
                why = "the conversation must start with a user turn"
            else:
                why = f"it follows a {messages[index - 1]['role']!r} message"
            raise RowProblem(
                TURN_ORDER,
                f"message {index} has role {role!r} where {expected!r} was expected: {why} "
                "(an optional system message, then user and assistant turns alternating)",
            )
        expected = "assistant" if role == "user" else "user"


def iter_rows(path: str | os.PathLike, fmt: str = "auto") -> Iterator[Conversation | BadRow]:
    """Every source row, in row-id order, as a Conversation or a BadRow."""
    if fmt not in FORMATS:
        raise PipelineError(f"dataset.format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if source_kind(path) == "jsonl":
        for row_id, line_no, raw in iter_jsonl_lines(path):
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield BadRow(row_id, INVALID_JSON, str(exc), line_no)
                continue
            try:
                yield Conversation(row_id, normalize_record(record, fmt), line_no)
            except RowProblem as problem:
                yield BadRow(row_id, problem.reason, problem.detail, line_no)
    else:
        for row_id, record in enumerate(iter_parquet_records(path)):
            try:
                yield Conversation(row_id, normalize_record(record, fmt))
            except RowProblem as problem:
                yield BadRow(row_id, problem.reason, problem.detail)


def bad_rows_of(path: str | os.PathLike, fmt: str = "auto") -> list[BadRow]:
    """Every row `iter_rows` finds unusable, in order. What a tokenizer finds (a template
    error, no assistant token left) is prepare's to find."""
    return [row for row in iter_rows(path, fmt) if isinstance(row, BadRow)]


def read_conversations(
    path: str | os.PathLike, fmt: str = "auto", bad_rows: str = "error"
) -> tuple[list[Conversation], list[BadRow]]:
    """All usable rows plus the bad ones; under `bad_rows="error"` the first bad row raises."""
    if bad_rows not in ("error", "skip"):
        raise PipelineError(f"dataset.bad_rows {bad_rows!r}: expected 'error' or 'skip'")
    good: list[Conversation] = []
    bad: list[BadRow] = []
    for row in iter_rows(path, fmt):
        if isinstance(row, BadRow):
            if bad_rows == "error":
                raise bad_row_error(path, row)
            bad.append(row)
        else:
            good.append(row)
    return good, bad

"""Reading conversation datasets (ShareGPT or OpenAI style) into one form.

Every row becomes a list of `{"role", "content"}` messages with roles `system`, `user` and
`assistant` (ShareGPT's `human`, `gpt`, and the other assistants' `chatgpt`, `bing`, `bard`
mapped). Row ids are the 0-based index of the row among the file's records
(`source_files`: a JSONL line that is not blank, a JSON array's element, a Parquet row). The
same definition drives the shard plan (`shard_plan.count_source_rows`), so a row keeps its id
and its shard whatever happens to the rows around it.

Turn order (`dataset.turn_order`):

- `trim` (the default, what SpecForge 0.2's GeneralParser and EAGLE's data script do): after
  an optional first system message, leading non-user turns are dropped, and the conversation
  is kept up to its first turn out of order (an assistant turn that does not follow a user
  turn, a later system message, a role no mapping knows); an empty reply is kept, as the peers
  keep it. User turns left
  after the last reply are dropped too: nothing after them is trained on. Every dropped run
  of turns is recorded on the row (`Conversation.dropped`) with its reason, for counting.
- `strict`: a row whose turns are not an optional system message, then user and assistant
  turns alternating, is a bad row as a whole.

A row that cannot be used is not an exception by itself: `iter_rows` yields a `BadRow`
naming the row and the problem, and the caller decides (stop with `bad_row_error`, or count
and skip). The problems are short fixed reasons (an unknown role's reason names the role),
so skipped rows can be counted per reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..core.errors import PipelineError
from ..core.fingerprint import hash_file
from .source_files import SourceCut, SourceRecords, iter_parquet_records, source_kind

FORMATS = ("auto", "sharegpt", "openai")
TURN_ORDERS = ("trim", "strict")

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    # Other assistants whose conversations ShareGPT holds (SpecForge's prepare_data maps them).
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}

# The fixed reasons a row is bad (skipped.json counts rows per reason).
INVALID_JSON = "invalid JSON"
NOT_AN_OBJECT = "row is not an object"
NO_KNOWN_KEY = "no known key"
MALFORMED_CONVERSATION = "malformed conversation"
EMPTY_CONVERSATION = "empty conversation"
MALFORMED_MESSAGE = "malformed message"
UNKNOWN_ROLE = "unknown role"  # the reason names the role: unknown_role_reason
NON_STRING_CONTENT = "non-string content"
# A lone surrogate (JSON's "\ud800" escape) decodes to a str no tokenizer can encode.
UNENCODABLE_CONTENT = "content not encodable as UTF-8"
EMPTY_ASSISTANT_REPLY = "empty assistant reply"
TURN_ORDER = "turns out of order"
NO_ASSISTANT_TURN = "no assistant turn"
# Turns `turn_order: trim` drops from a row it keeps.
LEADING_TURNS = "leading non-user turns"
TRAILING_USER_TURNS = "user turns after the last reply"
# Found while tokenizing (eaglepipe.data.chat_mask), listed here so all reasons live in one place.
NO_ASSISTANT_TOKENS = "no assistant tokens"
ASSISTANT_TRUNCATED = "assistant tokens truncated away"
TEMPLATE_ERROR = "chat template error"


def unknown_role_reason(role: object) -> str:
    return f"{UNKNOWN_ROLE} {role!r}"


class RowProblem(Exception):
    """Why one row cannot be used: a fixed `reason` plus a `detail` for the message, and the
    row's messages as far as they could be read (what counting its lost turns needs)."""

    def __init__(self, reason: str, detail: str = "", messages: tuple[dict, ...] = ()):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.messages = tuple(messages)


@dataclass(frozen=True)
class DroppedTurns:
    """A run of turns `turn_order: trim` dropped from a row it kept, and why."""

    reason: str
    detail: str
    messages: tuple[dict, ...]  # roles mapped where known (an unknown role kept as found)


@dataclass(frozen=True)
class Conversation:
    row_id: int
    messages: list[dict]
    line: int | None = None  # 1-based line number in a JSON text file
    # Ordinals (among the assistant turns) of regenerated replies cut at max_new_tokens.
    length_limited_turns: tuple[int, ...] = ()
    dropped: tuple[DroppedTurns, ...] = ()


@dataclass(frozen=True)
class BadRow:
    row_id: int
    reason: str
    detail: str = ""
    line: int | None = None  # 1-based line number in a JSON text file
    # The row's messages as far as they were read: what it loses, in turns and tokens.
    messages: tuple[dict, ...] = field(default=(), compare=False, repr=False)

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


def _require_turn_order(turn_order: str) -> None:
    if turn_order not in TURN_ORDERS:
        raise PipelineError(
            f"dataset.turn_order {turn_order!r}: expected one of {', '.join(TURN_ORDERS)}"
        )


def normalize_record(record: object, fmt: str = "auto") -> list[dict]:
    """One source row as `[{"role", "content"}, ...]` under the strict turn order; raises
    RowProblem when it is unusable."""
    return parse_record(record, fmt, "strict")[0]


def parse_record(
    record: object, fmt: str = "auto", turn_order: str = "trim"
) -> tuple[list[dict], tuple[DroppedTurns, ...]]:
    """One source row as its kept messages and the runs of turns dropped from it; raises
    RowProblem when nothing of it can be used."""
    if fmt not in FORMATS:
        raise PipelineError(f"dataset.format {fmt!r}: expected one of {', '.join(FORMATS)}")
    _require_turn_order(turn_order)
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
        messages = _read_messages(record, "conversations", "from", "value", SHAREGPT_ROLES)
    else:
        messages = _read_messages(record, "messages", "role", "content", OPENAI_ROLES)
    if turn_order == "strict":
        return _strict(messages), ()
    return _trim(messages)


def _read_messages(
    record: dict, list_key: str, role_key: str, content_key: str, roles: dict[str, str]
) -> list[dict]:
    """The row's messages, roles mapped; a role no mapping knows is kept as found, flagged
    `known: False` (the turn-order rule decides what it means)."""
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
                messages,
            )
        role = turn[role_key]
        known = isinstance(role, str) and role.lower() in roles
        content = turn[content_key]
        if not isinstance(content, str):
            raise RowProblem(
                NON_STRING_CONTENT,
                f"message {index} {content_key!r} is {type(content).__name__}, not a string",
                messages,
            )
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RowProblem(
                UNENCODABLE_CONTENT,
                f"message {index} {content_key!r} holds {exc.object[exc.start]!r} at character "
                f"{exc.start} ({exc.reason})",
                messages,
            ) from None
        if known:
            messages.append({"role": roles[role.lower()], "content": content})
        else:
            messages.append(
                {"role": role, "content": content, "known": False, "known_roles": sorted(roles)}
            )
    return messages


def _unknown_role_problem(messages: list[dict], index: int) -> RowProblem:
    message = messages[index]
    return RowProblem(
        unknown_role_reason(message["role"]),
        f"message {index} has role {message['role']!r} "
        f"(known: {', '.join(message['known_roles'])})",
        _plain(messages),
    )


def _plain(messages) -> tuple[dict, ...]:
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def _strict(messages: list[dict]) -> list[dict]:
    for index, message in enumerate(messages):
        if message.get("known") is False:
            raise _unknown_role_problem(messages, index)
        if message["role"] == "assistant" and not message["content"].strip():
            # It would train on nothing but an end-of-turn token.
            raise RowProblem(
                EMPTY_ASSISTANT_REPLY, f"message {index} (assistant) is empty", messages
            )
    try:
        check_turn_order(messages)
    except RowProblem as problem:
        raise RowProblem(problem.reason, problem.detail, messages) from None
    if not any(message["role"] == "assistant" for message in messages):
        # Nothing to train on, and nothing for regeneration to answer: found at the start.
        raise RowProblem(NO_ASSISTANT_TURN, "the conversation has no assistant message", messages)
    return messages


def _trim(messages: list[dict]) -> tuple[list[dict], tuple[DroppedTurns, ...]]:
    """`turn_order: trim` (see the module's docstring); raises RowProblem when no assistant
    turn is left, with the reason of the drop that took the first one."""
    dropped: list[DroppedTurns] = []
    kept: list[dict] = []
    start = 0
    if messages[0]["role"] == "system":
        kept.append(messages[0])
        start = 1
    first_user = start
    while first_user < len(messages) and messages[first_user]["role"] != "user":
        first_user += 1
    # Before the first user turn: runs of assistant or later system turns, and unknown roles
    # (each under its own reason).
    index = start
    while index < first_user:
        end = index + 1
        unknown = messages[index].get("known") is False
        while end < first_user and (messages[end].get("known") is False) == unknown:
            end += 1
        if unknown:
            reason = _unknown_role_problem(messages, index)
            dropped.append(DroppedTurns(reason.reason, reason.detail, _plain(messages[index:end])))
        else:
            dropped.append(
                DroppedTurns(
                    LEADING_TURNS,
                    f"messages {index}-{end - 1} come before the first user turn",
                    _plain(messages[index:end]),
                )
            )
        index = end
    cut = _first_out_of_order(messages, first_user)
    kept += messages[first_user : cut.index if cut else len(messages)]
    if cut is not None:
        dropped.append(DroppedTurns(cut.reason, cut.detail, _plain(messages[cut.index :])))
    trailing = len(kept)
    while trailing > 0 and kept[trailing - 1]["role"] == "user":
        trailing -= 1
    if trailing < len(kept):
        dropped.append(
            DroppedTurns(
                TRAILING_USER_TURNS,
                f"{len(kept) - trailing} user turn(s) after the last assistant reply",
                _plain(kept[trailing:]),
            )
        )
        del kept[trailing:]
    if not any(message["role"] == "assistant" for message in kept):
        # The reason of the drop that took a reply, else of a role no mapping knows.
        lost = next(
            (d for d in dropped if any(m["role"] == "assistant" for m in d.messages)), None
        ) or next((d for d in dropped if d.reason.startswith(UNKNOWN_ROLE)), None)
        if lost is None:
            raise RowProblem(
                NO_ASSISTANT_TURN, "the conversation has no assistant message", _plain(messages)
            )
        raise RowProblem(lost.reason, lost.detail, _plain(messages))
    # Order of the drops in the row (a leading run, then the cut, then trailing turns).
    return kept, tuple(dropped)


@dataclass(frozen=True)
class _Cut:
    index: int
    reason: str
    detail: str


def _first_out_of_order(messages: list[dict], start: int) -> _Cut | None:
    """The first turn from `start` (a user turn) that ends what `trim` keeps, or None.

    As SpecForge's GeneralParser: an assistant turn must follow a user turn; consecutive user
    turns are kept; an empty reply is kept and its end-of-turn token trained (with regeneration
    on, the target answers it anyway). Unlike it: a later system message and a role no mapping
    knows end the conversation (GeneralParser passes a system message to the template mid-way;
    the target never answers after one so)."""
    for index in range(start + 1, len(messages)):
        message = messages[index]
        role = message["role"]
        if message.get("known") is False:
            problem = _unknown_role_problem(messages, index)
            return _Cut(index, problem.reason, problem.detail)
        if role == "system":
            return _Cut(
                index, TURN_ORDER, f"message {index}: a system message is allowed only first"
            )
        if role == "assistant":
            previous = messages[index - 1]["role"]
            if previous != "user":
                return _Cut(
                    index,
                    TURN_ORDER,
                    f"message {index} has role 'assistant' after a {previous!r} message",
                )
    return None


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


class DatasetRows:
    """Every source row, in row-id order, as a Conversation or a BadRow; after the iteration,
    `cut` is where a JSON array stopped early (`source_files.SourceCut`), else None."""

    def __init__(self, path: str | os.PathLike, fmt: str = "auto", turn_order: str = "trim"):
        if fmt not in FORMATS:
            raise PipelineError(f"dataset.format {fmt!r}: expected one of {', '.join(FORMATS)}")
        _require_turn_order(turn_order)
        self.path, self.fmt, self.turn_order = path, fmt, turn_order
        self.cut: SourceCut | None = None

    def __iter__(self) -> Iterator[Conversation | BadRow]:
        if source_kind(self.path) == "parquet":
            for row_id, record in enumerate(iter_parquet_records(self.path)):
                yield self._row(row_id, record, None)
            return
        records = SourceRecords(self.path)
        for raw in records:
            if raw.parsed:
                record = raw.value
            else:
                try:
                    record = json.loads(raw.raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    yield BadRow(raw.row_id, INVALID_JSON, str(exc), raw.line)
                    continue
            yield self._row(raw.row_id, record, raw.line)
        self.cut = records.cut

    def _row(self, row_id: int, record: object, line: int | None) -> Conversation | BadRow:
        try:
            messages, dropped = parse_record(record, self.fmt, self.turn_order)
        except RowProblem as problem:
            return BadRow(row_id, problem.reason, problem.detail, line, problem.messages)
        return Conversation(row_id, messages, line, dropped=dropped)


def iter_rows(
    path: str | os.PathLike, fmt: str = "auto", turn_order: str = "trim"
) -> Iterator[Conversation | BadRow]:
    """Every source row, in row-id order, as a Conversation or a BadRow (a cut-off array's
    whole records only: `DatasetRows` tells the cut)."""
    return iter(DatasetRows(path, fmt, turn_order))


def bad_rows_of(
    path: str | os.PathLike, fmt: str = "auto", turn_order: str = "trim"
) -> list[BadRow]:
    """Every row `iter_rows` finds unusable, in order. What a tokenizer finds (a template
    error, no assistant token left) is prepare's to find."""
    return [row for row in iter_rows(path, fmt, turn_order) if isinstance(row, BadRow)]


def read_conversations(
    path: str | os.PathLike, fmt: str = "auto", bad_rows: str = "error", turn_order: str = "trim"
) -> tuple[list[Conversation], list[BadRow]]:
    """All usable rows plus the bad ones; under `bad_rows="error"` the first bad row raises."""
    if bad_rows not in ("error", "skip"):
        raise PipelineError(f"dataset.bad_rows {bad_rows!r}: expected 'error' or 'skip'")
    good: list[Conversation] = []
    bad: list[BadRow] = []
    for row in iter_rows(path, fmt, turn_order):
        if isinstance(row, BadRow):
            if bad_rows == "error":
                raise bad_row_error(path, row)
            bad.append(row)
        else:
            good.append(row)
    return good, bad

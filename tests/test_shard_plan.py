"""Shard plan: ranges, names, parse-time row counts and per-shard digests (cached)."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import HoldoutSettings
from eaglepipe.plan.shard_plan import (
    Shard,
    check_holdout,
    count_source_rows,
    is_eval_row,
    parse_shard_name,
    plan_for_source,
    plan_shards,
    planned_near,
    shard_source_digests,
)


def _write_jsonl(path, rows, blank_every: int = 0):
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(row) + "\n")
            if blank_every and i % blank_every == 0:
                f.write("\n  \n")
    return path


def _rows(n):
    return [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)]


def test_plan_zero_rows_is_empty():
    assert plan_shards(0, 64) == []


def test_plan_one_row():
    assert plan_shards(1, 64) == [Shard(0, 1)]
    assert plan_shards(1, 64)[0].name == "rows_0-1"


def test_plan_exactly_divisible():
    plan = plan_shards(128, 64)
    assert [s.name for s in plan] == ["rows_0-64", "rows_64-128"]
    assert all(s.num_rows == 64 for s in plan)


def test_plan_ragged_last_shard_is_short():
    plan = plan_shards(150, 64)
    assert [s.name for s in plan] == ["rows_0-64", "rows_64-128", "rows_128-150"]
    assert plan[-1].num_rows == 22
    # Ranges tile the rows exactly, without gaps or overlaps.
    assert [r for s in plan for r in range(s.start, s.end)] == list(range(150))


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_plan_rejects_bad_rows_per_shard(bad):
    with pytest.raises(PipelineError, match="rows_per_shard"):
        plan_shards(10, bad)


def test_parse_shard_name_round_trips():
    for shard in plan_shards(150, 64):
        assert parse_shard_name(shard.name) == shard


@pytest.mark.parametrize("name", ["rows_5-5", "rows_9-3", "rows_a-3", "shard_0-64", "rows_0-64x"])
def test_parse_shard_name_rejects_bad_names(name):
    with pytest.raises(PipelineError, match=name):
        parse_shard_name(name)


def test_count_jsonl_ignores_blank_lines(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(10), blank_every=3)
    assert count_source_rows(path, tmp_path / "cache") == 10
    assert [s.name for s in plan_for_source(path, 4, tmp_path / "cache")] == [
        "rows_0-4",
        "rows_4-8",
        "rows_8-10",
    ]


def test_count_parquet_from_metadata(tmp_path):
    path = tmp_path / "d.parquet"
    pd.DataFrame({"messages": [r["messages"] for r in _rows(7)]}).to_parquet(path)
    assert count_source_rows(path, tmp_path / "cache") == 7


def test_count_is_cached_by_size_and_mtime(tmp_path):
    cache = tmp_path / "cache"
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(5))
    assert count_source_rows(path, cache) == 5
    (cache_file,) = cache.glob("source-*.json")
    entry = json.loads(cache_file.read_text())
    assert entry["path"] == str(path.resolve()) and entry["num_rows"] == 5
    # A cached answer for the same identity is trusted (proves the cache is read, not recounted).
    entry["num_rows"] = 999
    cache_file.write_text(json.dumps(entry))
    assert count_source_rows(path, cache) == 999
    # Changing the file changes size and mtime, so the stale entry is ignored.
    _write_jsonl(path, _rows(6))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert count_source_rows(path, cache) == 6


def test_missing_source_is_named(tmp_path):
    with pytest.raises(PipelineError, match="nope.jsonl does not exist"):
        count_source_rows(tmp_path / "nope.jsonl", tmp_path / "cache")


def test_unsupported_source_type(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n")
    with pytest.raises(PipelineError, match="unsupported file type"):
        count_source_rows(path, tmp_path / "cache")


def test_digests_change_only_for_the_edited_shard_jsonl(tmp_path):
    rows = _rows(10)
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    before = shard_source_digests(path, 4, tmp_path / "cache")
    assert list(before) == ["rows_0-4", "rows_4-8", "rows_8-10"]
    assert len(set(before.values())) == 3
    rows[5]["messages"][0]["content"] = "edited"
    _write_jsonl(path, rows)
    after = shard_source_digests(path, 4, tmp_path / "cache")
    assert after["rows_4-8"] != before["rows_4-8"]
    assert after["rows_0-4"] == before["rows_0-4"]
    assert after["rows_8-10"] == before["rows_8-10"]


def test_digests_ignore_blank_lines_and_are_cached(tmp_path):
    rows = _rows(6)
    plain = shard_source_digests(_write_jsonl(tmp_path / "a.jsonl", rows), 4, tmp_path / "c")
    spaced = shard_source_digests(
        _write_jsonl(tmp_path / "b.jsonl", rows, blank_every=2), 4, tmp_path / "c"
    )
    assert plain == spaced
    # The second call with the same plan reads the cache entry written by the first.
    assert shard_source_digests(tmp_path / "a.jsonl", 4, tmp_path / "c") == plain
    assert count_source_rows(tmp_path / "a.jsonl", tmp_path / "c") == 6


def test_digests_change_only_for_the_edited_shard_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    messages = [r["messages"] for r in _rows(9)]
    pd.DataFrame({"messages": messages}).to_parquet(path)
    before = shard_source_digests(path, 3, tmp_path / "cache")
    messages[1] = [{"role": "user", "content": "edited"}]
    pd.DataFrame({"messages": messages}).to_parquet(path)
    after = shard_source_digests(path, 3, tmp_path / "cache")
    assert [k for k in before if before[k] != after[k]] == ["rows_0-3"]


def test_digests_of_empty_source(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert shard_source_digests(path, 4, tmp_path / "cache") == {}
    assert plan_for_source(path, 4, tmp_path / "cache") == []


def holdout(mode="fraction", fraction=0.1, seed=0, shards=()):
    return HoldoutSettings(mode=mode, fraction=fraction, seed=seed, shards=tuple(shards))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            holdout(fraction=0.0),
            "config key dataset.holdout.fraction: 0.0 holds out none of the 40 source rows "
            "(seed 0): evaluation needs at least one; raise it",
        ),
        # Small enough that none of 40 rows falls under it: evaluate found it after training.
        (holdout(fraction=1e-6), "config key dataset.holdout.fraction: 1e-06 holds out none"),
        (
            holdout(fraction=1.0),
            "config key dataset.holdout.fraction: 1.0 holds out every one of the 40 source rows "
            "(seed 0): none is left to train on; lower it",
        ),
        # Ignored in fraction mode, even a name not in the plan; it reran prepare for nothing.
        (
            holdout(shards=["rows_0-999"]),
            "config key dataset.holdout.shards: lists shards, but dataset.holdout.mode is "
            "fraction, which ignores them: set mode: shards, or remove the list",
        ),
        (
            holdout(mode="shards", shards=["rows_0-16", "rows_16-32", "rows_32-40"]),
            "config key dataset.holdout.shards: every shard of the plan is held out: no row is "
            "left to train on",
        ),
    ],
)
def test_a_holdout_that_leaves_evaluation_or_training_without_a_row_is_refused(settings, message):
    with pytest.raises(PipelineError) as raised:
        check_holdout(settings, 40, 16)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    ("settings", "skipped", "message"),
    [
        (
            holdout(mode="shards", shards=["rows_16-32"]),
            range(16, 32),
            "config key dataset.holdout.shards: every row of the held-out shards is a bad row "
            "that dataset.bad_rows: skip drops (16 of 40): nothing is left for evaluation",
        ),
        (
            holdout(mode="shards", shards=["rows_16-32"]),
            [*range(16), *range(32, 40)],
            "config key dataset.holdout.shards: every row outside the held-out shards is a bad "
            "row that dataset.bad_rows: skip drops (24 of 40): nothing is left for training",
        ),
        (
            holdout(fraction=0.1),
            [r for r in range(40) if is_eval_row(r, 0.1, 0)],
            "config key dataset.holdout.fraction: 0.1 holds out none of the 36 usable source "
            "rows (4 bad rows skipped)",
        ),
    ],
)
def test_a_holdout_counts_only_the_rows_skip_keeps(settings, skipped, message):
    with pytest.raises(PipelineError) as raised:
        check_holdout(settings, 40, 16, frozenset(skipped))
    assert str(raised.value).startswith(message)
    check_holdout(settings, 40, 16, frozenset(list(skipped)[:-1]))  # one usable row is enough


def test_a_holdout_with_rows_on_both_sides_passes():
    check_holdout(holdout(), 40, 16)
    check_holdout(holdout(mode="shards", shards=["rows_16-32"]), 40, 16)


@pytest.mark.parametrize(
    ("name", "rows", "said"),
    [
        ("rows_0-17", 320, "its rows are in rows_0-64 (the plan has 5 shards, rows_0-64 to"),
        ("rows_0-999", 320, "rows_0-64, rows_64-128, rows_128-192 ... rows_256-320 (the plan"),
        ("rows_1000-2000", 320, "its rows are past the dataset's 320 rows (5 shards,"),
        ("rows_9-12", 3, "its rows are past the dataset's 3 rows (1 shard, rows_0-3)"),
        ("shard7", 320, "the plan has 5 shards, rows_0-64 to rows_256-320"),
        ("rows_0-64", 0, "the dataset has no rows"),
    ],
)
def test_a_name_not_in_the_plan_is_told_which_planned_shards_hold_its_rows(name, rows, said):
    # A mistyped target (rows_0-999 for rows_0-64) said only that it was not planned.
    assert said in planned_near(name, plan_shards(rows, 64))

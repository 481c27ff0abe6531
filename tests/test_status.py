"""`eaglepipe status`: shard states from real manifest / journal / lock / log files."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO_ROOT

from eaglepipe.core.config_files import load_config
from eaglepipe.core.run import resolve
from eaglepipe.extract.chunk_file import plan_chunks
from eaglepipe.ops import status
from eaglepipe.plan.shard_plan import plan_shards

HIDDEN = 64
NOW = datetime(2026, 1, 2, 12, 0, tzinfo=UTC).timestamp()


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def write_manifest(workdir: Path, name: str, *, tokens: int, nbytes: int, start: float, end: float):
    shard_dir = workdir / "hidden_states" / name
    shard_dir.mkdir(parents=True, exist_ok=True)
    first, last = status.parse_shard_name(name).start, status.parse_shard_name(name).end
    manifest = {
        "format_version": 1,
        "shard": name,
        "row_start": first,
        "row_end": last,
        "num_rows": last - first,
        "num_tokens": tokens,
        "num_bytes": nbytes,
        "chunks": [{"file": "chunk-00000.safetensors", "bytes": nbytes, "num_tokens": tokens}],
        "timing": {
            "started_at": iso(start),
            "finished_at": iso(end),
            "seconds": end - start,
            "tokens_per_s": tokens / (end - start),
        },
    }
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))


def write_journal(workdir: Path, name: str, chunks: list[tuple[list[int], int, int]]):
    shard_dir = workdir / "hidden_states" / name
    shard_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {
                "file": f"chunk-{i:05d}.safetensors",
                "row_ids": rows,
                "num_tokens": tokens,
                "bytes": nbytes,
                "xxh3_128": "0" * 32,
                "plan_digest": "d",
            }
        )
        for i, (rows, tokens, nbytes) in enumerate(chunks)
    ]
    # A torn last line, as a kill mid-append leaves it.
    (shard_dir / "journal.jsonl").write_text("\n".join(lines) + '\n{"file": "chunk-0')
    return shard_dir


def write_lock(shard_dir: Path, pid: int, *, host: str | None = None, started: float | None = None):
    info = {
        "pid": pid,
        "host": host or socket.gethostname(),
        "started_at": iso(started if started is not None else datetime.now(UTC).timestamp()),
    }
    (shard_dir / "writer.lock").write_text(json.dumps(info) + "\n")


def write_failure(workdir: Path, name: str, message: str):
    """What a failed extraction job leaves (eaglepipe.extract.shard.run_extract_job)."""
    from eaglepipe.core.shard_job import record_failure

    record_failure(workdir / "hidden_states" / name, message)


def write_prepared(workdir: Path, row_ids: list[int], tokens: list[int]):
    table = pa.table(
        {
            "row_id": pa.array(row_ids, pa.int64()),
            "num_tokens": pa.array(tokens, pa.int32()),
        }
    )
    (workdir / "prepared").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, workdir / "prepared" / "tokenized.parquet")


@pytest.fixture
def sleeper():
    """A live process to stand in for an extract job holding a shard's writer lock."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_every_state_with_totals_throughput_and_eta(tmp_path, sleeper):
    names = [s.name for s in plan_shards(50, 10)]
    tokens_per_row = 100
    write_prepared(tmp_path, list(range(50)), [tokens_per_row] * 50)
    # Two shards finished within the last hour, one 10 minutes each.
    write_manifest(tmp_path, names[0], tokens=1000, nbytes=5000, start=NOW - 1800, end=NOW - 1200)
    write_manifest(tmp_path, names[1], tokens=1000, nbytes=5000, start=NOW - 1200, end=NOW - 600)
    # Running: two chunks of its planned ones journaled, lock held by a live process.
    running = write_journal(tmp_path, names[2], [([20, 21], 200, 1000), ([22, 23], 200, 1000)])
    write_lock(running, sleeper.pid)
    # Killed: journal and a lock naming a dead PID, no failure recorded -> partial.
    killed = write_journal(tmp_path, names[3], [([30, 31, 32], 300, 1500)])
    write_lock(killed, dead_pid())
    # Failed: the job recorded why.
    write_failure(
        tmp_path, names[4], "server at 127.0.0.1:40001 died (exit code -9); log tail: ..."
    )

    summary = status.shard_status(
        tmp_path, names, hidden_size=HIDDEN, chunk_max_bytes=2 * 100 * (4 * HIDDEN * 2 + 5) + 100
    )
    by_name = {s.name: s for s in summary.shards}
    assert [by_name[n].state for n in names] == ["done", "done", "running", "partial", "failed"]
    assert summary.counts == {
        "done": 2,
        "stale": 0,
        "running": 1,
        "failed": 1,
        "partial": 1,
        "remaining": 0,
    }
    assert by_name[names[2]].lock_pid == sleeper.pid
    assert by_name[names[2]].chunks_done == 2
    # Chunks planned the way extraction plans them: two 100-token rows per chunk here.
    assert by_name[names[2]].chunks_planned == 5
    assert by_name[names[4]].error.startswith("server at 127.0.0.1:40001 died")
    assert summary.rows == 10 + 10 + 4 + 3
    assert summary.tokens == 1000 + 1000 + 400 + 300
    assert summary.bytes == 5000 + 5000 + 2000 + 1500
    assert summary.planned_tokens == 50 * tokens_per_row
    assert summary.remaining_tokens == 5000 - 2000 - 400 - 300
    assert summary.tokens_per_s is not None and summary.tokens_per_s > 0
    assert summary.eta_s == pytest.approx(summary.remaining_tokens / summary.tokens_per_s)

    text = status.format_status(summary)
    assert "2 done, 1 running, 1 failed, 1 partial, 0 remaining" in text
    assert f"running  {names[2]}: 2/5 chunks (pid {sleeper.pid}" in text
    assert f"FAILED   {names[4]}: server at 127.0.0.1:40001 died" in text
    assert "ETA" in text


def test_throughput_counts_only_the_recent_window():
    done_long_ago = status.ShardStatus(
        "rows_0-10",
        0,
        10,
        state="done",
        tokens=10_000,
        started_at=NOW - 9000,
        finished_at=NOW - 8000,
    )
    recent = status.ShardStatus(
        "rows_10-20", 10, 20, state="done", tokens=3600, started_at=NOW - 3600, finished_at=NOW
    )
    tokens_per_s, _ = status.recent_throughput([done_long_ago, recent], NOW, window_s=3600)
    assert tokens_per_s == pytest.approx(1.0)
    assert status.recent_throughput([done_long_ago], NOW, window_s=3600) == (None, None)


def test_eta_without_prepared_table_scales_done_shards(tmp_path):
    names = [s.name for s in plan_shards(40, 10)]
    write_manifest(tmp_path, names[0], tokens=500, nbytes=100, start=NOW - 100, end=NOW - 50)
    summary = status.shard_status(tmp_path, names, now=NOW)
    assert summary.planned_tokens is None
    # 50 tokens per row over the 30 rows left.
    assert summary.remaining_tokens == 1500
    assert summary.eta_s == pytest.approx(1500 / summary.tokens_per_s)


def test_a_failure_is_forgotten_with_its_shard_directory(tmp_path):
    # The old log still ends in the error; the shard was removed to redo it: not failed.
    write_failure(tmp_path, "rows_0-10", "error: port 30517 is held by PID 41 (nc)")
    log = tmp_path / "logs" / "extract" / "rows_0-10.log"
    log.parent.mkdir(parents=True)
    log.write_text("error: port 30517 is held by PID 41 (nc)\n")
    summary = status.shard_status(tmp_path, ["rows_0-10"])
    assert summary.shards[0].state == "failed"
    assert "port 30517 is held by PID 41" in status.format_status(summary)
    shutil.rmtree(tmp_path / "hidden_states" / "rows_0-10")
    assert status.shard_status(tmp_path, ["rows_0-10"]).shards[0].state == "remaining"


def test_lock_liveness(sleeper):
    me = socket.gethostname()
    assert status.lock_is_live({"pid": sleeper.pid, "host": me, "started_at": iso(NOW * 2)})
    assert not status.lock_is_live({"pid": dead_pid(), "host": me})
    # The PID runs, but it started long after the lock was taken: a recycled PID.
    assert not status.lock_is_live({"pid": os.getpid(), "host": me, "started_at": iso(0)})
    # Another node's writer cannot be checked from here; it is reported as running there.
    assert status.lock_is_live({"pid": 1, "host": "gpu-node-17"})


def test_remote_writer_without_progress_is_flagged(tmp_path):
    shard_dir = write_journal(tmp_path, "rows_0-10", [([0, 1], 20, 100)])
    write_lock(shard_dir, 4242, host="gpu-node-17", started=NOW - 3 * 3600)
    os.utime(shard_dir / "journal.jsonl", (NOW - 2 * 3600, NOW - 2 * 3600))
    summary = status.shard_status(tmp_path, ["rows_0-10"], now=NOW)
    assert summary.shards[0].state == "running"
    text = status.format_status(summary)
    assert (
        "running  rows_0-10: 1 chunks (pid 4242 on gpu-node-17; no chunk finished for 2h 00m)"
        in text
    )


def test_released_lock_and_a_failure_record_means_failed(tmp_path):
    names = ["rows_0-10"]
    shard_dir = write_journal(tmp_path, names[0], [([0, 1], 20, 100)])
    (shard_dir / "writer.lock").write_text("")  # released: the writer empties it
    write_failure(tmp_path, names[0], "error: chunk-00001.safetensors: disk full")
    summary = status.shard_status(tmp_path, names)
    assert summary.shards[0].state == "failed"
    assert summary.failed == summary.shards


def test_five_thousand_shards(tmp_path):
    plan = plan_shards(5000 * 8, 8)
    names = [s.name for s in plan]
    write_prepared(tmp_path, list(range(5000 * 8)), [10] * (5000 * 8))
    for name in names[:3000]:
        write_manifest(tmp_path, name, tokens=80, nbytes=1000, start=NOW - 500, end=NOW - 100)
    for name in names[3000:3010]:
        write_journal(tmp_path, name, [([0], 10, 100)])
    for name in names[3010:3013]:
        write_failure(tmp_path, name, "row 3 is malformed")
    summary = status.shard_status(tmp_path, names, now=NOW)
    assert summary.counts == {
        "done": 3000,
        "stale": 0,
        "running": 0,
        "failed": 3,
        "partial": 10,
        "remaining": 1987,
    }
    assert summary.tokens == 3000 * 80 + 10 * 10
    assert summary.remaining_tokens == 2000 * 80 - 10 * 10
    text = status.format_status(summary)
    assert text.count("FAILED") == 3
    assert len(status.format_status(summary, list_all=True).splitlines()) > 5000


def twenty_row_config(tmp_path: Path) -> dict:
    """The embedded default over 20 empty rows in shards of 8: rows_0-8, rows_8-16, rows_16-20."""
    dataset = tmp_path / "conversations.jsonl"
    dataset.write_text("".join(json.dumps({"messages": [], "i": i}) + "\n" for i in range(20)))
    config = load_config(REPO_ROOT / "config.yaml")
    config["dataset"]["path"] = str(dataset)
    config["shards"]["rows_per_shard"] = 8
    config["dataset"]["regenerate"]["enabled"] = False  # extraction only, unless a test says so
    return config


def test_print_status_exit_codes(tmp_path):
    config = twenty_row_config(tmp_path)

    out = io.StringIO()
    assert status.print_status(resolve(config), workdir=tmp_path, stream=out) == 0
    assert "3 planned, 0 done" in out.getvalue()

    write_failure(tmp_path, "rows_8-16", "server never became healthy within 900 s\nlog tail")
    out = io.StringIO()
    assert status.print_status(resolve(config), workdir=tmp_path, stream=out) == 1
    assert "FAILED   rows_8-16: server never became healthy within 900 s\n" in out.getvalue()


@pytest.mark.parametrize(
    "damage",
    ['{"num_rows": 8, "chu', '{"num_rows": null}', '{"chunks": null}', '{"timing": "x"}', "[1, 2]"],
    ids=["torn", "null-rows", "null-chunks", "timing-text", "a-list"],
)
def test_a_damaged_manifest_is_named_with_its_repair_and_the_rest_still_shown(tmp_path, damage):
    # One bad file among thousands stopped `eaglepipe status` whole (or in a traceback).
    config = twenty_row_config(tmp_path)
    now = datetime.now(UTC).timestamp()
    write_manifest(tmp_path, "rows_0-8", tokens=800, nbytes=4096, start=now - 60, end=now - 30)
    (tmp_path / "hidden_states" / "rows_8-16").mkdir(parents=True)
    (tmp_path / "hidden_states" / "rows_8-16" / "manifest.json").write_text(damage)
    out = io.StringIO()
    assert status.print_status(resolve(config), workdir=tmp_path, stream=out) == 1
    text = out.getvalue()
    assert "3 planned, 0 done, 1 stale, 0 running, 1 failed, 0 partial, 1 remaining" in text
    (line,) = [line for line in text.splitlines() if "rows_8-16" in line]
    assert line.startswith("  FAILED   rows_8-16: damaged manifest: ")
    assert "hidden_states/rows_8-16/manifest.json" in line and "snakemake --cores N" in line


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_status_reads_a_partial_config_file_over_config_yaml_as_snakemake_does(
    tmp_path, monkeypatch, capsys, suffix
):
    # `--configfile my.yaml` sets a few keys over config.yaml; `eaglepipe status --config
    # my.yaml` said "'model' is a required property" (and a .json one: delete your file).
    from eaglepipe.ops.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(json.dumps(twenty_row_config(tmp_path)))
    override = tmp_path / f"mine{suffix}"
    override.write_text(json.dumps({"shards": {"rows_per_shard": 4}}))
    assert cli_main(["status", "--config", str(override)]) == 0
    assert "shards: 5 planned, 0 done" in capsys.readouterr().out
    assert cli_main(["status", "--config", "config.yaml"]) == 0
    assert "shards: 3 planned, 0 done" in capsys.readouterr().out
    (tmp_path / "adir").mkdir()
    assert cli_main(["status", "--config", "adir"]) != 0
    assert "error: config file adir is a directory, not a config file" in capsys.readouterr().err
    # The config.yaml it is read over is checked as carefully (was a DuplicateKeyError traceback).
    (tmp_path / "config.yaml").write_text("train:\n  epochs: 2\ntrain:\n  epochs: 3\n")
    assert cli_main(["status", "--config", str(override)]) != 0
    err = capsys.readouterr().err
    assert (
        "error: config file config.yaml: key train appears twice" in err and "Traceback" not in err
    )


def test_chunk_plan_matches_extraction():
    """fill_plan counts chunks with shard_store.plan_chunks itself, not a copy of its rule."""
    shard = status.ShardStatus("rows_0-6", 0, 6, state="running", chunks_done=1)
    prepared = status.PreparedRows(row_ids=np.arange(6), num_tokens=np.full(6, 50))
    planned = status.fill_plan([shard], prepared, hidden_size=HIDDEN, chunk_max_bytes=60_000)
    expected = plan_chunks(list(range(6)), [50] * 6, HIDDEN, max_chunk_bytes=60_000)
    assert planned == {"rows_0-6": 300}
    assert shard.chunks_planned == len(expected) > 1


def test_reads_what_the_shard_store_writes(tmp_path):
    """Contract: the real writer lock, journal and manifest the extraction writes."""
    from eaglepipe.core.shard_job import ShardLock
    from eaglepipe.extract.chunk_file import ChunkRecord
    from eaglepipe.extract.shard_files import append_journal, build_manifest, write_manifest

    shard_dir = tmp_path / "hidden_states" / "rows_0-8"
    records = [
        ChunkRecord("chunk-00000.safetensors", 1000, "a" * 32, [0, 1, 2], 30),
        ChunkRecord("chunk-00001.safetensors", 1200, "b" * 32, [3, 4, 5, 6, 7], 45),
    ]
    with ShardLock(shard_dir):
        append_journal(shard_dir, records[0], "digest")
        running = status.shard_status(tmp_path, ["rows_0-8"]).shards[0]
        assert (running.state, running.lock_pid, running.chunks_done) == ("running", os.getpid(), 1)
        assert (running.rows, running.tokens, running.bytes) == (3, 30, 1000)
    # Released (the writer empties the lock file): a journal without a manifest is partial.
    assert status.shard_status(tmp_path, ["rows_0-8"]).shards[0].state == "partial"

    append_journal(shard_dir, records[1], "digest")
    started = datetime.now(UTC)
    manifest = build_manifest(
        shard="rows_0-8",
        row_start=0,
        row_end=8,
        hidden_size=HIDDEN,
        aux_layer_ids=[1, 3, 4],
        records=records,
        provenance={},
        timing={
            "started_at": started.isoformat(timespec="seconds"),
            "finished_at": started.isoformat(timespec="seconds"),
            "seconds": 0.5,
        },
    )
    write_manifest(shard_dir, manifest)
    done = status.shard_status(tmp_path, ["rows_0-8"]).shards[0]
    assert (done.state, done.rows, done.tokens, done.bytes, done.chunks_done) == (
        "done",
        8,
        75,
        2200,
        2,
    )


def recorded_manifest(path: Path, workflow: str | None) -> None:
    """A finished shard's manifest recording the workflow provenance it was made under."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"provenance": {"workflow": workflow}, "xxh3_128": "0" * 32}))


def test_regeneration_shards_are_counted_and_failures_named(tmp_path, monkeypatch):
    from eaglepipe.core.shard_job import record_failure
    from eaglepipe.plan.provenance import regeneration_provenance

    config = twenty_row_config(tmp_path)
    config["dataset"]["regenerate"]["enabled"] = True
    regenerated = tmp_path / "regenerated"
    monkeypatch.chdir(tmp_path)
    current = regeneration_provenance(resolve(config), "rows_0-8")
    recorded_manifest(regenerated / "rows_0-8" / "manifest.json", current)
    (regenerated / "rows_8-16").mkdir()
    (regenerated / "rows_8-16" / "journal.jsonl").write_text('{"key": "k", "row": {}}\n' * 3)
    out = io.StringIO()
    assert status.print_status(resolve(config), workdir=tmp_path, stream=out) == 0
    assert "regenerated: 3 planned, 1 done, 0 running, 0 failed, 1 partial (rows kept), " in (
        out.getvalue()
    )
    record_failure(regenerated / "rows_16-20", "row 17: empty regenerated reply")
    out = io.StringIO()
    assert status.print_status(resolve(config), workdir=tmp_path, stream=out) == 1
    assert "FAILED   regenerated/rows_16-20: row 17: empty regenerated reply" in out.getvalue()


def test_stale_shards_are_judged_by_the_workflows_rule_for_the_config_given(tmp_path, monkeypatch):
    """A manifest made under other settings or rows is stale, not done, as `snakemake -n` would
    redo it; judged for the config status is given, and nothing is written."""
    from eaglepipe.plan.provenance import regeneration_provenance, shard_provenance

    config = twenty_row_config(tmp_path)
    config["dataset"]["regenerate"]["enabled"] = True
    monkeypatch.chdir(tmp_path)
    run = resolve(config)
    for shard in ("rows_0-8", "rows_8-16"):
        manifest = tmp_path / "regenerated" / shard / "manifest.json"
        recorded_manifest(manifest, regeneration_provenance(run, shard))
    # rows_0-8's hidden states follow its regenerated rows: current, then made stale by a setting.
    rows = json.loads((tmp_path / "regenerated" / "rows_0-8" / "manifest.json").read_text())
    rows["xxh3_128"] = "a" * 32
    (tmp_path / "regenerated" / "rows_0-8" / "manifest.json").write_text(json.dumps(rows))
    recorded_manifest(
        tmp_path / "hidden_states" / "rows_0-8" / "manifest.json", shard_provenance(run, "rows_0-8")
    )
    before = sorted(
        p.relative_to(tmp_path) for p in tmp_path.rglob("*") if ".eaglepipe" not in p.parts
    )

    out = io.StringIO()
    assert status.print_status(run, workdir=tmp_path, stream=out) == 0
    text = out.getvalue()
    assert "regenerated: 3 planned, 2 done, 0 running" in text
    assert "shards: 3 planned, 1 done, 0 running" in text and "stale" not in text

    config["dataset"]["regenerate"]["max_new_tokens"] = 7  # another reply length: redone
    out = io.StringIO()
    assert status.print_status(resolve(config), workdir=tmp_path, stream=out) == 0
    text = out.getvalue()
    assert "regenerated: 3 planned, 0 done, 2 stale, 0 running" in text
    assert "  stale    regenerated/rows_8-16: made under other settings" in text
    assert "shards: 3 planned, 0 done, 1 stale, 0 running" in text
    assert "  stale    rows_0-8: extracted from other rows or settings than this config" in text
    after = sorted(
        p.relative_to(tmp_path) for p in tmp_path.rglob("*") if ".eaglepipe" not in p.parts
    )
    assert after == before  # no stamp, no record changed (caches aside)


# ---------------------------------------------------------------------------------------------
# The stages after extraction (eaglepipe/ops/drafter_status.py)


def write_steps(path: Path, steps: range, *, total: int, seconds: float = 0.5) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [
        {
            "step": s,
            "total_steps": total,
            "loss": 10.0 - s / 100,
            "seconds": seconds,
            "data_wait_s": 0.0,
        }
        for s in steps
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_running_training_shows_its_step_loss_and_eta(tmp_path):
    from eaglepipe.ops.drafter_status import training_line

    assert training_line(tmp_path) == "training: not started"
    log = tmp_path / "drafter" / "train_log.jsonl"
    write_steps(log, range(1, 31), total=240)
    with log.open("a") as f:
        f.write('{"step": 31, "total_st')  # a step being written: not counted
    now = log.stat().st_mtime + 5
    assert training_line(tmp_path, now=now) == (
        "training: step 30 of 240, loss 9.7000, last step logged 0m 05s ago, "
        "ETA 1m 45s at the last 20 steps' pace (no drafter yet)"
    )
    # Snakemake deleted the rule's log to rerun the job: the copy beside the checkpoints shows it.
    history = tmp_path / "drafter" / "checkpoints" / "train_log.jsonl"
    write_steps(history, range(1, 51), total=240, seconds=1.0)
    log.unlink()
    line = training_line(tmp_path, now=history.stat().st_mtime + 90)
    assert line.startswith("training: step 50 of 240, loss 9.5000, last step logged 1m 30s ago")
    assert "ETA 3m 10s" in line


def test_finished_stages_show_their_figures_and_a_damaged_file_is_named(tmp_path):
    from safetensors.numpy import save_file

    from eaglepipe.ops.drafter_status import drafter_lines

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (tmp_path / "validated").mkdir()
    (tmp_path / "validated" / "rows_0-8.json").write_text("{}")
    (tmp_path / "validated" / "rows_8-16.json").write_text("{}")
    model = drafter / "model.safetensors"
    save_file(
        {"w": np.zeros(4, dtype=np.float32)},
        str(model),
        metadata={"total_steps": "240", "final_loss": "9.4762"},
    )
    (drafter / "eval.json").write_text(
        json.dumps({"acceptance_length": 2.156, "rows": 30, "positions": 7351})
    )
    live = {
        "acceptance_length": 1.9596,
        "prompts": 32,
        "export_engine": "sglang",
        "harness": "transformers",
        "offline_same_turns": 1.968,
        "skipped": None,
    }
    (drafter / "live.json").write_text(json.dumps(live))
    (drafter / "vocab.safetensors").write_bytes(b"")
    for name in ("config.json", "model.safetensors"):
        (drafter / "export" / "sglang").mkdir(parents=True, exist_ok=True)
        (drafter / "export" / "sglang" / name).write_text("{}")
    names = ["rows_0-8", "rows_8-16", "rows_16-20"]
    engines = ["sglang", "vllm"]
    assert drafter_lines(tmp_path, names, {"rows_8-16": "other settings"}, engines=engines) == [
        "validated: 3 planned, 1 done, 1 stale, 1 remaining",
        "vocab: done (drafter/vocab.safetensors)",
        "training: done, 240 steps, final loss 9.4762 (drafter/model.safetensors)",
        "evaluation: acceptance length 2.16 offline (decode order, 30 held-out rows, 7351 "
        "positions; drafter/eval.json)",
        "export: sglang done (drafter/export), vllm not made yet",
        "live: acceptance length 1.96 on 32 prompts, sglang export through transformers "
        "(offline on the same turns 1.97)",
    ]

    # The stages the workflow makes again (plan.freshness.single_job_staleness) say so first.
    stale = {"train": "its settings changed", "evaluate": "train runs again"}
    lines = drafter_lines(tmp_path, names, {}, stale, engines=engines)
    assert lines[2] == (
        "training: stale (its settings changed): the next run makes it again; on disk: done, "
        "240 steps, final loss 9.4762 (drafter/model.safetensors)"
    )
    assert lines[3].startswith(
        "evaluation: stale (train runs again): the next run makes it again; on disk: "
        "acceptance length 2.16"
    )
    assert lines[1] == "vocab: done (drafter/vocab.safetensors)"

    (drafter / "live.json").write_text(json.dumps({"skipped": "evaluate.live_prompts is 0"}))
    (drafter / "eval.json").write_text('{"acceptance_length": 2.1')
    model.write_bytes(model.read_bytes()[:20])
    os.utime(model, (1e9, 1e9))
    lines = drafter_lines(tmp_path, names, {})
    assert lines[2].startswith("training: drafter/model.safetensors is unreadable (")
    assert lines[2].endswith("); `eaglepipe verify` checks it")
    assert lines[3].startswith("evaluation: drafter/eval.json is unreadable (Expecting")
    assert lines[3].endswith("rerun: snakemake --cores N drafter/eval.json")
    assert lines[4] == "export: none (export.engines is empty)"
    assert lines[5] == "live: skipped (evaluate.live_prompts is 0)"


def test_print_status_goes_on_to_the_drafter_stages(tmp_path):
    config = twenty_row_config(tmp_path)
    write_steps(tmp_path / "drafter" / "train_log.jsonl", range(1, 4), total=9)
    out = io.StringIO()
    assert status.print_status(resolve(config), workdir=tmp_path, stream=out) == 0
    lines = out.getvalue().splitlines()
    assert "validated: 3 planned, 0 done, 3 remaining" in lines
    assert any(line.startswith("training: step 3 of 9, loss 9.9700") for line in lines)

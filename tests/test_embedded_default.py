"""The README's first command, on the embedded default, end to end (the slowest test).

The whole pipeline runs once in a scratch directory with the shipped config.yaml (only the
port and handoff dir are private to the test), then Snakemake's report is built from it.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from pipeline_run import SAMPLE, default_config, isolate, run_snakemake, write_config

FIGURES = ["dataset.png", "extraction.png", "validation.png", "training.png", "acceptance.png"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("embedded-default")
    config = default_config()
    config["dataset"]["path"] = str(SAMPLE)
    config = isolate(config, workdir)
    write_config(workdir, config)
    run_snakemake(workdir, "--cores", "2", timeout=2400)
    run_snakemake(workdir, "--report", "report.html")
    return workdir


@pytest.mark.slow
def test_everything_is_built_and_nothing_is_left_to_do(default_run):
    for path in [
        "drafter/export/sglang/config.json",
        "drafter/export/sglang/model.safetensors",
        "drafter/export/vllm/config.json",
        "drafter/export/vllm/model.safetensors",
        "drafter/live.json",
    ]:
        assert (default_run / path).is_file(), path
    reports = sorted((default_run / "validated").glob("rows_*.json"))
    assert [p.stem for p in reports] == [
        "rows_0-64",
        "rows_128-192",
        "rows_192-256",
        "rows_256-300",
        "rows_64-128",
    ]
    assert "Nothing to be done" in run_snakemake(default_run, "-n").stdout


@pytest.mark.slow
def test_git_ignores_everything_the_run_leaves(default_run):
    """Pipeline outputs never go into git: every top-level path the README's first command
    leaves in its working directory matches .gitignore."""
    # Not the run's: the test's config and handoff dir (pipeline_run.isolate; the README's run
    # keeps its handoff on /dev/shm).
    own = {"config.yaml", "dumps"}
    left = sorted(
        f"{p.name}/" if p.is_dir() else p.name for p in default_run.iterdir() if p.name not in own
    )
    assert "regenerated/" in left and "hidden_states/" in left
    done = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "check-ignore", "--no-index", "--verbose",
         "--non-matching", *left],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    not_ignored = [
        line.split("\t")[-1] for line in done.stdout.splitlines() if line.startswith("::")
    ]
    assert not_ignored == [], f"not in .gitignore: {not_ignored}"


@pytest.mark.slow
def test_the_default_trains_on_the_targets_own_replies(default_run):
    # dataset.regenerate is on in the embedded default: every shard regenerated, and prepare
    # tokenized those rows, not the sample file's.
    manifests = sorted((default_run / "regenerated").glob("rows_*/manifest.json"))
    assert len(manifests) == 5
    regenerated = [json.loads(p.read_text()) for p in manifests]
    assert sum(m["num_rows"] for m in regenerated) == 300
    assert sum(m["turns_regenerated"] for m in regenerated) > 900
    assert all(m["bad_rows"] == 0 for m in regenerated)
    sample_replies = {
        m["content"]
        for line in SAMPLE.read_text().splitlines()
        for m in json.loads(line)["messages"]
        if m["role"] == "assistant"
    }
    rows = [
        json.loads(line)
        for p in manifests
        for line in (p.parent / "rows.jsonl").read_text().splitlines()
    ]
    replies = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    same = sum(reply in sample_replies for reply in replies)
    assert len(replies) > 900 and same < 0.2 * len(replies)  # the toy memorised a few


@pytest.mark.slow
def test_the_run_started_one_server_and_left_none(default_run):
    (history,) = (default_run / ".eaglepipe" / "server").glob("*/history.jsonl")
    events = [json.loads(line) for line in history.read_text().splitlines()]
    assert [e["event"] for e in events].count("start") >= 1
    assert events[-1]["event"] in {"stop", "exit"}
    # The default config draws the working directory's port (server.port null); each start
    # records the one it took.
    for start in (e for e in events if e["event"] == "start"):
        with socket.socket() as s:  # the port is free again
            s.bind(("127.0.0.1", start["port"]))


@pytest.mark.slow
def test_the_drafter_learns_and_is_accepted_live(default_run):
    log = [json.loads(line) for line in (default_run / "drafter/train_log.jsonl").open()]
    first, last = log[0]["loss"], sum(e["loss"] for e in log[-10:]) / 10
    assert last < 0.8 * first
    offline = json.loads((default_run / "drafter/eval.json").read_text())
    live = json.loads((default_run / "drafter/live.json").read_text())
    # A layer-id or export bug would collapse the live figure to about 1.
    assert offline["acceptance_length"] > 1.2
    assert live["acceptance_length"] > 1.2
    # The offline figure predicts serving: on the same held-out turns, decoded to their end of
    # turn, live is within 10 % of the decode-order walk (issue 26).
    assert live["prompts"] == 32
    assert 0.9 <= live["live_over_offline"] <= 1.1
    # fp32: the live decode writes the regenerated replies again (as text; 31 of 32 on
    # 2026-12-04, the 32nd cut at the live token budget), and on those live equals offline.
    reproduced = live["by_stored_reply"]["reproduced"]
    assert reproduced["turns"] >= 24
    assert sum(p["reproduces_stored_reply"] for p in live["per_prompt"]) == reproduced["turns"]
    assert 0.95 <= reproduced["live_over_offline"] <= 1.05
    # fp32 on the CPU: speculative decoding is lossless on every prompt (else the stage fails).
    assert live["lossless"] == {
        "dtype": "float32",
        "prompts": 32,
        "identical": 32,
        "first_differences": [],
    }


@pytest.mark.slow
def test_the_report_holds_every_figure(default_run):
    html = (default_run / "report.html").read_text(errors="replace")
    for figure in FIGURES:
        assert (default_run / "report" / figure).stat().st_size > 5000, figure
        assert figure in html, f"{figure} missing from report.html"

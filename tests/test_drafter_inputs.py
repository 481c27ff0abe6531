"""What the drafter stages refuse to read: damaged chunks, and shards outside the run's plan.

Each test works on its own copy of a small run (real shards of a tiny target, validation
reports, the prepared table) and runs the scripts there, as the workflow does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import PYTHON, REPO_ROOT, build_tiny_llama
from drafter_helpers import flip_low_bit, make_inputs, synthetic_rows, write_shards

from eaglepipe.core.run import config_from_arg, resolve
from eaglepipe.drafter.target_head import load_target_head
from eaglepipe.drafter.train import build_drafter, save_drafter
from eaglepipe.drafter.vocab import build_draft_vocab, load_vocab, save_vocab


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("drafter-inputs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_dir = build_tiny_llama(root / "target")
        inputs = make_inputs(root, model_dir, epochs=1, batch_tokens=512)
    finally:
        torch.set_num_threads(threads)
    vocab, _ = build_draft_vocab(pd.read_parquet(inputs["table"]), 300, 128)
    save_vocab(vocab, root / "vocab.safetensors")
    inputs["vocab"] = root / "vocab.safetensors"
    # An untrained drafter is enough for evaluation to run.
    config = config_from_arg(inputs["config"])
    head = load_target_head(model_dir)
    drafter = build_drafter(resolve(config), load_vocab(inputs["vocab"]), head, seed=0)
    save_drafter(drafter, root / "model.safetensors", {"aux_layer_ids": "[1, 3, 4]"})
    inputs["model"] = root / "model.safetensors"
    return inputs


@pytest.fixture
def run(source, tmp_path) -> Path:
    """A private copy of the run's shards and reports; scripts run with it as working dir."""
    for part in ("hidden_states", "validated"):
        shutil.copytree(source["root"] / part, tmp_path / part)
    return tmp_path


def script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [PYTHON, "-u", str(REPO_ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


def train(source: dict, run: Path, *extra: str) -> subprocess.CompletedProcess:
    return script(
        "train.py", "--config", source["config"], "--vocab", str(source["vocab"]),
        "--table", source["table"], "--out", str(run / "drafter" / "model.safetensors"),
        "--log", str(run / "drafter" / "train_log.jsonl"),
        "--checkpoint-dir", str(run / "drafter" / "checkpoints"), *extra, cwd=run,
    )  # fmt: skip


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_training_stops_at_a_flipped_byte_in_a_validated_chunk(source, run):
    flip_low_bit(run / "hidden_states" / "rows_30-60" / "chunk-00001.safetensors")
    message = one_line_error(train(source, run))
    assert message.startswith(
        "error: chunk hidden_states/rows_30-60/chunk-00001.safetensors of shard rows_30-60 "
        "does not match its manifest's xxh3-128 checksum: "
    )
    assert message.endswith(
        "repair: `eaglepipe verify` sets the damaged shards aside, then `snakemake --cores N` "
        "re-extracts their damaged chunks (intact chunks are kept)"
    )
    assert not (run / "drafter" / "model.safetensors").exists()


def test_training_names_a_truncated_chunk(source, run):
    chunk = run / "hidden_states" / "rows_0-30" / "chunk-00000.safetensors"
    size = chunk.stat().st_size
    with open(chunk, "r+b") as f:
        f.truncate(size // 3)
    message = one_line_error(train(source, run))
    assert message.startswith(
        "error: chunk hidden_states/rows_0-30/chunk-00000.safetensors of shard rows_0-30 "
        f"is {size // 3} bytes, its manifest lists {size}: "
    )
    assert "repair: `eaglepipe verify` sets the damaged shards aside" in message
    assert not (run / "drafter" / "model.safetensors").exists()


def test_evaluation_stops_at_a_flipped_byte(source, run):
    flip_low_bit(run / "hidden_states" / "rows_0-30" / "chunk-00000.safetensors")
    result = script(
        "evaluate.py", "--config", source["config"], "--vocab", str(source["vocab"]),
        "--model", str(source["model"]), "--table", source["table"],
        "--out", str(run / "eval.json"), cwd=run,
    )  # fmt: skip
    message = one_line_error(result)
    assert message.startswith(
        "error: chunk hidden_states/rows_0-30/chunk-00000.safetensors of shard rows_0-30 "
        "does not match its manifest's xxh3-128 checksum: "
    )
    assert not (run / "eval.json").exists()


def test_training_reads_the_planned_shards_only(source, run):
    # A shard directory left from an earlier plan (rows_per_shard 60): validated, but not planned.
    rows = synthetic_rows(60, vocab_size=300)
    write_shards(Path(config_from_arg(source["config"])["model"]["path"]), rows, run, 60)
    assert (run / "hidden_states" / "rows_0-60" / "manifest.json").exists()
    # The README's old torchrun recipe globbed manifests and reports, and trained on the stale
    # shard too; those overrides are gone: no list of shards other than the plan is accepted.
    manifests = sorted(str(p.relative_to(run)) for p in run.glob("hidden_states/*/manifest.json"))
    reports = sorted(str(p.relative_to(run)) for p in run.glob("validated/*.json"))
    refused = train(source, run, "--manifests", *manifests, "--validated", *reports)
    assert refused.returncode == 2 and "unrecognized arguments: --manifests" in refused.stderr
    trained = train(source, run)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    # 48 train rows in rows_0-30 and rows_30-60; the stale rows_0-60 would double them.
    assert "training drafter: 48 rows" in trained.stdout

"""Multi-process training: the README's torchrun recipe (gloo on CPU) trains one DDP model on
the planned shards, and every rank stops at a damaged chunk."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import PYTHON, REPO_ROOT, build_tiny_llama, free_port
from drafter_helpers import flip_low_bit, make_inputs, synthetic_rows, write_shards
from safetensors import safe_open

from eaglepipe.core.run import config_from_arg
from eaglepipe.drafter.vocab import build_draft_vocab, save_vocab

TORCHRUN = os.path.join(os.path.dirname(PYTHON), "torchrun")
pytestmark = pytest.mark.skipif(
    not os.path.exists(TORCHRUN), reason="torchrun is not installed beside the interpreter"
)


def readme_recipe(nproc: int, cwd: Path) -> list[str]:
    """The README's torchrun command, word for word (globs expanded in `cwd`, as a shell
    would), on `nproc` local CPU ranks."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("torchrun "))
    block = []
    for line in lines[start:]:
        block.append(line.strip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            break
    words = []
    for word in shlex.split(" ".join(block)):
        matches = sorted(str(p.relative_to(cwd)) for p in cwd.glob(word)) if "*" in word else []
        words.extend(matches or [word])
    assert words[:3] == ["torchrun", "--nproc_per_node", "8"] and words[3] == "scripts/train.py"
    rendezvous = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [TORCHRUN, "--nproc_per_node", str(nproc), *rendezvous, str(REPO_ROOT / words[3])] + (
        words[4:]
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run directory laid out as the pipeline leaves it, plus shards of an earlier plan."""
    root = tmp_path_factory.mktemp("ddp")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_dir = build_tiny_llama(root / "target")
        inputs = make_inputs(root, model_dir, num_rows=30, epochs=2, batch_tokens=256)
        # rows_0-15 and rows_15-30, validated, from when shards.rows_per_shard was 15.
        write_shards(model_dir, synthetic_rows(30, vocab_size=300), root, rows_per_shard=15)
    finally:
        torch.set_num_threads(threads)
    (root / ".eaglepipe").mkdir()
    (root / ".eaglepipe" / "config.json").write_text(json.dumps(config_from_arg(inputs["config"])))
    vocab, _ = build_draft_vocab(pd.read_parquet(inputs["table"]), 300, 128)
    save_vocab(vocab, root / "drafter" / "vocab.safetensors")
    return root


def torchrun(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        readme_recipe(2, cwd), capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def test_the_readme_recipe_trains_one_model_on_the_planned_shards(run):
    result = torchrun(run)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world 2" in result.stdout
    # The planned shard rows_0-30 holds 24 train rows; the stale rows_0-15 and rows_15-30 (as a
    # glob of hidden_states/ would add) would double them.
    assert "training drafter: 24 rows" in result.stdout
    out = run / "drafter"
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    # One line per step, written by rank 0 only; each step's tokens cover both ranks' batches.
    assert [r["step"] for r in log] == list(range(1, len(log) + 1))
    total = int(result.stdout.split(" steps (")[0].rsplit(" ", 1)[1])
    assert len(log) == total
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "fc.weight" in f.keys() and "embed_tokens.weight" not in f.keys()


def test_every_rank_stops_at_a_chunk_another_rank_found_damaged(run, tmp_path):
    copy = tmp_path / "run"
    for part in ("hidden_states", "validated", "prepared", ".eaglepipe"):
        shutil.copytree(run / part, copy / part)
    (copy / "drafter").mkdir()
    shutil.copy(run / "drafter" / "vocab.safetensors", copy / "drafter")
    # Rank 1 checks the second chunk (the ranks of a node split the chunks).
    flip_low_bit(copy / "hidden_states" / "rows_0-30" / "chunk-00001.safetensors")
    result = torchrun(copy)
    assert result.returncode != 0
    error = (
        "error: chunk hidden_states/rows_0-30/chunk-00001.safetensors of shard rows_0-30 "
        "does not match its manifest's xxh3-128 checksum"
    )
    assert result.stderr.count(error) == 2, result.stderr
    assert not (copy / "drafter" / "model.safetensors").exists()

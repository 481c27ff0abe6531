"""Multi-process training: the same script under torchrun (gloo on CPU) trains one DDP model."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import pytest
import torch
from conftest import PYTHON, REPO_ROOT, build_tiny_llama
from drafter_helpers import make_inputs
from safetensors import safe_open

from eaglepipe.config import config_from_arg
from eaglepipe.drafter.vocab import build_draft_vocab, save_vocab


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    shutil.which("torchrun", path=os.path.dirname(PYTHON)) is None,
    reason="torchrun is not installed beside the interpreter",
)
def test_torchrun_two_ranks_train_one_model(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_dir = build_tiny_llama(tmp_path / "target")
        inputs = make_inputs(tmp_path, model_dir, num_rows=30, epochs=2, batch_tokens=256)
    finally:
        torch.set_num_threads(threads)
    import pandas as pd

    config = config_from_arg(inputs["config"])
    vocab, _ = build_draft_vocab(pd.read_parquet(inputs["table"]), 300, 128)
    save_vocab(vocab, tmp_path / "vocab.safetensors")
    out = tmp_path / "drafter"
    command = [
        os.path.join(os.path.dirname(PYTHON), "torchrun"), "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(REPO_ROOT / "scripts" / "train.py"), "--config", inputs["config"],
        "--vocab", str(tmp_path / "vocab.safetensors"), "--table", inputs["table"],
        "--manifests", *inputs["manifests"], "--validated", *inputs["validated"],
        "--out", str(out / "model.safetensors"), "--train-log", str(out / "train_log.jsonl"),
        "--checkpoint-dir", str(out / "checkpoints"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world 2" in result.stdout
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    # One line per step, written by rank 0 only; each step's tokens cover both ranks' batches.
    assert [r["step"] for r in log] == list(range(1, len(log) + 1))
    total = int(result.stdout.split(" steps (")[0].rsplit(" ", 1)[1])
    assert len(log) == total
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "fc.weight" in f.keys() and "embed_tokens.weight" not in f.keys()
    assert config["train"]["epochs"] == 2

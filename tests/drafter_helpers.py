"""Test inputs for the drafter stages: a prepared table, real shards of a tiny target, reports.

The shards hold the tiny target's real hidden states (transformers forward, aux ids per
eaglepipe/core/layers.py), written with the project's shard writer, so the drafter trains on
exactly what extraction would produce.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

from eaglepipe.core.config import PROJECT_ROOT
from eaglepipe.core.fingerprint import hash_file
from eaglepipe.core.layers import default_aux_layer_ids
from eaglepipe.extract.chunk_file import RowTensors, write_chunk
from eaglepipe.extract.shard_files import build_manifest, write_manifest


def synthetic_rows(num_rows: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """Token rows from a low-entropy Markov chain: a prompt (mask 0) then an answer (mask 1)."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, 3))
    rows = []
    for row_id in range(num_rows):
        length = int(rng.integers(40, 100))
        prompt = int(rng.integers(8, 20))
        ids = [int(rng.integers(0, vocab_size))]
        for _ in range(length - 1):
            ids.append(int(successors[ids[-1], rng.integers(0, 3)]))
        mask = [0] * prompt + [1] * (length - prompt)
        split = "eval" if row_id % 5 == 4 else "train"
        rows.append(
            {
                "row_id": row_id,
                "split": split,
                "num_tokens": length,
                "input_ids": ids,
                "loss_mask": mask,
                "truncated": False,
            }
        )
    return rows


def train_tiny_target(model_dir: Path, rows: list[dict], steps: int = 150, seed: int = 0) -> Path:
    """A few seconds of next-token training so the target's greedy choices are learnable."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    model.train()
    for _ in range(steps):
        picked = rng.choice(len(rows), size=8)
        ids = torch.tensor([rows[i]["input_ids"][:40] for i in picked])
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(model_dir)
    return model_dir


def write_table(rows: list[dict], path: Path) -> Path:
    table = pd.DataFrame(rows)
    table["input_ids"] = table["input_ids"].map(lambda x: np.asarray(x, dtype=np.int32))
    table["loss_mask"] = table["loss_mask"].map(lambda x: np.asarray(x, dtype=np.uint8))
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(path)
    return path


@torch.no_grad()
def write_shards(
    model_dir: Path,
    rows: list[dict],
    out_dir: Path,
    rows_per_shard: int,
    aux_ids: list[int] | None = None,
) -> tuple[list[str], list[str]]:
    """Shards of the target's hidden states and a validation report per shard."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    aux_ids = aux_ids or default_aux_layer_ids(num_layers)
    hidden = model.config.hidden_size
    manifests, reports = [], []
    for start in range(0, len(rows), rows_per_shard):
        part = rows[start : start + rows_per_shard]
        shard = f"rows_{start}-{start + len(part)}"
        shard_dir = out_dir / "hidden_states" / shard
        shard_dir.mkdir(parents=True, exist_ok=True)
        tensors = []
        for row in part:
            out = model(torch.tensor([row["input_ids"]]), output_hidden_states=True)
            aux = torch.cat([out.hidden_states[k + 1][0] for k in aux_ids], dim=-1)
            tensors.append(
                RowTensors(
                    row_id=row["row_id"],
                    input_ids=torch.tensor(row["input_ids"], dtype=torch.int32),
                    loss_mask=torch.tensor(row["loss_mask"], dtype=torch.uint8),
                    aux_hidden_states=aux.to(torch.bfloat16),
                    final_hidden_states=out.hidden_states[-1][0].to(torch.bfloat16),
                )
            )
        half = (len(tensors) + 1) // 2
        records = [
            write_chunk(shard_dir, i, group, hidden_size=hidden)
            for i, group in enumerate([tensors[:half], tensors[half:]])
            if group
        ]
        manifest = build_manifest(
            shard=shard,
            row_start=start,
            row_end=start + len(part),
            hidden_size=hidden,
            aux_layer_ids=aux_ids,
            records=records,
            provenance={"engine": "test"},
            timing={},
        )
        manifest_path = write_manifest(shard_dir, manifest)
        report_path = out_dir / "validated" / f"{shard}.json"
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "shard": shard,
            "manifest_xxh3_128": hash_file(manifest_path),
            "checks": {"integrity": {"ok": True}},
        }
        report_path.write_text(json.dumps(report))
        manifests.append(str(manifest_path))
        reports.append(str(report_path))
    return manifests, reports


def write_dataset(num_rows: int, path: Path) -> Path:
    """A source of `num_rows` rows: the shard plan is made from its row count (scripts read the
    shards the plan names, relative to their working directory)."""
    path.write_text("{}\n" * num_rows)
    return path


def write_config(
    path: Path, model_dir: Path, dataset: Path, rows_per_shard: int, **train_overrides
) -> Path:
    config = yaml.safe_load((PROJECT_ROOT / "config.yaml").read_text())
    config["model"]["path"] = str(model_dir)
    config["dataset"]["path"] = str(dataset)
    config["shards"]["rows_per_shard"] = rows_per_shard
    config["dataset"]["regenerate"]["enabled"] = False  # the drafter reads these rows as they are
    config["train"].update(
        {
            "draft_vocab_size": 128,
            "batch_tokens": 1024,
            "max_len": 256,
            "epochs": 6,
            "lr": 0.003,
            "warmup_steps": 5,
            "checkpoint_every": 10,
            "device": "cpu",
            **train_overrides,
        }
    )
    config["evaluate"].update({"max_rows": 16, "live_prompts": 3, "live_new_tokens": 24})
    path.write_text(yaml.safe_dump(config))
    return path


def make_inputs(tmp: Path, model_dir: Path, num_rows: int = 60, **train_overrides) -> dict:
    """Everything the drafter stages read, laid out as a pipeline run under `tmp` (run the
    scripts there); `model_dir` must already hold a tiny target."""
    rows = synthetic_rows(num_rows, vocab_size=300)
    table = write_table(rows, tmp / "prepared" / "tokenized.parquet")
    dataset = write_dataset(num_rows, tmp / "conversations.jsonl")
    manifests, reports = write_shards(model_dir, rows, tmp, rows_per_shard=30)
    config = write_config(tmp / "config.yaml", model_dir, dataset, 30, **train_overrides)
    return {
        "root": tmp,
        "config": str(config),
        "table": str(table),
        "manifests": manifests,
        "validated": reports,
        "rows": rows,
    }


def flip_low_bit(chunk: Path, tensor: str = "aux_hidden_states") -> None:
    """Flip the lowest bit of one bf16 value in the middle of `tensor` inside a chunk file: a
    silent change (the value stays finite and close), as a bad disk or copy would make it."""
    data = bytearray(chunk.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + header_len])[tensor]["data_offsets"]
    low_byte = 8 + header_len + start + ((end - start) // 2 & ~1)  # little-endian: low byte first
    data[low_byte] ^= 0x01
    chunk.write_bytes(bytes(data))

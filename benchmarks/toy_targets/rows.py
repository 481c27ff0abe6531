"""Seeded token rows and the run files the pipeline reads for them: the dataset and the prepared
table, written as prepare writes them (one row group per shard)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def seeded_rows(tokens: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[np.ndarray]:
    """Seeded rows of uniform length in [min_len, max_len] until `tokens` is reached."""
    rng = np.random.default_rng(seed)
    rows, total = [], 0
    while total < tokens:
        n = int(rng.integers(min_len, max_len + 1))
        rows.append(rng.integers(0, vocab, n, dtype=np.int64).astype(np.int32))
        total += n
    return rows


def train_table_bytes(rows, *, rows_per_shard: int, loss_masks=None) -> bytes:
    """The prepared table's bytes for `rows` (token id arrays; all train, none truncated) as
    prepare writes it: one row group per shard of `rows_per_shard` rows, so a shard job reads
    only its own rows. The loss masks are all ones unless given (one per row)."""
    from eaglepipe.prepare.table import prepared_table_bytes

    masks = [
        np.ones(len(ids), np.uint8) if loss_masks is None else np.asarray(loss_masks[i], np.uint8)
        for i, ids in enumerate(rows)
    ]
    return prepared_table_bytes(
        list(range(len(rows))),
        ["train"] * len(rows),
        [np.asarray(ids, np.int32) for ids in rows],
        masks,
        [False] * len(rows),
        [()] * len(rows),
        rows_per_shard,
    )


def write_prepared(
    run_dir: Path, rows, *, rows_per_shard: int, loss_masks=None, records=None
) -> Path:
    """A run directory's dataset and prepared table for `rows` as the pipeline sees them
    (conversations.jsonl, prepared/tokenized.parquet as `train_table_bytes` writes it,
    prepared/summary.json); returns the dataset path (the shard plan counts its rows).
    `records` are the dataset's JSON objects, one per row (default: a two-turn ShareGPT
    conversation each)."""
    prepared = run_dir / "prepared"
    prepared.mkdir(parents=True)
    dataset = run_dir / "conversations.jsonl"
    if records is None:
        records = [
            {"conversations": [{"from": "human", "value": f"row {i}"},
                               {"from": "gpt", "value": "ok"}]}
            for i in range(len(rows))
        ]  # fmt: skip
    with open(dataset, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    table = train_table_bytes(rows, rows_per_shard=rows_per_shard, loss_masks=loss_masks)
    (prepared / "tokenized.parquet").write_bytes(table)
    provenance = {"dataset_hash": "bench", "tokenizer_fingerprint": "bench"}
    (prepared / "summary.json").write_text(json.dumps({"rows": len(rows), **provenance}))
    return dataset

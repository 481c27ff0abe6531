#!/usr/bin/env python3
"""Validation throughput on synthetic shards (CPU only): GB/s re-hashed and GB/s fully checked.

Writes a synthetic shard with the real chunk writer (random bf16 hidden states, a matching
prepared table), then measures in one run:

- raw read: the chunk files read in 8 MiB blocks, nothing else (the ceiling on this machine);
- re-hash: `fingerprint.hash_file` over every chunk (the integrity check's cost);
- verify: `validate.verify_all` (integrity + schema, what `eaglepipe verify` runs);
- validate: `validate.validate_shard` with every check but the server spot check (integrity,
  schema, coverage, values, provenance), which reads each chunk once from disk.

The files were just written, so they are likely in the page cache: the numbers are CPU
throughput of the checks, a disk would be the bound. Ratios to the raw read are printed.

    python -u -m benchmarks.speed.validate [--gb 1.0] [--hidden 4096] [--chunk-mb 256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eaglepipe.core.config_files import load_config
from eaglepipe.core.fingerprint import hash_file
from eaglepipe.core.run import resolve
from eaglepipe.extract.chunk_file import RowTensors, plan_chunks, write_chunk
from eaglepipe.extract.shard_files import build_manifest, write_manifest
from eaglepipe.validate import ShardPaths, expected_provenance, validate_shard, verify_all

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK = 8 << 20


def build(root: Path, gb: float, hidden: int, chunk_mb: int, row_tokens: int) -> tuple[dict, str]:
    """A model dir (config.json only), a prepared table and one shard of about `gb` GB."""
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": hidden})
    )
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["validate"]["spot_check_rows"] = 0

    per_row = row_tokens * 4 * hidden * 2
    num_rows = max(1, int(gb * 1e9 // per_row))
    shard = f"rows_0-{num_rows}"
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 32000, row_tokens).astype(np.int32) for _ in range(num_rows)]
    masks = [(rng.random(row_tokens) < 0.5).astype(np.uint8) for _ in range(num_rows)]
    prepared = root / "prepared"
    prepared.mkdir()
    pq.write_table(
        pa.table(
            {
                "row_id": pa.array(range(num_rows), pa.int64()),
                "split": pa.array(["train"] * num_rows),
                "num_tokens": pa.array([row_tokens] * num_rows, pa.int32()),
                "input_ids": pa.array([a.tolist() for a in ids], pa.list_(pa.int32())),
                "loss_mask": pa.array([m.tolist() for m in masks], pa.list_(pa.uint8())),
                "truncated": pa.array([False] * num_rows),
            }
        ),
        prepared / "tokenized.parquet",
    )
    (prepared / "skipped.json").write_text(json.dumps({"count": 0, "reasons": {}, "rows": []}))
    (prepared / "summary.json").write_text(
        json.dumps({"provenance": {"dataset_hash": "d" * 32, "tokenizer_fingerprint": "t" * 32}})
    )

    chunks = plan_chunks(
        list(range(num_rows)), [row_tokens] * num_rows, hidden, max_chunk_bytes=chunk_mb << 20
    )
    shard_dir = root / "hidden_states" / shard
    shard_dir.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    # One random block reused (rolled) per row: writing, not the RNG, should dominate setup.
    base_aux = torch.randn(row_tokens, 3 * hidden, generator=generator).to(torch.bfloat16)
    base_final = torch.randn(row_tokens, hidden, generator=generator).to(torch.bfloat16)
    records = []
    for index, rows in enumerate(chunks):
        tensors = [
            RowTensors(
                row_id=row,
                input_ids=torch.from_numpy(ids[row]),
                loss_mask=torch.from_numpy(masks[row]),
                aux_hidden_states=base_aux.roll(row, 0),
                final_hidden_states=base_final.roll(row, 0),
            )
            for row in rows
        ]
        records.append(write_chunk(shard_dir, index, tensors, hidden_size=hidden))
    provenance = {
        **expected_provenance(resolve(config), prepared / "summary.json"),
        "shard_inputs_hash": "s" * 32,
        "engine": "synthetic",
        "engine_version": "0",
        "project_version": "0.1.0",
    }
    write_manifest(
        shard_dir,
        build_manifest(
            shard=shard,
            row_start=0,
            row_end=num_rows,
            hidden_size=hidden,
            aux_layer_ids=provenance["aux_layer_ids"],
            records=records,
            provenance=provenance,
            timing={},
        ),
    )
    return config, shard


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def raw_read(paths: list[Path]) -> None:
    buffer = bytearray(BLOCK)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="shard size in GB (default 1)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    parser.add_argument("--chunk-mb", type=int, default=256, help="chunk bound in MiB")
    parser.add_argument("--row-tokens", type=int, default=512, help="tokens per row")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement (best kept)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-validate-") as tmp:
        root = Path(tmp)
        print(f"building a {args.gb:g} GB synthetic shard (H={args.hidden}) in {root} ...")
        config, shard = build(root, args.gb, args.hidden, args.chunk_mb, args.row_tokens)
        shard_dir = root / "hidden_states" / shard
        chunk_paths = sorted(shard_dir.glob("chunk-*.safetensors"))
        total = sum(p.stat().st_size for p in chunk_paths)
        paths = ShardPaths(
            hidden_states_dir=root / "hidden_states",
            validated_dir=root / "validated",
            prepared_table=root / "prepared" / "tokenized.parquet",
            prepared_skipped=root / "prepared" / "skipped.json",
            prepared_summary=root / "prepared" / "summary.json",
        )
        print(f"{shard}: {len(chunk_paths)} chunk(s), {total / 1e9:.3f} GB")

        def best(fn) -> float:
            return min(timed(fn) for _ in range(args.repeat))

        def hash_all() -> None:
            for p in chunk_paths:
                hash_file(p)

        def verify() -> None:
            assert verify_all(root / "hidden_states", progress=False) == []

        def validate() -> None:
            validate_shard(resolve(config), shard, paths, progress=False)

        results = {
            "raw read": best(lambda: raw_read(chunk_paths)),
            "re-hash (xxh3-128)": best(hash_all),
            "verify (integrity+schema)": best(verify),
            "validate (all but spot check)": best(validate),
        }
        raw = total / results["raw read"]
        print(f"{'step':32s} {'seconds':>8s} {'GB/s':>7s} {'vs raw read':>11s}")
        for name, seconds in results.items():
            rate = total / seconds
            print(f"{name:32s} {seconds:8.3f} {rate / 1e9:7.2f} {rate / raw:10.2f}x")


if __name__ == "__main__":
    main()

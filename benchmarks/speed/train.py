#!/usr/bin/env python3
"""Drafter training throughput on synthetic shards of a target of a given shape.

Builds, under --work-dir: a stand-in target directory (config.json plus only the embedding and
lm_head tensors, which is all training reads), a prepared table, shards of random bf16 hidden
states written with the project's shard writer, validation reports and a draft vocabulary;
then runs the real training loop (eaglepipe.drafter.train) for --steps steps and reports, from
its per-step log, tokens/s and the fraction of step time spent waiting on the data loader.

    python -u -m benchmarks.speed.train                  # Llama-3.1-8B shape (GPU)
    python -u -m benchmarks.speed.train --tiny           # the toy shape, CPU-sized
    python -u -m benchmarks.speed.train --run-dir RUN --model-dir MODEL   # a run's own shards
    python -u -m benchmarks.speed.train --store-dtypes bf16,fp8          # both stores, one run

With --run-dir the shards are a run's own (its prepared table and hidden_states/*/manifest.json,
the caller having checked them: a report is written for each, as the validate stage would) and
the target is --model-dir; the 8B shape's batch tokens and draft vocabulary stay, the row length
is the table's longest row. benchmarks/studies/specforge/scale.py trains so on the rows it
extracted through SGLang, beside `specforge train` on SpecForge's features of the same rows.

`--store-dtypes bf16,fp8,fp8aux` trains once per stored dtype (extract.store) on the same random
values, stored as each says (e4m3 with float32 scales, dequantized on the training device), in
one run: the FP8 store's tokens/s against bf16's.

Results go to stdout and --out (JSON); BENCHMARKS.md records the GPU numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
import yaml
from safetensors.torch import save_file

from eaglepipe.core.config import PROJECT_ROOT
from eaglepipe.core.fingerprint import hash_file
from eaglepipe.core.hidden_store import HiddenStore, store_tensors
from eaglepipe.core.layers import default_aux_layer_ids
from eaglepipe.drafter.train import train
from eaglepipe.drafter.vocab import build_draft_vocab, save_vocab
from eaglepipe.extract.chunk_file import RowTensors, write_chunk
from eaglepipe.extract.shard_files import build_manifest, write_manifest

SHAPES = {
    # Llama-3.1-8B-Instruct
    "8b": dict(
        hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
        draft_vocab=32000, seq_len=2048, rows=64, batch_tokens=16384,
    ),
    # the embedded toy target
    "tiny": dict(
        hidden=64, layers=8, heads=4, kv_heads=2, intermediate=176, vocab=512,
        draft_vocab=256, seq_len=256, rows=64, batch_tokens=4096,
    ),
}  # fmt: skip


def make_target(directory: Path, s: dict, gen: torch.Generator) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "intermediate_size": s["intermediate"],
        "vocab_size": s["vocab"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    scale = s["hidden"] ** -0.5
    tensors = {
        "model.embed_tokens.weight": (torch.randn(s["vocab"], s["hidden"], generator=gen) * 0.02),
        "lm_head.weight": (torch.randn(s["vocab"], s["hidden"], generator=gen) * scale),
    }
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()}, directory / "model.safetensors"
    )


def stored(row: RowTensors, store: HiddenStore) -> RowTensors:
    """The row as `store` keeps it (what extraction with that store writes)."""
    if store.is_default:
        return row
    tensors = store_tensors(store, row.aux_hidden_states, row.final_hidden_states, 3)
    row.aux_hidden_states = tensors.pop("aux_hidden_states")
    row.final_hidden_states = tensors.pop("final_hidden_states")
    row.scales = tensors
    return row


def make_shards(work: Path, s: dict, gen: torch.Generator, aux_ids: list[int], store):
    rows, manifests = [], []
    per_shard = 16
    for start in range(0, s["rows"], per_shard):
        shard = f"rows_{start}-{start + per_shard}"
        shard_dir = work / "hidden_states" / shard
        shard_dir.mkdir(parents=True, exist_ok=True)
        records = []
        for chunk_index, chunk_start in enumerate(range(start, start + per_shard, 4)):
            group = []
            for row_id in range(chunk_start, chunk_start + 4):
                n = s["seq_len"]
                ids = torch.randint(0, s["vocab"], (n,), generator=gen, dtype=torch.int32)
                mask = torch.ones(n, dtype=torch.uint8)
                mask[: n // 8] = 0
                group.append(
                    RowTensors(
                        row_id=row_id,
                        input_ids=ids,
                        loss_mask=mask,
                        aux_hidden_states=torch.randn(n, 3 * s["hidden"], generator=gen).to(
                            torch.bfloat16
                        ),
                        final_hidden_states=torch.randn(n, s["hidden"], generator=gen).to(
                            torch.bfloat16
                        ),
                    )
                )
                rows.append(
                    {
                        "row_id": row_id,
                        "split": "train",
                        "num_tokens": n,
                        "input_ids": ids.numpy(),
                        "loss_mask": mask.numpy(),
                        "truncated": False,
                    }
                )
            group = [stored(row, store) for row in group]
            records.append(
                write_chunk(shard_dir, chunk_index, group, hidden_size=s["hidden"], store=store)
            )
        manifest = build_manifest(
            shard=shard,
            row_start=start,
            row_end=start + per_shard,
            hidden_size=s["hidden"],
            aux_layer_ids=aux_ids,
            records=records,
            provenance={"engine": "synthetic"},
            timing={},
            store=store,
        )
        manifests.append(str(write_manifest(shard_dir, manifest)))
    return pd.DataFrame(rows), manifests, validated_reports(work, manifests)


def validated_reports(work: Path, manifests: list[str]) -> list[str]:
    """A validation report per shard, as the validate stage names it (shard and manifest hash):
    the shards here are synthetic, or a benchmark's own extraction it has checked itself."""
    reports = []
    for manifest in manifests:
        shard = Path(manifest).parent.name
        report = work / "validated" / f"{shard}.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        # Training refuses a report that records no passed check (a hand-made one, to it).
        checks = {"benchmark": {"ok": True, "note": "written by bench_train, not validated"}}
        report.write_text(
            json.dumps({"shard": shard, "manifest_xxh3_128": hash_file(manifest), "checks": checks})
        )
        reports.append(str(report))
    return reports


def existing_inputs(run_dir: Path, work: Path):
    """A run's prepared table and finished shards (hidden_states/*/manifest.json), with a
    report for each shard (the caller has checked the shards): what --run-dir trains on."""
    table_path = run_dir / "prepared" / "tokenized.parquet"
    manifests = sorted(str(p) for p in (run_dir / "hidden_states").glob("*/manifest.json"))
    if not manifests:
        raise SystemExit(f"{run_dir}/hidden_states holds no finished shard")
    aux_ids = json.loads(Path(manifests[0]).read_text())["aux_layer_ids"]
    reports = validated_reports(work, manifests)
    return pd.read_parquet(table_path), table_path, manifests, reports, aux_ids


def synthetic_inputs(work: Path, s: dict, gen: torch.Generator, aux_ids: list[int], store):
    """The stand-in target, random shards, their reports and the table (see the module doc)."""
    make_target(work / "target", s, gen)
    table, manifests, reports = make_shards(work, s, gen, aux_ids, store)
    table_path = work / "prepared" / "tokenized.parquet"
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(table_path)
    return table, table_path, manifests, reports


def train_config(
    s: dict, target: Path, aux_ids: list[int], steps: int, rows: int, store: dict | None = None
) -> dict:
    """config.yaml with the shape's training settings: its batch tokens, row length and draft
    vocabulary, enough epochs for `steps`, no checkpoint on the way."""
    from eaglepipe.core.config import validate_config

    config = yaml.safe_load((PROJECT_ROOT / "config.yaml").read_text())
    config["model"]["path"] = str(target)
    config["aux_layer_ids"] = aux_ids
    if store is not None:
        config["extract"]["store"] = store
    steps_per_epoch = max(1, rows * s["seq_len"] // s["batch_tokens"])
    config["train"].update(
        {
            "draft_vocab_size": s["draft_vocab"],
            "batch_tokens": s["batch_tokens"],
            "max_len": s["seq_len"],
            "epochs": max(1, -(-steps // steps_per_epoch)),
            "checkpoint_every": 10**6,
            "warmup_steps": 2,
            "lr": 1e-4,
        }
    )
    return validate_config(config)


def measure(work: Path, config: dict, table_path: Path, manifests, reports, args) -> dict:
    """The real training loop for --steps steps; tokens/s and data wait from its step log,
    the first --warmup-steps left out."""
    from eaglepipe.core.run import resolve

    summary = train(
        resolve(config),
        vocab_path=str(work / "vocab.safetensors"),
        table_path=str(table_path),
        manifests=manifests,
        validated=reports,
        out_path=str(work / "drafter.safetensors"),
        log_path=str(work / "train_log.jsonl"),
        checkpoint_dir=str(work / "checkpoints"),
        stop_after_steps=args.steps,
    )
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    timed = log[args.warmup_steps :] or log
    compute = sum(r["seconds"] for r in timed)
    waited = sum(r["data_wait_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU x{torch.get_num_threads()}"
    )
    return {
        "device": device,
        "torch": torch.__version__,
        "batch_tokens": config["train"]["batch_tokens"],
        "ttt_length": config["train"]["ttt_length"],
        "steps": len(log),
        "timed_steps": len(timed),
        "timed_tokens": tokens,
        "tokens_per_s": tokens / (compute + waited),
        "data_wait_fraction": waited / (compute + waited),
        "median_step_s": statistics.median(r["seconds"] + r["data_wait_s"] for r in timed),
        "peak_gpu_memory_gib": (
            torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        ),
        "final_loss": summary["final_loss"],
    }


def run_one(args, shape_name: str, s: dict, work: Path, store_name: str) -> dict:
    """Inputs (synthetic in `store_name`'s store, or --run-dir's), training, the result."""
    from benchmarks.stores import STORE_VARIANTS

    work.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)  # every store stores the same values
    store = STORE_VARIANTS[store_name]
    began = time.perf_counter()
    if args.run_dir is not None:
        table, table_path, manifests, reports, aux_ids = existing_inputs(args.run_dir, work)
        target = args.model_dir
        s.update(rows=len(table), seq_len=int(table["num_tokens"].max()))
        source = str(args.run_dir)
        store = json.loads(Path(manifests[0]).read_text()).get("stored_dtypes")
        store = HiddenStore.from_manifest({"stored_dtypes": store}).as_dict()
    else:
        aux_ids = default_aux_layer_ids(s["layers"])
        inputs = synthetic_inputs(work, s, gen, aux_ids, HiddenStore(**store))
        table, table_path, manifests, reports = inputs
        target = work / "target"
        source = "synthetic"
    vocab, _ = build_draft_vocab(table, s["vocab"], s["draft_vocab"])
    save_vocab(vocab, work / "vocab.safetensors")
    shard_bytes = sum(
        Path(m).parent.joinpath(c["file"]).stat().st_size
        for m in manifests
        for c in json.loads(Path(m).read_text())["chunks"]
    )
    print(
        f"{shape_name} inputs ({source}, store {store}): {s['rows']} rows x {s['seq_len']} "
        f"tokens, {shard_bytes / 2**30:.2f} GiB of shards in {time.perf_counter() - began:.0f}s",
        flush=True,
    )
    config = train_config(s, target, aux_ids, args.steps, s["rows"], store)
    return {
        "shape": shape_name,
        "inputs": source,
        "store": store,
        **measure(work, config, table_path, manifests, reports, args),
        "shard_gib": shard_bytes / 2**30,
    }


def main() -> None:
    from benchmarks.stores import store_variants

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the toy shape (CPU)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of timing")
    parser.add_argument("--work-dir", default="/tmp/eaglepipe-bench-train")
    parser.add_argument(
        "--run-dir", type=Path, default=None,
        help="train on this run's prepared table and finished shards (hidden_states/), not on "
        "synthetic ones (needs --model-dir); the row length is the table's longest row",
    )  # fmt: skip
    parser.add_argument("--model-dir", type=Path, default=None, help="the target, with --run-dir")
    parser.add_argument(
        "--store-dtypes", default="bf16",
        help="synthetic shards in each of these stored dtypes (bf16, fp8, fp8aux), trained one "
        "after another in this run",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write the results JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    args = parser.parse_args()
    if (args.run_dir is None) != (args.model_dir is None):
        parser.error("--run-dir and --model-dir go together")
    stores = store_variants(parser, "--store-dtypes", args.store_dtypes)
    if args.run_dir is not None and len(stores) > 1:
        parser.error("--run-dir trains on the run's own store: one --store-dtypes at most")
    shape_name = "tiny" if args.tiny else "8b"
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    if len(stores) == 1:
        result = run_one(args, shape_name, dict(SHAPES[shape_name]), work, stores[0])
    else:
        runs = {
            name: run_one(args, shape_name, dict(SHAPES[shape_name]), work / name, name)
            for name in stores
        }
        base = runs.get("bf16")
        result = {
            "shape": shape_name,
            "inputs": "synthetic",
            "stores": runs,
            "tokens_per_s_vs_bf16": {
                name: r["tokens_per_s"] / base["tokens_per_s"] for name, r in runs.items()
            }
            if base
            else None,
        }
    print(json.dumps(result, indent=2), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Does dumping hidden states slow the forward pass down? Time per batch, with and without.

Builds a random-weight Llama target on the device (no download), then runs the same batches
of right-padded requests four ways and reports time per batch:

- `forward`: the plain forward pass, no hooks.
- `capture`: forward with the capture hooks (aux layers + final norm, real tokens gathered).
- `capture+async_dump`: capture, then `DumpWriter.submit` (pinned device-to-host copy on a side
  stream, files written by the writer thread). The loop never waits for the disk; the files
  are deleted as they land, as the client would.
- `capture+sync_dump`: the same, but waiting for each batch's files before the next forward
  (what a naive hook does), for contrast.

A ratio of `capture+async_dump` to `capture` near 1.0 means the dump path keeps the forward
unblocked. Before timing, one batch is dumped and read back and must equal the captured
tensors bit for bit (bf16). Results: one markdown table on stdout and a JSON file.

    python -u -m benchmarks.speed.dump_gpu                  # H200: 4096-wide, 8 layers
    python -u -m benchmarks.speed.dump_gpu --tiny --device cpu   # quick check anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.toy_targets.llama import random_llama
from eaglepipe.core.layers import default_aux_layer_ids  # noqa: E402
from eaglepipe.server.handoff.dump_writer import DumpWriter  # noqa: E402
from eaglepipe.server.handoff.dumps import dump_path, prepare_dump_dir, read_dump
from eaglepipe.server.handoff.request_ids import make_rid
from eaglepipe.server.reference.capture import HiddenStateCapture  # noqa: E402

MODES = ("forward", "capture", "capture+async_dump", "capture+sync_dump")
NONCE = "b0b0b0b0b0b0"
MODEL_KEYS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward")
    parser.add_argument("--seq-len", type=int, default=1024, help="longest request; others vary")
    parser.add_argument("--batches", type=int, default=20, help="timed batches per mode")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4, help="rounds over all modes")
    parser.add_argument("--max-pinned-bytes", type=int, default=2 << 30)
    parser.add_argument("--file-threads", type=int, default=4, help="DumpWriter file_threads")
    parser.add_argument("--dump-dir", default=None, help="default: a dir under /dev/shm")
    parser.add_argument("--out", default="benchmarks/results/dump_gpu.json")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke run")
    args = parser.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads = 64, 8, 4, 2
        args.intermediate, args.vocab, args.seq_len, args.batch_size = 128, 512, 64, 4
        args.batches, args.warmup, args.repeats = 4, 1, 1
    return args


def build_model(args, device: torch.device, dtype: torch.dtype):
    return random_llama(
        device,
        dtype,
        seed=0,
        vocab=args.vocab,
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        max_pos=max(4096, args.seq_len),
    )


def make_batches(args, count: int, seed: int) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(
            args.seq_len // 2, args.seq_len + 1, (args.batch_size,), generator=gen
        )
        batches.append(
            [torch.randint(0, args.vocab, (int(n),), generator=gen).tolist() for n in lengths]
        )
    return batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_round_trip(capture, aux_ids, writer, batch, dump_dir) -> None:
    """Dump one batch through the real path and check the files equal the captured tensors."""
    aux, final, counts = capture.run(batch, aux_ids)
    expected_aux = aux.to(torch.bfloat16).cpu()
    expected_final = final.to(torch.bfloat16).cpu()
    rids = [make_rid("bench", NONCE, 10_000_000 + i, 0) for i in range(len(batch))]
    writer.submit(rids, counts, aux, final)
    writer.flush()
    start = 0
    for rid, count in zip(rids, counts, strict=True):
        got_aux, got_final, meta = read_dump(dump_path(dump_dir, rid))
        if meta["num_tokens"] != count or not (
            torch.equal(got_aux, expected_aux[start : start + count])
            and torch.equal(got_final, expected_final[start : start + count])
        ):
            raise SystemExit(f"verify: dump of {rid} differs from the captured tensors")
        dump_path(dump_dir, rid).unlink()
        start += count
    print(f"verify: {len(rids)} dumps equal the captured tensors bit for bit", flush=True)


def run_mode(mode, model, capture, aux_ids, writer, batches, device, tag) -> dict:
    """Time `len(batches)` forwards; returns seconds of the loop and until files were done."""
    tokens = sum(len(s) for b in batches for s in b)
    sync(device)
    start = time.perf_counter()
    for index, batch in enumerate(batches):
        if mode == "forward":
            lengths = [len(s) for s in batch]
            ids = torch.zeros((len(batch), max(lengths)), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, seq in enumerate(batch):
                ids[row, : len(seq)] = torch.as_tensor(seq)
                mask[row, : len(seq)] = 1
            with torch.inference_mode():
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False,
                      logits_to_keep=1)  # fmt: skip
            continue
        aux, final, counts = capture.run(batch, aux_ids)
        if mode == "capture":
            continue
        rids = [make_rid("bench", NONCE, index * 1000 + i, tag) for i in range(len(batch))]
        writer.submit(rids, counts, aux, final, on_done=writer.consume)
        if mode == "capture+sync_dump":
            writer.flush()
    sync(device)
    loop_s = time.perf_counter() - start
    if writer is not None:
        writer.flush()
    done_s = time.perf_counter() - start
    return {"loop_s": loop_s, "done_s": done_s, "tokens": tokens}


class ConsumingWriter(DumpWriter):
    """A DumpWriter whose files are deleted as soon as they land, as the client would."""

    def consume(self, rid: str, error: BaseException | None) -> None:
        if error is not None:
            raise error
        dump_path(self.dump_dir, rid).unlink()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.tiny and device.type == "cpu":
        torch.set_num_threads(1)  # tiny matrices: more threads only contend on a busy machine
    dtype = {
        "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
    }[args.dtype]
    aux_ids = default_aux_layer_ids(args.layers)
    base = Path(args.dump_dir) if args.dump_dir else None
    if base is None:
        # tmpfs like production, unless it is too small (containers often give 64 MB).
        batch_bytes = args.batch_size * args.seq_len * 8 * args.hidden
        shm = Path("/dev/shm")
        roomy = shm.is_dir() and shutil.disk_usage(shm).free > 4 * batch_bytes
        base = Path(tempfile.mkdtemp(prefix="eaglepipe-bench-", dir=shm if roomy else None))
    dump_dir = prepare_dump_dir(base / "dumps")
    print(
        f"model: llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {dtype} "
        f"on {device}; batch {args.batch_size} x <= {args.seq_len} tokens; aux ids {aux_ids}; "
        f"dumps to {dump_dir} with {args.file_threads} file threads",
        flush=True,
    )
    model = build_model(args, device, dtype)
    capture = HiddenStateCapture(model, aux_ids)
    writer = ConsumingWriter(
        dump_dir,
        "bench",
        aux_layer_ids=aux_ids,
        max_pinned_bytes=args.max_pinned_bytes,
        file_threads=args.file_threads,
    )
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        verify_round_trip(capture, aux_ids, writer, make_batches(args, 1, seed=99)[0], dump_dir)
        # Clocks, kernels and the caching allocator settle before anything is timed.
        warm_all = make_batches(args, 2 * args.warmup, seed=7)
        run_mode("capture+async_dump", model, capture, aux_ids, writer, warm_all, device, tag=0)
        for repeat in range(args.repeats):
            # Rotate the order each round so no mode always runs first.
            order = MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]
            for mode in order:
                mode_index = MODES.index(mode)
                seed = 1000 * repeat + mode_index
                warm = make_batches(args, args.warmup, seed=seed + 500)
                run_mode(mode, model, capture, aux_ids, writer, warm, device, tag=1)
                batches = make_batches(args, args.batches, seed=seed)
                timing = run_mode(mode, model, capture, aux_ids, writer, batches, device, tag=2)
                results[mode].append(timing)
                per_batch = timing["loop_s"] / args.batches * 1000
                print(f"round {repeat + 1} {mode}: {per_batch:.2f} ms/batch", flush=True)
        writer.close()
    finally:
        shutil.rmtree(base if not args.dump_dir else dump_dir, ignore_errors=True)

    def per_batch_ms(mode, key="loop_s"):
        return statistics.median(r[key] for r in results[mode]) / args.batches * 1000

    hidden_bytes = 2 * 4 * args.hidden  # bf16 aux (3H) + final (H) per token
    tokens = statistics.median(r["tokens"] for r in results["capture"])
    baseline = per_batch_ms("capture")
    rows = []
    for mode in MODES:
        ms = per_batch_ms(mode)
        done_ms = per_batch_ms(mode, "done_s")
        dumped = "dump" in mode
        rows.append(
            {
                "mode": mode,
                "ms_per_batch": round(ms, 3),
                "ms_per_batch_until_files_written": round(done_ms, 3),
                "tokens_per_s": round(tokens / args.batches / (ms / 1000)),
                "ratio_to_capture": round(ms / baseline, 3),
                "dumped_mb_per_s": round(
                    tokens * hidden_bytes / (done_ms / 1000 * args.batches) / 1e6
                )
                if dumped
                else None,
            }
        )
    print()
    print("| mode | ms/batch (forward loop) | ms/batch (files written) | tokens/s | vs capture |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['ms_per_batch']:.2f} | "
            f"{row['ms_per_batch_until_files_written']:.2f} | {row['tokens_per_s']} | "
            f"{row['ratio_to_capture']:.3f} |"
        )
    report = {
        "benchmark": "dump_gpu",
        "device": device_name(device),
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "model": {k: getattr(args, k) for k in MODEL_KEYS},
        "batch_size": args.batch_size,
        "seq_len_max": args.seq_len,
        "tokens_per_batch": tokens / args.batches,
        "batches": args.batches,
        "repeats": args.repeats,
        "aux_layer_ids": aux_ids,
        "file_threads": args.file_threads,
        "max_pinned_bytes": args.max_pinned_bytes,
        "dump_dir_fs": str(dump_dir.parent.parent),
        "pinned_bytes_peak": writer.pinned_peak_bytes,
        "results": rows,
        "raw": results,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

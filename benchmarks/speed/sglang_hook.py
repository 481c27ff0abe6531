#!/usr/bin/env python3
"""Benchmark the SGLang dump hook's own path with SGLang-shaped tensors.

The hook (patch/eaglepipe_hook.py) is registered on a logits-processor stand-in exactly as
SGLang's hook manager registers it, and fed prefill batches shaped as SGLang 0.5.23 passes
them: final post-norm hidden states [T, H] and the aux captures, either packed [T, 3H]
(DeepSeek family) or a list of three [T, H] (Llama family), several requests per batch.

It reports, per batch size:
- blocked_idle_ms: host time the forward thread spends inside the hook per batch while the
  writer is idle (the hook's own cost: gather, queueing the device-to-host copy);
- forward_ms / forward_hooked_ms: a simulated forward (GPU matmuls) timed alone and with the
  hook attached, synchronised per batch, and their ratio (the slowdown the hook causes);
- blocked_loaded_ms and sustained GB/s: back-to-back batches (the writer's backpressure shows
  in the blocked time once the forward outruns it) and bytes of dump files renamed into place
  per second, while a consumer thread deletes dumps as the client would.

Defaults are the motivating shape (H = 7168, 8k-32k tokens per batch) on CUDA; `--quick` runs
small sizes on CPU as a smoke check. Ratios are measured within one run; nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import threading
import time
import types
import uuid
from pathlib import Path

import torch
from torch import nn

# The hook as SGLang finds it: a top-level module of patch/ (the launcher puts patch/ on the
# server's PYTHONPATH), loaded here from its file.
HOOK_FILE = Path(__file__).resolve().parents[2] / "patch" / "eaglepipe_hook.py"


class LogitsProcessorStandIn(nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
        return hidden_states[-1:].float().sum()


class _ForwardMode:
    """Minimal stand-in for sglang's ForwardMode.EXTEND (what the hook reads)."""

    name = "EXTEND"

    def is_decode_or_idle(self) -> bool:
        return False


def load_hook(dump_dir: Path, aux_ids: list[int], prefix: str):
    """Import the hook as SGLang would, with TP rank 0 (no SGLang on this machine)."""
    runtime_context = types.ModuleType("sglang.srt.runtime_context")
    runtime_context.get_parallel = lambda: types.SimpleNamespace(tp_rank=0)
    for name in ("sglang", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["sglang.srt.runtime_context"] = runtime_context
    eaglepipe_hook = sys.modules.get("eaglepipe_hook")
    if eaglepipe_hook is None:
        loader = importlib.util.spec_from_file_location("eaglepipe_hook", HOOK_FILE)
        eaglepipe_hook = importlib.util.module_from_spec(loader)
        sys.modules["eaglepipe_hook"] = eaglepipe_hook
        loader.loader.exec_module(eaglepipe_hook)

    from eaglepipe.server.sglang.recipe import hook_spec

    spec = hook_spec(
        dump_dir=dump_dir, request_prefix=prefix, aux_layer_ids=aux_ids, instance_id="bench"
    )
    return eaglepipe_hook.make_dump_hook(spec["config"])


class Consumer(threading.Thread):
    """Deletes renamed dumps as the client would, so the handoff dir stays small."""

    def __init__(self, dump_dir: Path):
        super().__init__(daemon=True)
        self.dump_dir = dump_dir
        self.stop = threading.Event()
        self.files = 0
        self.bytes = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.drain()
            time.sleep(0.005)
        self.drain()

    def drain(self) -> None:
        for path in self.dump_dir.glob("*.safetensors"):
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            self.files += 1
            self.bytes += size


def sync(device: torch.device) -> None:
    """Wait for the forward (current) stream only: the dump's copy stream runs beside it."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def make_batch(tokens: int, requests: int, hidden: int, layout: str, device, prefix, batch_no):
    lens = [tokens // requests] * requests
    lens[-1] += tokens - sum(lens)
    rids = [
        f"{prefix}-{uuid.uuid4().hex[:12]}-{batch_no * requests + i}-0" for i in range(requests)
    ]
    final = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    captures = [torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16) for _ in range(3)]
    aux = captures if layout == "list" else torch.cat(captures, dim=-1)
    forward_batch = types.SimpleNamespace(
        forward_mode=_ForwardMode(),
        rids=rids,
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * requests,
        contains_last_prefill_chunk=True,
    )
    return final, aux, forward_batch


def simulated_forward(weights: torch.Tensor, x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = torch.tanh(x @ weights)
    return x


def bench_size(args, device, tokens: int, layout: str, dump_root: Path) -> dict:
    dump_dir = dump_root / f"{layout}-{tokens}"
    hook = load_hook(dump_dir, [1, 29, 57], args.prefix)
    hooked = LogitsProcessorStandIn()
    hooked.register_forward_hook(hook)
    plain = LogitsProcessorStandIn()
    consumer = Consumer(hook.dump_dir)
    consumer.start()
    weights = torch.randn(args.hidden, args.hidden, device=device, dtype=torch.bfloat16) * 0.01
    batches = [
        make_batch(tokens, args.requests, args.hidden, layout, device, args.prefix, i)
        for i in range(2)
    ]
    x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16)

    def one_forward(module, batch_no):
        final, aux, forward_batch = batches[batch_no % 2]
        # Fresh rids per call, as every request is new.
        forward_batch.rids = [
            f"{r.rsplit('-', 2)[0]}-{batch_no}-{i}" for i, r in enumerate(forward_batch.rids)
        ]
        simulated_forward(weights, x, args.forward_steps)
        start = time.perf_counter()
        module(None, final, None, forward_batch, aux)
        return time.perf_counter() - start

    # Warm-up: allocator, pinned pool, copy stream.
    for i in range(2):
        one_forward(hooked, 10_000 + i)
    hook.writer.flush()

    # Idle writer: the hook's own cost per batch (the writer drained before each timed call).
    plain_ms, hooked_ms, blocked_ms = [], [], []
    for i in range(args.batches):
        hook.writer.flush()
        sync(device)
        t0 = time.perf_counter()
        one_forward(plain, 20_000 + i)
        sync(device)
        plain_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        blocked = one_forward(hooked, 30_000 + i)
        sync(device)
        hooked_ms.append((time.perf_counter() - t0) * 1e3)
        blocked_ms.append(blocked * 1e3)
    hook.writer.flush()

    # Sustained: back-to-back hooked forwards until every dump is renamed; when the forward
    # outruns the writer, the bounded pinned pool blocks the forward (backpressure).
    written_before = hook.writer.bytes_written
    loaded_ms = []
    t0 = time.perf_counter()
    for i in range(args.batches):
        loaded_ms.append(one_forward(hooked, 40_000 + i) * 1e3)
    hook.writer.flush()
    seconds = time.perf_counter() - t0
    sustained = hook.writer.bytes_written - written_before
    hook.close()
    consumer.stop.set()
    consumer.join()
    dump_bytes_per_batch = tokens * args.hidden * 4 * 2
    return {
        "layout": layout,
        "tokens_per_batch": tokens,
        "requests_per_batch": args.requests,
        "batch_mb": round(dump_bytes_per_batch / 1e6, 1),
        "blocked_idle_ms_median": round(statistics.median(blocked_ms), 3),
        "blocked_idle_ms_max": round(max(blocked_ms), 3),
        "blocked_loaded_ms_median": round(statistics.median(loaded_ms), 3),
        "forward_ms": round(statistics.median(plain_ms), 3),
        "forward_hooked_ms": round(statistics.median(hooked_ms), 3),
        "hooked_over_plain": round(statistics.median(hooked_ms) / statistics.median(plain_ms), 3),
        "sustained_gb_per_s": round(sustained / seconds / 1e9, 3),
        "sustained_tokens_per_s": round(args.batches * tokens / seconds),
        "files_consumed": consumer.files,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes on CPU")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--requests", type=int, default=8, help="requests per batch")
    parser.add_argument("--batches", type=int, default=8, help="timed batches per size")
    parser.add_argument("--forward-steps", type=int, default=12, help="matmuls per fake forward")
    parser.add_argument("--layouts", nargs="+", default=["packed", "list"])
    parser.add_argument("--dump-root", default=None, help="default: a temp dir in /dev/shm")
    parser.add_argument("--prefix", default="eaglepipe")
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.device, args.hidden, args.tokens = "cpu", 256, [512, 2048]
        args.batches, args.forward_steps = 3, 2
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but CUDA is not available")
    shm = Path("/dev/shm")
    base = args.dump_root or (str(shm) if shm.is_dir() else None)
    results = []
    with tempfile.TemporaryDirectory(dir=base, prefix="bench-sglang-hook-") as root:
        for layout in args.layouts:
            for tokens in args.tokens:
                row = bench_size(args, device, tokens, layout, Path(root))
                results.append(row)
                print(json.dumps(row), flush=True)
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "hidden": args.hidden,
        "torch": torch.__version__,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=2) + "\n")
    print(f"done: {len(results)} configurations on {info['device']}", flush=True)


if __name__ == "__main__":
    main()

"""Which MLA shapes SGLang serves with the pipeline's own server flags.

For each candidate shape (hidden, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
v_head_dim) a DeepSeek-V3-shaped toy with random weights is built
(benchmarks/toy_targets/deepseek.py --steps 0), then served twice, each through the pipeline's
lifecycle: by the capture server (one prefill-only request of --prompt-tokens, as extraction
sends it, and the dump it leaves; then --batch-rows such requests of 100 to --prompt-tokens
tokens at once, the batched prefill extraction makes) and by the generation server (a greedy
decode of --new-tokens, as regeneration and live acceptance need). Each outcome is recorded with the
server log's first error line. Servers start with CUDA_LAUNCH_BLOCKING=1, so a failing kernel is
named where it fails, not at a later call.

    python -u -m benchmarks.checks.sglang_mla_probe --shapes 64,64,48,32,16,32 --out probe.json
    (on the H200: bash tools/h200.sh mla-probe OUT [--shapes ...])

With --dry-run (a CPU machine, --sglang-version) the toys are built and each server's command
is written to the results, nothing is started.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import (
    REPO_ROOT,
    free_port,
    log,
    machine_info,
    working_directory,
    write_results,
)
from benchmarks.sglang_runs import SGLANG_EXTRA_ARGS, planned_sglang_commands
from benchmarks.toy_targets.deepseek import DEFAULT_SHAPE

# 48 + 16 with v_head_dim 32 crashed in a batched prefill on the H200 (2026-12-04); the suspect
# is Triton's [128 x 64] . [64 x 32] dot in SGLang's extend kernel on sm_90 (BLOCK_DV 32): the
# same shape with v_head_dim 64 tells. Then the 288 split, whose batch was not reached.
DEFAULT_SHAPES = "64,64,48,32,16,64;64,64,48,32,16,32;256,96,256,64,32,64"
ERROR_LINE = re.compile(r"(Error|error:|CUBLAS|illegal|Cannot make_shape)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="';'-separated shapes")
    parser.add_argument("--prompt-tokens", type=int, default=900)
    parser.add_argument("--batch-rows", type=int, default=32, help="prefills sent at once")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--sglang-version", default=None, help="for --dry-run")
    parser.add_argument("--health-s", type=float, default=240.0)
    parser.add_argument("--deadline-s", type=float, default=480.0)
    parser.add_argument("--work-root", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.dry_run and not args.sglang_version:
        parser.error("--dry-run needs --sglang-version")
    return args


def build_toy(shape: str, out: Path) -> None:
    subprocess.run(
        [sys.executable, "-u", "-m", "benchmarks.toy_targets.deepseek",
         "--corpus", str(REPO_ROOT / "data" / "sample" / "conversations.jsonl"),
         "--out", str(out), "--steps", "0", "--shape", shape],
        check=True, stdout=subprocess.DEVNULL, cwd=REPO_ROOT,
    )  # fmt: skip


def probe_config(run_dir: Path, model_dir: Path) -> dict:
    from eaglepipe.core.config import validate_config
    from eaglepipe.core.config_files import load_config

    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["server"].update(
        engine="sglang", dtype="bfloat16", device="auto", port=free_port(),
        dump_root=tempfile.mkdtemp(prefix="dumps-", dir=run_dir), idle_timeout_s=900,
        sglang={"tp_size": 1, "mem_fraction_static": 0.15, "extra_args": list(SGLANG_EXTRA_ARGS)},
    )  # fmt: skip
    return validate_config(config)


def post(url: str, payload: dict, timeout_s: float = 120.0) -> dict:
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def first_error(log_dir: Path) -> tuple[str, list[str]] | None:
    """The server log's first error line, with the traceback that led to it (the kernel)."""
    for path in sorted(log_dir.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        for index, line in enumerate(lines):
            harmless = "Ignore import error" in line or " disabled: " in line
            if ERROR_LINE.search(line) and not harmless:
                before = lines[max(0, index - 60) : index + 1]
                starts = [i for i, text in enumerate(before) if text.startswith("Traceback")]
                return line.strip()[:400], before[starts[-1] if starts else -20 :]
    return None


def prefill(url: str, dump_dir: Path, rid: str, input_ids: list[int]) -> bool:
    """One extraction-style request; True when its dump appeared."""
    from eaglepipe.server.handoff.dumps import DumpNotWritten, dump_path, wait_for_dump

    post(url, {"input_ids": input_ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}})
    try:
        wait_for_dump(dump_path(dump_dir, rid), within_s=10.0)
    except DumpNotWritten:
        return False
    dump_path(dump_dir, rid).unlink()
    return True


def serve_once(run_dir: Path, config: dict, purpose: str, args) -> dict:
    from eaglepipe.core.run import resolve
    from eaglepipe.server.lifecycle.shared_server import start_server, stop_server

    result: dict = {"purpose": purpose}
    prompt = [5 + (i * 7) % 400 for i in range(args.prompt_tokens)]
    with working_directory(run_dir):
        started = time.monotonic()
        try:
            handle = start_server(resolve(config), purpose=purpose)
            result["healthy_after_s"] = round(time.monotonic() - started, 1)
            if purpose == "capture":
                dumps = Path(handle.dump_dir)
                result["single_prefill_ok"] = prefill(handle.url, dumps, "eaglepipe-probe-0-0",
                                                      prompt)  # fmt: skip
                lengths = [100 + (i * 277) % max(1, args.prompt_tokens - 100)
                           for i in range(args.batch_rows)]  # fmt: skip
                with ThreadPoolExecutor(args.batch_rows) as pool:
                    done = list(pool.map(
                        lambda i: prefill(handle.url, dumps, f"eaglepipe-probe-{i}-0",
                                          prompt[: lengths[i - 1]]),
                        range(1, args.batch_rows + 1)))  # fmt: skip
                result["batched_prefill_tokens"] = sum(lengths)
                result["batched_prefill_ok"] = all(done)
                result["ok"] = result["single_prefill_ok"] and result["batched_prefill_ok"]
            else:
                answer = post(
                    handle.url,
                    {
                        "input_ids": prompt,
                        "sampling_params": {
                            "max_new_tokens": args.new_tokens,
                            "temperature": 0.0,
                            "ignore_eos": True,
                        },
                    },
                )
                result["completion_tokens"] = answer["meta_info"]["completion_tokens"]
                result["ok"] = result["completion_tokens"] == args.new_tokens
        except Exception as exc:  # a crash is the finding: record it and go on
            result["ok"] = False
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        finally:
            stop_server()
            server_logs = run_dir / "logs" / "server"
            error = first_error(server_logs)
            result["server_error"] = error[0] if error else None
            if error:
                result["server_traceback"] = error[1]
            # Out of the way of the next server's log, where tools/h200.sh still finds it.
            (server_logs / purpose).mkdir(exist_ok=True)
            for path in server_logs.glob("*.log"):
                path.rename(server_logs / purpose / path.name)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    work = Path(tempfile.mkdtemp(prefix="eaglepipe-mla-probe-", dir=args.work_root))
    results: dict = {"benchmark": "sglang_mla_probe", "machine": machine_info(), "shapes": []}
    for index, shape in enumerate(s for s in args.shapes.split(";") if s.strip()):
        entry: dict = {"shape": dict(zip(DEFAULT_SHAPE, map(int, shape.split(",")), strict=True))}
        results["shapes"].append(entry)
        if deadline - time.monotonic() < 200:  # a toy and two server starts
            entry["skipped"] = "budget spent"
            continue
        run_dir = work / f"shape-{index}"
        run_dir.mkdir()
        try:
            build_toy(shape, run_dir / "toy")
        except subprocess.CalledProcessError as exc:  # a shape transformers refuses
            entry["error"] = f"the toy did not build (exit {exc.returncode})"
            continue
        config = probe_config(run_dir, run_dir / "toy")
        if args.dry_run:
            entry["commands"] = planned_sglang_commands(config, args.sglang_version)
            continue
        for purpose in ("capture", "generation"):
            if deadline - time.monotonic() < 100:  # a start (60-75 s) and its requests
                entry[purpose] = {"skipped": "budget spent"}
                continue
            entry[purpose] = serve_once(run_dir, config, purpose, args)
            log(f"shape {shape}: {purpose}: {json.dumps(entry[purpose])}")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

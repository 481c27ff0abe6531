#!/usr/bin/env bash
# Every GPU benchmark in one go, sized to finish within 9 minutes on one H200.
#
#   bash benchmarks/speed/run_all_gpu.sh OUT_DIR        (from the repository root)
#
# Installs the wheels carried in .whl/ (packages the GPU image lacks, e.g. jsonschema), then runs
# bench_extraction (8B shape), bench_dump_gpu, bench_sglang_hook, bench_ingest, bench_validate
# and bench_train, each under its own time limit (a step that overruns is stopped and the next
# one runs). OUT_DIR receives six files: run_all.log (every line printed), extraction.json,
# extraction.md, dump_gpu.json, sglang_hook.json, train.json. Ingest and validation print their
# figures into the log.
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/speed/run_all_gpu.sh OUT_DIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
LOG="$OUT/run_all.log"
: >"$LOG"
# The whole script's budget; each step gets at most its own limit and what is left of this.
TOTAL_S=${EAGLEPIPE_BENCH_BUDGET_S:-540}
SCRATCH=$(mktemp -d /tmp/eaglepipe-bench-XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT

say() { echo "[run_all $(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    say "installing carried wheels: $(ls .whl | tr '\n' ' ')"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG" || exit 1
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
    python3 -c 'import eaglepipe.core.config, aiohttp, xxhash, psutil, filelock, jsonschema; print("imports ok")'
    nproc
    df -h /tmp /dev/shm 2>/dev/null
} 2>&1 | tee -a "$LOG"

FAILED=()

# step NAME LIMIT_S COMMAND...: run one benchmark under min(LIMIT_S, time left), output to the log.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL_S - SECONDS))
    if [ "$left" -lt 20 ]; then
        say "$name: skipped, only ${left}s of the ${TOTAL_S}s budget left"
        FAILED+=("$name(skipped)")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name: start (limit ${limit}s): $*"
    local started=$SECONDS
    timeout --signal=TERM --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    say "$name: exit $rc after $((SECONDS - started))s"
    [ "$rc" -ne 0 ] && FAILED+=("$name(rc=$rc)")
}

step extraction 290 python3 -u -m benchmarks.speed.extraction --tokens 600000 --chunk-mb 1024 \
    --shard-gb 10 --parallel-shards 2 --variants auto:2:shm --work-root "$SCRATCH" \
    --out "$OUT/extraction.json"
step dump_gpu 50 python3 -u -m benchmarks.speed.dump_gpu \
    --batches 12 --repeats 3 --out "$OUT/dump_gpu.json"
step sglang_hook 60 python3 -u -m benchmarks.speed.sglang_hook \
    --tokens 8192 32768 --batches 6 --out "$OUT/sglang_hook.json"
step ingest 30 python3 -u -m benchmarks.speed.ingest \
    --hidden-size 4096 --rows 24 --tokens 2048 --chunk-mb 1024 --repeat 2 --out-dir "$SCRATCH"
step validate 30 python3 -u -m benchmarks.speed.validate \
    --gb 1.5 --hidden 4096 --repeat 2 --dir "$SCRATCH"
step train 70 python3 -u -m benchmarks.speed.train \
    --steps 16 --work-dir "$SCRATCH/train" --out "$OUT/train.json"

if [ ${#FAILED[@]} -eq 0 ]; then
    say "all benchmarks finished in ${SECONDS}s; results in $OUT"
else
    say "finished in ${SECONDS}s; not clean: ${FAILED[*]}"
    exit 1
fi

#!/usr/bin/env bash
# One device call on the lent H200: install the staged SGLang wheels, run one part, leave its
# results in OUT. Every part ends inside the call's 10-minute limit and still writes what it has.
#
#   bash tools/h200.sh check    OUT     imports, versions, plugin registration (~1 min)
#   bash tools/h200.sh fidelity OUT     benchmarks/sglang_fidelity.py (Llama, DeepSeek, Kimi)
#   bash tools/h200.sh perf     OUT     benchmarks/bench_sglang_extraction.py (8B shape)
#   bash tools/h200.sh perf-scale OUT   the same at realistic sizes on /dev/shm (--preset
#                                       scale-shm: 5 M tokens, 1.25 M per shard, each shard
#                                       verified then deleted; ~8 min)
#   bash tools/h200.sh perf-scale-disk OUT
#                                       the same on disk (--preset scale-disk: 3 M tokens in
#                                       0.5 M-token shards, dumps bounded as the pipeline does
#                                       by default; each chunk handed to the disk every 64 MiB,
#                                       then left to the kernel; ~7 min)
#   bash tools/h200.sh pipeline OUT     benchmarks/sglang_pipeline_h200.sh (snakemake, engine sglang)
#   bash tools/h200.sh pipeline-mla OUT the pipeline on a DeepSeek-V3-shaped toy target (MLA
#                                       attention, benchmarks/deepseek_toy_target.py, pre-trained
#                                       here on the GPU; EAGLEPIPE_MLA_TOY_SHAPE=H,Q,KV,NOPE,ROPE,V
#                                       for other sizes), regeneration off; then `variants OUT
#                                       --variants mla` serves the MLA draft layer (~6 min)
#   bash tools/h200.sh mla-probe OUT [--shapes H,Q,KV,NOPE,ROPE,V;...]
#                                       benchmarks/sglang_mla_probe.py: which MLA shapes the
#                                       pipeline's capture and generation servers serve (a
#                                       random toy per shape: a prefill, 32 at once, a decode;
#                                       two server starts, ~2.5 min a shape)
#   bash tools/h200.sh variants OUT [--variants fc_norm,norm_output] [--epochs N]
#                                       benchmarks/bench_drafter_variants.py on the run the
#                                       pipeline part left on this warm machine: each variant
#                                       trained, evaluated, exported and served live through
#                                       SGLang (~3.5 min each; a later call continues;
#                                       EAGLEPIPE_VARIANTS_RUN=DIR: another finished run)
#   bash tools/h200.sh live     OUT --config C --export-dir D --table T --eval E
#                                       scripts/live_acceptance.py on a carried run's files (an
#                                       exported drafter served by SGLang's speculative decoding)
#   bash tools/h200.sh regen    OUT     benchmarks/bench_sglang_regeneration.py (8B shape): the
#                                       regenerate stage vs SGLang's bench_serving, same batch
#   bash tools/h200.sh regen-sweep OUT  the same at 64, 128, 256 requests in flight (where
#                                       SGLang saturates; ~8 min)
#   bash tools/h200.sh job-start OUT    benchmarks/bench_job_start.py --parts imports,read: a shard
#                                       job's imports in fresh interpreters and its row read on
#                                       this machine (no GPU, no server; ~30 s; runs as is
#                                       with --dry-run too); `--parts lease --writer-gb 12`:
#                                       the job's server lease beside two chunk writers
#   bash tools/h200.sh ingest   OUT     benchmarks/bench_ingest.py: H = 7168 dumps to checksummed
#                                       chunks with 1-16 workers vs raw writes, /dev/shm and disk
#                                       (no GPU, no SGLang; ~5 min)
#   bash tools/h200.sh regen-acceptance OUT
#                                       benchmarks/bench_regeneration.py with SGLang: drafters
#                                       trained on the dataset's and on the target's replies
#                                       (two pipelines at once; a second call on the warm
#                                       machine resumes them)
#   bash tools/h200.sh specforge OUT [--seeds 0,1,2] [--epochs 8] [--settings 7/1/8,3/1/4]
#                                       benchmarks/bench_specforge.py: this pipeline and
#                                       SpecForge 0.2 on the same toy target and train rows,
#                                       both drafters through the same live harness; a later
#                                       call on the warm machine continues where it stopped
#                                       (needs .whl-specforge too: tools/stage_specforge.py)
#   bash tools/h200.sh specforge-scale OUT [--rows 96] [--row-tokens 2048]
#                                       benchmarks/bench_specforge_scale.py on the 8B-shaped
#                                       random Llama (bf16): SpecForge's own generator against
#                                       this pipeline's extraction on the same rows (tokens/s,
#                                       bytes per token, each killed with kill -9 at half its
#                                       rows and run again), both trainers' tokens/s (TTT 7),
#                                       the two feature sets compared; one call (~8 min; a
#                                       later call on the warm machine finishes what is left;
#                                       needs .whl-specforge too)
#   (extra arguments after OUT go to the part's script; with --dry-run among them nothing is
#   installed or checked, and a part whose script has a dry run prints its commands: here, on
#   a CPU machine, `bash tools/h200.sh specforge OUT --dry-run`)
#
# Needs .whl-sglang/ (.venv/bin/python tools/stage_sglang.py, here; carried with the call). Uses
# .jit-sglang/jitcache.tgz when carried: SGLang's JIT-compiled kernels from an earlier call
# (saves ~40 s per cold start). Writes OUT/h200_<part>.log, the part's results and, when it fits
# the 16 MiB a returned file may have, OUT/jitcache.tgz: copy it to .jit-sglang/ for the next call.
#
# Layout on the machine (EAGLEPIPE_H200_ROOT, default /tmp/eaglepipe-h200):
#   site/         the common wheels: on every process's PYTHONPATH (after the repository)
#   site-sglang/  transformers 5.8.1 + tokenizers 0.22.2: on the SGLang server's path only
#                 (EAGLEPIPE_SGLANG_PYTHONPATH)
#   site-pipeline/ transformers 5.20 (repacked): on the pipeline's processes' path, ahead of
#                 site/ and the machine's 5.17, which imports torch with every tokenizer; the
#                 SpecForge parts keep the machine's (their recipe ran with it)
#   jit/          TVM_FFI_CACHE_DIR and TRITON_CACHE_DIR
set -u -o pipefail

if [ $# -lt 2 ]; then
    echo "usage: bash tools/h200.sh check|fidelity|perf|perf-scale|perf-scale-disk|pipeline|pipeline-mla|mla-probe|variants|live|regen|regen-sweep|ingest|job-start|regen-acceptance|specforge|specforge-scale OUT [args...]" >&2
    exit 2
fi
PART=$1
OUT=$2
shift 2
case "$PART" in
check | fidelity | perf | perf-scale | perf-scale-disk | pipeline | pipeline-mla | mla-probe | variants | live | regen | regen-sweep | ingest | job-start | regen-acceptance | specforge | specforge-scale) ;;
*)
    echo "tools/h200.sh: unknown part '$PART' (check, fidelity, perf, pipeline, pipeline-mla, mla-probe, variants, live, regen, regen-acceptance, perf-scale, perf-scale-disk, regen-sweep, ingest, job-start, specforge, specforge-scale)" >&2
    exit 2
    ;;
esac
REPO=$(cd "$(dirname "$0")/.." && pwd)
DRY_RUN=0
for arg in "$@"; do
    [ "$arg" = --dry-run ] && DRY_RUN=1
done
ROOT=${EAGLEPIPE_H200_ROOT:-/tmp/eaglepipe-h200}
BUDGET_S=${EAGLEPIPE_H200_BUDGET_S:-570}
WHEELS=$REPO/.whl-sglang
JIT_CARRIED=$REPO/.jit-sglang/jitcache.tgz
# Every process the part starts inherits this marker; the cleanup at the end finds the servers
# it left (they run in their own sessions) by it.
CALL_MARK="h200-$$-$(date +%s)"
mkdir -p "$OUT" "$ROOT"
LOG=$OUT/h200_$PART.log

say() { echo "[h200 $(date -u +%H:%M:%S) +${SECONDS}s] $*"; }

install_wheels() {
    if [ ! -f "$WHEELS/manifest.json" ]; then
        say "no staged wheels in $WHEELS: run '.venv/bin/python tools/stage_sglang.py' and carry .whl-sglang"
        return 1
    fi
    local stamp
    stamp=$(sha256sum "$WHEELS/manifest.json" | cut -c1-16)
    if [ "$(cat "$ROOT/installed" 2>/dev/null)" = "$stamp" ]; then
        say "wheels already installed ($stamp)"
        return 0
    fi
    rm -rf "$ROOT/site" "$ROOT/site-sglang" "$ROOT/site-pipeline" "$ROOT/installed"
    say "installing $(ls "$WHEELS"/common/*.whl | wc -l) + $(ls "$WHEELS"/server/*.whl | wc -l) + $(ls "$WHEELS"/pipeline/*.whl 2>/dev/null | wc -l) wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$ROOT/site" "$WHEELS"/common/*.whl || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$ROOT/site-sglang" "$WHEELS"/server/*.whl || return 1
    mkdir -p "$ROOT/site-pipeline"
    if ls "$WHEELS"/pipeline/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --target "$ROOT/site-pipeline" \
            "$WHEELS"/pipeline/*.whl || return 1
    fi
    # pip's --no-compile keeps the install quick; the bytecode is compiled here once, on every
    # core. Where Python writes none itself (PYTHONDONTWRITEBYTECODE=1: the 2-core VM sets it,
    # and the device's imports, twice the VM's, suggest it does too; compile_repository logs
    # it), every process would compile its imports from source: each shard job's, the
    # tokenizer's transformers, all of SGLang at each server start.
    say "compiling the staged wheels' bytecode"
    python3 -m compileall -q -j 0 "$ROOT/site" "$ROOT/site-sglang" "$ROOT/site-pipeline" \
        >/dev/null 2>&1 || say "compileall: some files did not compile (they compile at import)"
    # The machine's own environment came without bytecode too (job-start, 2026-12-06: 93 of the
    # 366 modules an extraction job imports, numpy's 0.27 s of its 0.53 s import); a user's pip
    # install compiles it, so it is compiled here, once per machine.
    local purelib
    purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    say "compiling the machine's $purelib"
    python3 -m compileall -q -j 0 "$purelib" >/dev/null 2>&1 ||
        say "compileall: some of $purelib did not compile (they compile at import)"
    echo "$stamp" >"$ROOT/installed"
    say "installed"
}

# The repository's own modules, compiled each call (its files may have changed; unchanged
# ones are skipped): a shard job imports some thirty of them.
compile_repository() {
    python3 -m compileall -q -j 0 "$REPO/eaglepipe" "$REPO/scripts" "$REPO/benchmarks" \
        >/dev/null 2>&1 || say "compileall: some repository files did not compile"
    say "bytecode: python3 writes its own: $(python3 -c 'import sys; print(not sys.dont_write_bytecode)'); staged wheels and repository compiled"
}

setup_env() {
    case "$PART" in
        specforge | specforge-scale) export PYTHONPATH="$REPO:$ROOT/site" ;;
        *) export PYTHONPATH="$REPO:$ROOT/site-pipeline:$ROOT/site" ;;
    esac
    export EAGLEPIPE_SGLANG_PYTHONPATH="$ROOT/site-sglang"
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    export TVM_FFI_CACHE_DIR="$ROOT/jit/tvm-ffi" TRITON_CACHE_DIR="$ROOT/jit/triton"
    mkdir -p "$TVM_FFI_CACHE_DIR" "$TRITON_CACHE_DIR"
    if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
        export CUDA_HOME=/usr/local/cuda
    fi
    # The staged flashinfer has no JIT sources: the eaglepipe SGLang plugin then uses
    # sgl_kernel's precompiled norm, sampling and top-k kernels (never on a full install).
    if [ ! -d "$ROOT/site/flashinfer/data" ]; then
        export EAGLEPIPE_SGLANG_SLIM_FLASHINFER=1
    fi
    # Snakemake's rules run `python`: the machine's python3, through a wrapper (a symlink to a
    # virtual environment's interpreter would lose that environment).
    mkdir -p "$ROOT/bin"
    printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$ROOT/bin/python"
    chmod +x "$ROOT/bin/python"
    export PATH="$ROOT/bin:$PATH"
    if [ -f "$JIT_CARRIED" ]; then
        tar -xzf "$JIT_CARRIED" -C "$ROOT" && say "JIT cache restored from $JIT_CARRIED"
    fi
}

check_imports() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
    say "CPUs $(nproc); /dev/shm free $(df -h --output=avail /dev/shm | tail -1); /tmp free $(df -h --output=avail /tmp | tail -1)"
    PYTHONPATH="$EAGLEPIPE_SGLANG_PYTHONPATH:$PYTHONPATH" timeout 180 python3 -c "
import sglang, sgl_kernel, flashinfer, tvm_ffi, transformers, tokenizers
print('server env: sglang', sglang.__version__, '| sgl_kernel', sgl_kernel.__version__,
      '| flashinfer', flashinfer.__version__, '| transformers', transformers.__version__,
      '| tokenizers', tokenizers.__version__)
assert transformers.__version__ == '5.8.1', transformers.__version__
" || return 1
    timeout 180 python3 -c "
import sys, torch, transformers, tokenizers, huggingface_hub, snakemake, jsonschema, eaglepipe
from eaglepipe.server.sglang import recipe
print('pipeline env: python', sys.version.split()[0], '| torch', torch.__version__,
      '| transformers', transformers.__version__, '| tokenizers', tokenizers.__version__,
      '| huggingface_hub', huggingface_hub.__version__, '| snakemake', snakemake.__version__,
      '| eaglepipe from', eaglepipe.__file__)
assert eaglepipe.__file__.startswith('$REPO/'), 'eaglepipe must come from the repository'
version = recipe.check_supported(recipe.installed_sglang_version())
print('SGLang for the server:', version, '| capture:', recipe.capture_mechanism(version),
      '| plugin registered:', recipe.plugin_registered())
assert recipe.capture_mechanism(version) == 'flags' or recipe.plugin_registered()
" || return 1
    say "imports ok; slim flashinfer: ${EAGLEPIPE_SGLANG_SLIM_FLASHINFER:-0}"
}

run_part() {
    local left=$((BUDGET_S - SECONDS - 30))
    if [ "$left" -lt 60 ]; then
        say "only ${left}s left for $PART: not started"
        return 1
    fi
    say "$PART: start (limit ${left}s)"
    (
        export EAGLEPIPE_H200_CALL=$CALL_MARK
        case "$PART" in
        check) exit 0 ;;
        fidelity)
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/sglang_fidelity.py --out "$OUT/fidelity.json" \
                --deadline-s $((left - 25)) --work-root "$ROOT" --keep "$@"
            ;;
        perf)
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_sglang_extraction.py --out "$OUT/sglang_extraction.json" \
                --deadline-s $((left - 25)) --work-root /tmp "$@"
            ;;
        perf-scale | perf-scale-disk)
            preset=scale-shm
            [ "$PART" = perf-scale-disk ] && preset=scale-disk
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_sglang_extraction.py --preset "$preset" \
                --out "$OUT/sglang_extraction_$preset.json" \
                --deadline-s $((left - 25)) --work-root /tmp "$@"
            ;;
        pipeline)
            EAGLEPIPE_PIPELINE_LIMIT_S=$((left - 20)) timeout --signal=TERM --kill-after=20 \
                "$left" bash benchmarks/sglang_pipeline_h200.sh "$OUT" "$@"
            ;;
        pipeline-mla)
            # An MLA draft layer needs a target with MLA attention: the DeepSeek-V3-shaped toy,
            # pre-trained on the GPU, then the pipeline on it in the pipeline part's run
            # directory (so `variants --variants mla` finds it). Regeneration stays off: the
            # toy's own replies are not what this run measures, and it saves a server start.
            # EAGLEPIPE_MLA_TOY_SHAPE=H,Q,KV,NOPE,ROPE,V picks the toy's sizes (deepseek_toy_target.py
            # --shape; a shape mla-probe served); a toy of other sizes left here is rebuilt.
            toy="$ROOT/deepseek-toy"
            shape=${EAGLEPIPE_MLA_TOY_SHAPE:-default}
            toy_cmd=(python3 -u benchmarks/deepseek_toy_target.py
                --corpus data/sample/conversations.jsonl --out "$toy" --device cuda)
            [ "$shape" = default ] || toy_cmd+=(--shape "$shape")
            if [ "$(cat "$toy/shape.txt" 2>/dev/null)" != "$shape" ]; then
                rm -rf "$toy" "$ROOT/pipeline-run"
            fi
            if [ "$DRY_RUN" = 1 ]; then
                # A real checkpoint of the same shape (2 steps, CPU), so the dry run checks
                # the pipeline's plan against it.
                say "(dry run) ${toy_cmd[*]}; here with --device cpu --steps 2"
                "${toy_cmd[@]}" --device cpu --steps 2 >/dev/null || exit 1
                echo "$shape" >"$toy/shape.txt"
            elif [ ! -f "$toy/config.json" ]; then
                say "building the DeepSeek-V3-shaped toy target ($shape) into $toy"
                timeout --signal=TERM --kill-after=20 $((left - 200)) "${toy_cmd[@]}" || exit 1
                echo "$shape" >"$toy/shape.txt"
            fi
            overrides="$ROOT/mla-overrides.yaml"
            printf 'model:\n  path: %s\ndataset:\n  regenerate:\n    enabled: false\n' \
                "$toy" >"$overrides"
            left=$((BUDGET_S - SECONDS - 30))
            EAGLEPIPE_PIPELINE_LIMIT_S=$((left - 20)) timeout --signal=TERM --kill-after=20 \
                "$left" bash benchmarks/sglang_pipeline_h200.sh "$OUT" --overrides "$overrides" "$@"
            ;;
        mla-probe)
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/sglang_mla_probe.py --out "$OUT/mla_probe.json" \
                --deadline-s $((left - 25)) --work-root "$ROOT" "$@"
            rc=$?
            keep_log_tails "$ROOT" "$OUT/mla_probe_logs.tgz"
            exit $rc
            ;;
        variants)
            # The plain variant is the pipeline run's own drafter (same seed and data): its
            # figures are in that run's eval.json and live.json. EAGLEPIPE_VARIANTS_RUN names
            # another finished run on this machine (the specforge part's, for one).
            run=${EAGLEPIPE_VARIANTS_RUN:-$ROOT/pipeline-run}
            if [ ! -f "$run/drafter/eval.json" ]; then
                say "variants: no finished pipeline run in $run: run the pipeline part first, on the same warm machine"
                exit 1
            fi
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_drafter_variants.py --run-dir "$run" \
                --variants fc_norm,norm_output --out "$ROOT/variants" "$@"
            rc=$?
            cp "$ROOT/variants/summary.json" "$OUT/variants_summary.json" 2>/dev/null
            tar -czf "$OUT/variants_results.tgz" -C "$ROOT" --exclude='*.safetensors' \
                --exclude=checkpoints variants
            exit $rc
            ;;
        live)
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                scripts/live_acceptance.py --out "$OUT/live.json" "$@"
            ;;
        regen)
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_sglang_regeneration.py --out "$OUT/sglang_regeneration.json" \
                --deadline-s $((left - 25)) --work-root /tmp "$@"
            ;;
        regen-sweep)
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_sglang_regeneration.py --sweep 64,128,256 \
                --out "$OUT/sglang_regeneration_sweep.json" \
                --deadline-s $((left - 25)) --work-root /tmp "$@"
            ;;
        job-start)
            # The device's extraction jobs entered the library at 0.67-0.94 s against 0.24 s
            # on the 2-core VM: this says where (interpreter, each import, the tokenizer, the
            # row read) in the jobs' own environment. It needs neither GPU nor server, so a dry
            # run runs it as is (without --dry-run, which the script does not take).
            local args=()
            for arg in "$@"; do
                [ "$arg" = --dry-run ] || args+=("$arg")
            done
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_job_start.py --parts imports,read --dir /tmp \
                --out "$OUT/job_start.json" "${args[@]+"${args[@]}"}"
            ;;
        ingest)
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_ingest.py --hidden-size 7168 --gb-per-worker 2 \
                --workers 1,2,4,8,16 --storages shm,disk --out-dir /tmp \
                --out "$OUT/ingest.json" --deadline-s $((left - 25)) "$@"
            ;;
        regen-acceptance)
            # --scheduler greedy: the ilp scheduler needs pulp, which is not staged.
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_regeneration.py --overrides benchmarks/h200_regeneration.yaml \
                --work-root "$ROOT/regen-acceptance" --cores "$(nproc)" --parallel \
                --cross-live 0 --deadline-s $((left - 45)) --snakemake-arg=--scheduler \
                --snakemake-arg=greedy --out "$OUT/regen_acceptance.json" "$@"
            rc=$?
            keep_log_tails "$ROOT/regen-acceptance" "$OUT/regen_acceptance_logs.tgz"
            exit $rc
            ;;
        specforge)
            # A kit carried from an earlier call (.specforge-resume/, see
            # benchmarks/specforge_resume.py) lets a fresh machine go on where a lost one stopped.
            resume=()
            kit=$REPO/.specforge-resume/specforge_resume.tgz
            [ -f "$kit" ] && resume=(--resume-kit "$kit")
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_specforge.py --out "$OUT/specforge.json" \
                --work-root "$ROOT/specforge" --deadline-s $((left - 25)) \
                --kit-out "$OUT/specforge_resume.tgz" "${resume[@]}" "$@"
            rc=$?
            keep_specforge_results "$ROOT/specforge" "$OUT"
            exit $rc
            ;;
        specforge-scale)
            # Its work root is on /dev/shm (the 16 GB target and both feature sets:
            # EAGLEPIPE_SCALE_ROOT to move it); it stays for a later call on the warm machine
            # until every step is done, then only its logs and state are left.
            scale=${EAGLEPIPE_SCALE_ROOT:-/dev/shm/eaglepipe-specforge-scale}
            [ -w "$(dirname "$scale")" ] || scale=$ROOT/specforge-scale
            timeout --signal=TERM --kill-after=20 "$left" python3 -u \
                benchmarks/bench_specforge_scale.py --out "$OUT/specforge_scale.json" \
                --work-root "$scale" --deadline-s $((left - 25)) "$@"
            rc=$?
            [ -d "$scale" ] && keep_log_tails "$scale" "$OUT/specforge_scale_logs.tgz"
            exit $rc
            ;;
        esac
    )
}

keep_log_tails() {
    # The last 200 lines of every log under $1 (snakemake's, the rules', the servers') into $2.
    local root=$1 archive=$2 tails
    tails=$(mktemp -d)
    find "$root" -name '*.log' -type f 2>/dev/null | while read -r f; do
        mkdir -p "$tails/$(dirname "${f#"$root"/}")"
        tail -n 200 "$f" >"$tails/${f#"$root"/}"
    done
    tar -czf "$archive" -C "$tails" . && rm -rf "$tails"
}

keep_specforge_results() {
    # Log tails, and each seed's drafters (both exports, eval.json, live-*.json: a toy's are
    # small) when they fit a returned file.
    local work=$1 out=$2
    [ -d "$work" ] || return 0
    keep_log_tails "$work" "$out/specforge_logs.tgz"
    [ -d "$work/seeds" ] || return 0
    tar -czf "$out/specforge_drafters.tgz" --exclude='*.tgz' -C "$work" seeds
    if [ "$(stat -c %s "$out/specforge_drafters.tgz")" -gt $((15 * 1024 * 1024)) ]; then
        say "the drafters are too large to return: left in $work/seeds"
        rm -f "$out/specforge_drafters.tgz"
    fi
}

stop_leftovers() {
    # SGLang servers run in their own sessions and would outlive the call: stop every process
    # that carries this call's marker (not this shell or its parents).
    local pids=() pid
    for env_file in /proc/[0-9]*/environ; do
        pid=${env_file#/proc/}
        pid=${pid%/environ}
        if { tr '\0' '\n' <"$env_file"; } 2>/dev/null | grep -qx "EAGLEPIPE_H200_CALL=$CALL_MARK"; then
            pids+=("$pid")
        fi
    done
    [ ${#pids[@]} -eq 0 ] && return 0
    say "stopping ${#pids[@]} leftover process(es) of this call: ${pids[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null
    sleep 5
    kill -KILL "${pids[@]}" 2>/dev/null
    return 0
}

jit_cache_room() {
    # What the next call can carry beside the wheels and the repository's own files, within the
    # 64 MiB a call may carry, less 512 KiB for the repository to grow by before then. Counted
    # here from what this call carried (the paths runs write in the checkout left out).
    local carried
    carried=$(du -sb --exclude=.jit-sglang --exclude=.git --exclude=__pycache__ \
        --exclude=.eaglepipe --exclude=.snakemake --exclude=logs --exclude=.pytest_cache \
        --exclude=.ruff_cache --exclude=.venv "$REPO" | cut -f1)
    echo $((64 * 1024 * 1024 - carried - 512 * 1024))
}

save_jit_cache() {
    # The next call carries it beside ~57 MiB of wheels and the repository, within the 64 MiB a
    # call may carry (EAGLEPIPE_JIT_CACHE_MAX_BYTES, default what jit_cache_room leaves). Over
    # that: the tvm-ffi builds only (the slow part, ~40 s a cold start; Triton recompiles
    # quickly), and of those, the least recently built are left out until it fits (a kernel per
    # model shape accumulates).
    [ -d "$ROOT/jit" ] || return 0
    local tgz=$OUT/jitcache.tgz limit=${EAGLEPIPE_JIT_CACHE_MAX_BYTES:-$(jit_cache_room)}
    local common=(--exclude='*.o' --exclude='*.ninja*' --exclude='*.lock')
    tar -czf "$tgz" "${common[@]}" -C "$ROOT" jit
    if [ "$(stat -c %s "$tgz")" -gt "$limit" ]; then
        local oldest_first=() left_out=()
        mapfile -t oldest_first < <(cd "$ROOT" && ls -1dtr jit/tvm-ffi/*/ 2>/dev/null)
        while :; do
            tar -czf "$tgz" "${common[@]}" "${left_out[@]}" -C "$ROOT" jit/tvm-ffi
            [ "$(stat -c %s "$tgz")" -le "$limit" ] && break
            if [ ${#left_out[@]} -ge ${#oldest_first[@]} ]; then
                say "JIT cache over $limit bytes even without its kernels: not saved"
                rm -f "$tgz"
                return 0
            fi
            left_out+=(--exclude="${oldest_first[${#left_out[@]}]%/}")
        done
        [ ${#left_out[@]} -eq 0 ] || say "JIT cache: the ${#left_out[@]} least recently built tvm-ffi kernel(s) left out to fit"
    fi
    say "JIT cache saved: $tgz ($(du -h "$tgz" | cut -f1)); carry it as .jit-sglang/jitcache.tgz"
}

save_server_logs() {
    # The fidelity runs keep their scratch dirs: their server logs travel back as one file.
    local logs
    logs=$(cd "$ROOT" && ls -d eaglepipe-fidelity-*/run-*/logs/server 2>/dev/null)
    [ -n "$logs" ] || return 0
    (cd "$ROOT" && tar -czf "$OUT/server_logs.tgz" $logs)
    if [ "$(stat -c %s "$OUT/server_logs.tgz")" -gt $((15 * 1024 * 1024)) ]; then
        rm -f "$OUT/server_logs.tgz"
        say "server logs too large to return"
    fi
    rm -rf "$ROOT"/eaglepipe-fidelity-*
}

main() {
    cd "$REPO" || return 1
    say "part $PART, budget ${BUDGET_S}s, repository $REPO"
    if [ "$DRY_RUN" = 1 ]; then
        say "dry run: no wheels installed, no imports checked"
    else
        install_wheels || return 1
        compile_repository
    fi
    setup_env
    if [ "$DRY_RUN" = 0 ]; then
        check_imports || return 1
    fi
    local rc=0
    run_part "$@" || rc=$?
    say "$PART: exit $rc"
    stop_leftovers
    save_server_logs
    [ "$DRY_RUN" = 1 ] || save_jit_cache
    say "done in ${SECONDS}s; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
    return $rc
}

main "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# One device call on the lent H200: install the staged SGLang wheels, run one part, leave its
# results in OUT. Every part ends inside the call's 10-minute limit and still writes what it has.
#
#   bash tools/h200.sh PART OUT [args]
#
# The parts (check, fidelity, perf, perf-scale, perf-scale-disk, pipeline, pipeline-mla,
# mla-probe, variants, live, regen, regen-sweep, ingest, job-start, regen-acceptance, specforge,
# specforge-scale) are a table in tools/device_parts.py: what each runs, with which arguments,
# its deadline within the call, what it needs staged and what it keeps in OUT.
# `python3 tools/device_parts.py usage` lists them; `python3 tools/device_parts.py plan PART OUT`
# prints a part's commands. This script does what needs bash: the staged wheels installed into
# their sites, the environment, the import check, the cleanup and the JIT cache.
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

REPO=$(cd "$(dirname "$0")/.." && pwd)
PARTS_TABLE=$REPO/tools/device_parts.py
if [ $# -lt 2 ]; then
    echo "usage: bash tools/h200.sh PART OUT [args...]; the parts:" >&2
    python3 "$PARTS_TABLE" usage --prefix '  ' >&2
    exit 2
fi
PART=$1
OUT=$2
shift 2
PARTS=$(python3 "$PARTS_TABLE" names) || exit 2
case " $PARTS " in
*" $PART "*) ;;
*)
    echo "tools/h200.sh: unknown part '$PART' (${PARTS// /, })" >&2
    exit 2
    ;;
esac
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
    local site
    PYTHONPATH=$REPO
    for site in $(python3 "$PARTS_TABLE" sites "$PART"); do
        PYTHONPATH="$PYTHONPATH:$ROOT/$site"
    done
    export PYTHONPATH
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
    EAGLEPIPE_H200_CALL=$CALL_MARK python3 -u "$PARTS_TABLE" run --root "$ROOT" \
        --budget-s "$BUDGET_S" --elapsed-s "$SECONDS" "$PART" "$OUT" -- "$@"
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

#!/usr/bin/env bash
# The whole pipeline with `server.engine: sglang` on the H200 (issue 15, item 4): snakemake from
# prepare through extraction, validation (its spot check through SGLang), training, evaluation,
# export and live acceptance, in a fresh copy of the workflow, then the results into OUT.
#
#   bash benchmarks/checks/sglang_pipeline_h200.sh OUT [--default-toy] [--quick] [--overrides YAML]
#                                               [--fp32-live] [--deterministic-live]
#                                               [snakemake args and targets...]
#
# Run it through tools/h200.sh (which installs the staged SGLang and sets PYTHONPATH, the SGLang
# server's path and `python`): `bash tools/h200.sh pipeline OUT`.
#
# The target is a seeded toy whose attention heads are 64 wide (hidden 128, 2 heads, 1 KV head,
# 8 layers): the embedded default toy's heads are 16 wide (hidden 64, 4 heads), narrower than any
# head SGLang's triton attention kernels ran with here (64, and MLA's 192/576); the wider toy
# trains for 150 steps, so its CPU pre-training takes about what the default one does.
# --default-toy keeps the default toy instead. --quick shortens the run where its quality does not
# matter to the check (60 toy pre-training steps, 2 training epochs, 4 live prompts of 32 tokens),
# for a second attempt when the whole run does not fit one call. --overrides YAML is one more
# config file after these (benchmarks/studies/specforge/compare.py sets train.epochs and train.seed with
# it). The other overrides: engine sglang with the flags
# that ran live (../../shared/sglang-h200), bf16, 0.15 for SGLang's static memory (SGLang takes
# that fraction of the memory free when it starts, ~20 GB, plenty for the toy: the drafter's
# training, and in benchmarks/studies/specforge/compare.py several live servers, share the GPU), `--scheduler greedy`
# (the ilp scheduler needs pulp, which is not staged).
#
# --fp32-live: after the run, live acceptance once more with the target served in fp32
# (`--dtype float32`), into drafter/live_fp32.json: the lossless check (every output must equal
# plain greedy decoding) in the precision where kernels cannot break ties (issue 26).
# --deterministic-live: after the run, live acceptance once more on servers started with
# SGLang's `--enable-deterministic-inference` (batch-invariant kernels; the triton attention
# backend the overrides set is one it accepts), into drafter/live_deterministic.json: whether
# the bf16 differences from plain greedy decoding, all at near-tied logits so far, go away
# (issue 26, item 5). Both extra live runs get their own greedy reference (the serving
# settings are part of its key).
# OUT receives pipeline_summary.json (what ran, the evaluation and live acceptance results, the
# validation reports' verdicts, each rule's duration) and pipeline_results.tgz (eval.json,
# live.json, validated/*.json, report/*.csv, manifests, the overrides, the tail of every log).
# EAGLEPIPE_PIPELINE_LIMIT_S bounds snakemake's run (default 520 s).
set -u -o pipefail

if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/checks/sglang_pipeline_h200.sh OUT [--default-toy] [snakemake args]" >&2
    exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
TOY=wide
QUICK=0
FP32_LIVE=0
DETERMINISTIC_LIVE=0
EXTRA_CONFIG=()
while [ $# -gt 0 ]; do
    case "$1" in
    --default-toy) TOY=default ;;
    --quick) QUICK=1 ;;
    --fp32-live) FP32_LIVE=1 ;;
    --deterministic-live) DETERMINISTIC_LIVE=1 ;;
    --overrides)
        [ -f "${2:-}" ] || { echo "--overrides: no file '${2:-}'" >&2; exit 2; }
        EXTRA_CONFIG+=("$(cd "$(dirname "$2")" && pwd)/$(basename "$2")")
        shift
        ;;
    *) break ;;
    esac
    shift
done
REPO=$(cd "$(dirname "$0")/../.." && pwd)
RUN=${EAGLEPIPE_H200_ROOT:-/tmp/eaglepipe-h200}/pipeline-run
LIMIT_S=${EAGLEPIPE_PIPELINE_LIMIT_S:-520}

say() { echo "[pipeline $(date -u +%H:%M:%S) +${SECONDS}s] $*"; }

# EAGLEPIPE_PIPELINE_RESUME=1 continues the run left by an earlier call on a warm machine.
if [ "${EAGLEPIPE_PIPELINE_RESUME:-0}" != 1 ]; then
    rm -rf "$RUN"
fi
mkdir -p "$RUN"
for item in Snakefile config.yaml rules scripts schemas data profiles envs; do
    cp -r "$REPO/$item" "$RUN/"
done
{
    echo "model:"
    echo "  toy:"
    if [ "$TOY" = wide ]; then
        cat <<'EOF'
    hidden_size: 128
    num_heads: 2
    num_kv_heads: 1
    intermediate_size: 352
EOF
    fi
    if [ "$QUICK" = 1 ]; then
        cat <<'EOF'
    train_steps: 60
train:
  epochs: 2
evaluate:
  live_prompts: 4
  live_new_tokens: 32
EOF
    elif [ "$TOY" = wide ]; then
        echo "    train_steps: 150"
    else
        echo "    train_steps: 300"
    fi
    cat <<'EOF'
server:
  engine: sglang
  dtype: bfloat16
  health_timeout_s: 420
  sglang:
    tp_size: 1
    mem_fraction_static: 0.15
    extra_args: [--attention-backend, triton, --sampling-backend, pytorch, --grammar-backend, none]
EOF
} >"$RUN/h200-sglang.yaml"
say "workflow copied to $RUN; overrides ($TOY toy, quick $QUICK):"
cat "$RUN/h200-sglang.yaml"
for extra in "${EXTRA_CONFIG[@]}"; do
    say "and $extra:"
    cat "$extra"
done

cd "$RUN" || exit 1
# With --fp32-live or --deterministic-live each extra live run gets its share of the end of the
# budget: a second call on the warm machine (EAGLEPIPE_PIPELINE_RESUME=1) finishes whatever did
# not fit.
EXTRA_LIVE_LIMIT_S=${EAGLEPIPE_EXTRA_LIVE_LIMIT_S:-150}
SNAKEMAKE_LIMIT_S=$((LIMIT_S - (FP32_LIVE + DETERMINISTIC_LIVE) * (EXTRA_LIVE_LIMIT_S + 20)))
say "snakemake (limit ${SNAKEMAKE_LIMIT_S}s)"
# The snakemake arguments and targets first: --configfile takes every word after it.
timeout --signal=TERM --kill-after=30 "$SNAKEMAKE_LIMIT_S" python3 -m snakemake --cores "$(nproc)" \
    --scheduler greedy "$@" --configfile h200-sglang.yaml "${EXTRA_CONFIG[@]}"
rc=$?
say "snakemake exit $rc"
# One more live run on the run's config changed by KIND (fp32: the target served in fp32;
# deterministic: SGLang's batch-invariant mode), into drafter/live_KIND.json.
extra_live() {
    local kind=$1
    python3 - "$kind" <<'PY'
import json, sys
kind = sys.argv[1]
config = json.load(open(".eaglepipe/config.json"))
if kind == "fp32":
    config["server"]["dtype"] = "float32"
else:
    config["server"]["sglang"]["extra_args"].append("--enable-deterministic-inference")
json.dump(config, open(f".eaglepipe/config-{kind}.json", "w"))
PY
    say "live acceptance, $kind"
    timeout --signal=TERM --kill-after=20 "$EXTRA_LIVE_LIMIT_S" python3 -u \
        scripts/live_acceptance.py --config ".eaglepipe/config-$kind.json" \
        --export-dir drafter/export/sglang --table prepared/tokenized.parquet \
        --eval drafter/eval.json --out "drafter/live_$kind.json" 2>&1 | tee "logs/live_$kind.log"
    say "$kind live exit ${PIPESTATUS[0]}"
}
if [ -f drafter/live.json ]; then
    [ "$FP32_LIVE" = 1 ] && extra_live fp32
    [ "$DETERMINISTIC_LIVE" = 1 ] && extra_live deterministic
fi

# Results: one summary and one archive (a call returns at most 8 files).
python3 - "$RUN" "$OUT/pipeline_summary.json" "$rc" <<'PY'
import csv, json, sys
from pathlib import Path

run, out, rc = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])


def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"missing": f"{path.name}: {type(exc).__name__}"}


durations = {}
for tsv in sorted((run / "logs" / "benchmarks").rglob("*.tsv")):
    with open(tsv) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if rows:
        durations[str(tsv.relative_to(run / "logs" / "benchmarks"))] = float(rows[-1]["s"])
validations = {p.stem: {"ok": load(p).get("ok")} for p in sorted((run / "validated").glob("*.json"))}
summary = {
    "snakemake_exit": rc,
    "outputs": {
        name: (run / name).exists()
        for name in ("models/toy-target/config.json", "prepared/tokenized.parquet",
                     "drafter/model.safetensors", "drafter/eval.json", "drafter/live.json",
                     "drafter/export/sglang/model.safetensors", "report/acceptance.csv")
    },
    "shards": len(list((run / "hidden_states").glob("*/manifest.json"))),
    "validations": validations,
    "eval": load(run / "drafter" / "eval.json"),
    "live": load(run / "drafter" / "live.json"),
    "live_fp32": load(run / "drafter" / "live_fp32.json"),
    "live_deterministic": load(run / "drafter" / "live_deterministic.json"),
    "engine": next(
        ({k: load(m).get("provenance", {}).get(k) for k in ("engine", "engine_version")}
         for m in sorted((run / "hidden_states").glob("*/manifest.json"))),
        None,
    ),
    "rule_seconds": durations,
}
out.write_text(json.dumps(summary, indent=1, default=str))
print(json.dumps({k: summary[k] for k in ("snakemake_exit", "outputs", "shards", "engine")}, indent=1))
PY

TAILS=$RUN/log-tails
mkdir -p "$TAILS"
find "$RUN/logs" "$RUN/.snakemake/log" -type f -name '*.log' 2>/dev/null | while read -r f; do
    rel=${f#"$RUN"/}
    mkdir -p "$TAILS/$(dirname "$rel")"
    tail -n 200 "$f" >"$TAILS/$rel"
done
(
    cd "$RUN" || exit 1
    tar -czf "$OUT/pipeline_results.tgz" h200-sglang.yaml log-tails \
        $(ls -d drafter/eval.json drafter/live.json drafter/live_fp32.json drafter/live_deterministic.json \
            drafter/export/*/config.json \
            validated prepared/summary.json report/*.csv hidden_states/*/manifest.json \
            .eaglepipe/server 2>/dev/null)
)
say "results: $(ls "$OUT" | tr '\n' ' ')"
exit $rc

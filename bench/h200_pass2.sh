#!/usr/bin/env bash
# The second H200 pass of 2026-12-01: structured output after its graphs landed (GPU test, demo pair
# with and without a JSON schema), then the sampling benchmark and the adaptive sweep on the current
# code. One call of under ten minutes; results in $OUT.  OUT=/tmp/pass bash bench/h200_pass2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo "$1: $(( $(date +%s) - $2 )) s"; }
t=$(date +%s)
timeout -k 5 120 python -m pytest -q -p no:cacheprovider tests/gpu/test_structured_gpu.py > "$OUT/structured_tests.log" 2>&1
tail -2 "$OUT/structured_tests.log"; step "structured tests" $t
for schema in none builtin; do
    t=$(date +%s)
    args=(); [ $schema = builtin ] && args=(--json-schema builtin)
    timeout -k 5 100 python -m tandem bench --batch-sizes 1 8 32 --input-len 64 --output-len 256 --temperature 0 \
        --no-plots --no-progress --repeats 2 "${args[@]}" --out "$OUT/structured-demo-h200-$schema.json" \
        > "$OUT/bench_$schema.log" 2>&1
    tail -4 "$OUT/bench_$schema.log"; step "bench ($schema)" $t
done
t=$(date +%s)
timeout -k 5 ${SAMPLING_S:-110} python bench/sampling_bench.py --shapes demo --batch-sizes 1 8 32 --repeats 3 \
    --out "$OUT/sampling_h200.json" > "$OUT/sampling.log" 2>&1
tail -12 "$OUT/sampling.log"; step "sampling bench" $t
t=$(date +%s)
timeout -k 5 ${SWEEP_S:-230} python -m tandem bench --sweep --preset llama-3.1-8b --attention-backend triton \
    --input-len 64 --output-len 64 --cuda-graph-max-bs 128 --out "$OUT/sweep-llama-3.1-8b-h200.json" --no-progress \
    > "$OUT/sweep.log" 2>&1
tail -30 "$OUT/sweep.log"; step sweep $t

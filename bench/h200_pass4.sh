#!/usr/bin/env bash
# One H200 pass of 2026-12-01's third session, in two calls of under 10 minutes.
# PASS=a: every single-GPU test file side by side, then the sampling benchmark (greedy, T 1, top-p,
#         penalty + logprobs; fixed depth, adaptive, plain) on the demo pair and in the 8B shape.
# PASS=b: the adaptive sweep (8B shape, three interleaved runs per point).
# PASS=c: the GPU tests again, the 8B sampling benchmark, six sweep points (T 1; p 0, 0.6, 0.95; batch 32, 128).
#   PASS=a OUT=/tmp/pass bash bench/h200_pass4.sh      (xgrammar importable for the structured tests)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
if [ "${PASS:-a}" = a ]; then
    TESTS_S=${TESTS_S:-300} OUT="$OUT" bash bench/h200_tests.sh
    for shape in demo llama-3.1-8b; do
        t=$(date +%s)
        sizes="1 8 32"; [ $shape = llama-3.1-8b ] && sizes="1 32"
        timeout -k 5 ${SAMPLING_S:-200} python bench/sampling_bench.py --shapes $shape --batch-sizes $sizes --repeats 3 \
            --out "$OUT/sampling_${shape}_h200.json" > "$OUT/sampling_$shape.log" 2>&1
        grep -A20 "^$shape:" "$OUT/sampling_$shape.log"; echo "sampling ($shape): $(( $(date +%s) - t )) s"
    done
elif [ "${PASS}" = c ]; then
    # The last call: the GPU tests again, the 8B sampling benchmark, and six sweep points at temperature 1.
    TESTS_S=${TESTS_S:-260} OUT="$OUT" bash bench/h200_tests.sh
    t=$(date +%s)
    timeout -k 5 ${SAMPLING_S:-150} python bench/sampling_bench.py --shapes llama-3.1-8b --batch-sizes 1 32 --repeats 3 \
        --out "$OUT/sampling_llama-3.1-8b_h200.json" > "$OUT/sampling_8b.log" 2>&1
    grep -A12 "^llama-3.1-8b:" "$OUT/sampling_8b.log"; echo "sampling (8B): $(( $(date +%s) - t )) s"
    t=$(date +%s)
    timeout -k 5 ${SWEEP_S:-150} python -m tandem bench --sweep --preset llama-3.1-8b --attention-backend triton \
        --input-len 64 --output-len 64 --cuda-graph-max-bs 128 --repeats 3 --sweep-acceptance 0 0.6 0.95 \
        --sweep-temperatures 1 --batch-sizes 32 128 --out "$OUT/sweep-mini-llama-3.1-8b-h200.json" --no-progress \
        > "$OUT/sweep_mini.log" 2>&1
    tail -12 "$OUT/sweep_mini.log"; echo "sweep (6 points): $(( $(date +%s) - t )) s"
else
    t=$(date +%s)
    timeout -k 5 ${SWEEP_S:-500} python -m tandem bench --sweep --preset llama-3.1-8b --attention-backend triton \
        --input-len 64 --output-len 64 --cuda-graph-max-bs 128 --repeats 3 --out "$OUT/sweep-llama-3.1-8b-h200.json" \
        --no-progress > "$OUT/sweep.log" 2>&1
    tail -40 "$OUT/sweep.log"; echo "sweep: $(( $(date +%s) - t )) s"
fi

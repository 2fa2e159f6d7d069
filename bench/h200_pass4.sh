#!/usr/bin/env bash
# One H200 pass of 2026-12-01's third session, in two calls of under 10 minutes.
# PASS=a: every single-GPU test file side by side, then the sampling benchmark (greedy, T 1, top-p,
#         penalty + logprobs; fixed depth, adaptive, plain) on the demo pair and in the 8B shape.
# PASS=b: the adaptive sweep (8B shape, three interleaved runs per point).
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
else
    t=$(date +%s)
    timeout -k 5 ${SWEEP_S:-500} python -m tandem bench --sweep --preset llama-3.1-8b --attention-backend triton \
        --input-len 64 --output-len 64 --cuda-graph-max-bs 128 --repeats 3 --out "$OUT/sweep-llama-3.1-8b-h200.json" \
        --no-progress > "$OUT/sweep.log" 2>&1
    tail -40 "$OUT/sweep.log"; echo "sweep: $(( $(date +%s) - t )) s"
fi

#!/usr/bin/env bash
# One H200 pass of 2026-12-01's fourth session, in two calls of under 10 minutes.
# PASS=a: every GPU test (bench/h200_tests.sh), the sampling kernel with 0 and 3 parallel pivot rounds, and
#         depth 0's cost over plain decoding (graph replays and kernels) at four batch sizes.
# PASS=b: the adaptive sweep (8B shape, three interleaved runs per point), then the sampling benchmark
#         (greedy, T 1, top-p, penalty + logprobs) in the 8B shape.
# PASS=c: every GPU test again (after dormant admission), the demo pair's sampling benchmark (five runs per
#         point), and a profile of its batch-32 greedy and T 1 steps (GPU busy time against wall time).
#   PASS=a OUT=/tmp/pass bash bench/h200_pass5.sh      (xgrammar importable for the structured tests)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
if [ "${PASS:-a}" = a ]; then
    TESTS_S=${TESTS_S:-340} OUT="$OUT" bash bench/h200_tests.sh
    t=$(date +%s)
    timeout -k 5 ${KERNEL_S:-100} python bench/sampling_kernel_bench.py --rows 1 32 128 --pivot-rounds 0 3 \
        --out "$OUT/sampling_kernel_h200.json" > "$OUT/sampling_kernel.log" 2>&1
    grep -E "rows|Error|not the reference" "$OUT/sampling_kernel.log" | grep -v reference: ; echo "kernel: $(( $(date +%s) - t )) s"
    t=$(date +%s)
    timeout -k 5 ${DEPTH0_S:-150} python bench/depth0_cost.py --shape llama-3.1-8b --batch-sizes 1 32 64 128 \
        --out "$OUT/depth0_cost_h200.json" > "$OUT/depth0_cost.log" 2>&1
    grep -E "^batch|Error" "$OUT/depth0_cost.log"; echo "depth 0: $(( $(date +%s) - t )) s"
elif [ "${PASS}" = c ]; then
    TESTS_S=${TESTS_S:-340} OUT="$OUT" bash bench/h200_tests.sh
    t=$(date +%s)
    timeout -k 5 ${SAMPLING_S:-100} python bench/sampling_bench.py --shapes demo --batch-sizes 1 8 32 --repeats 5 \
        --out "$OUT/sampling_demo_h200.json" > "$OUT/sampling_demo.log" 2>&1
    grep -A14 "^demo:" "$OUT/sampling_demo.log"; echo "sampling (demo): $(( $(date +%s) - t )) s"
    t=$(date +%s)
    timeout -k 5 ${PROFILE_S:-70} python bench/sampled_step_profile.py --batch 32 --out "$OUT/sampled_step_profile_h200.json" \
        > "$OUT/sampled_step_profile.log" 2>&1
    grep -vE "USDT|loading" "$OUT/sampled_step_profile.log" | head -40; echo "profile: $(( $(date +%s) - t )) s"
else
    t=$(date +%s)
    timeout -k 5 ${SWEEP_S:-400} python -m tandem bench --sweep --preset llama-3.1-8b --attention-backend triton \
        --input-len 64 --output-len 64 --cuda-graph-max-bs 128 --repeats 3 --out "$OUT/sweep-llama-3.1-8b-h200.json" \
        --no-progress > "$OUT/sweep.log" 2>&1
    tail -54 "$OUT/sweep.log"; echo "sweep: $(( $(date +%s) - t )) s"
    t=$(date +%s)
    timeout -k 5 ${SAMPLING_S:-120} python bench/sampling_bench.py --shapes llama-3.1-8b --batch-sizes 1 32 --repeats 3 \
        --out "$OUT/sampling_llama-3.1-8b_h200.json" > "$OUT/sampling_8b.log" 2>&1
    grep -A12 "^llama-3.1-8b:" "$OUT/sampling_8b.log"; echo "sampling (8B): $(( $(date +%s) - t )) s"
fi

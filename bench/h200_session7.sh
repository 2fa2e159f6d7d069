#!/usr/bin/env bash
# The H200 calls of 2026-12-01's seventh session (each under 10 minutes).
# PASS=a: where a host-bound engine's step time goes (bench/host_profile.py: the demo pair, plain / fixed /
#         adaptive / every request dormant, with each graph's replay time), the demo pair's sampling
#         benchmark (engines interleaved, five runs a point), and the adaptive sweep (8B shape).
# PASS=b: every GPU test (bench/h200_tests.sh; xgrammar importable for the structured file).
# PASS=c: the sweep alone, five runs a point (382-390 s on the H200: with PASS=a's other parts, its 385 s
#         limit cut the last point once).
# PASS=d: the demo pair's sampling benchmark (about 50 s), then the sweep at five runs a point (what the
#         adaptive-speculation targets ask for, in one call of under 10 minutes).
#   PASS=a OUT=/tmp/pass bash bench/h200_session7.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
# The demo pair's sampling benchmark: sampling LIMIT_S
sampling() {
    local t=$(date +%s)
    timeout -k 5 "$1" python bench/sampling_bench.py --shapes demo --batch-sizes 1 8 32 --repeats 5 \
        --out "$OUT/sampling_demo_h200.json" > "$OUT/sampling_demo.log" 2>&1
    grep -A14 "^demo:" "$OUT/sampling_demo.log"; echo "sampling (demo): $(( $(date +%s) - t )) s"
}
# The 8B sweep: sweep LIMIT_S REPEATS
sweep() {
    local t=$(date +%s)
    timeout -k 5 "$1" python -m tandem bench --sweep --preset llama-3.1-8b --attention-backend triton \
        --input-len 64 --output-len 64 --cuda-graph-max-bs 128 --repeats "$2" \
        --out "$OUT/sweep-llama-3.1-8b-h200.json" --no-progress > "$OUT/sweep.log" 2>&1
    grep -v INFO "$OUT/sweep.log" | tail -54; echo "sweep: $(( $(date +%s) - t )) s"
}
if [ "${PASS:-a}" = c ]; then
    sweep "${SWEEP_S:-540}" "${SWEEP_REPEATS:-5}"
elif [ "${PASS:-a}" = d ]; then
    sampling "${SAMPLING_S:-100}"
    sweep "${SWEEP_S:-450}" "${SWEEP_REPEATS:-5}"
elif [ "${PASS:-a}" = a ]; then
    t=$(date +%s)
    timeout -k 5 ${PROFILE_S:-90} python bench/host_profile.py --batch-sizes 1 8 32 --output-len 128 --repeats 5 \
        --out "$OUT/host_profile_h200.json" > "$OUT/host_profile.log" 2>&1
    grep -vE "loading|^\s*$" "$OUT/host_profile.log" | grep -B1 -A5 -E "^== batch|^graph replay" | head -40
    echo "host profile: $(( $(date +%s) - t )) s"
    sampling "${SAMPLING_S:-120}"
    sweep "${SWEEP_S:-330}" "${SWEEP_REPEATS:-3}"
else
    TESTS_S=${TESTS_S:-340} OUT="$OUT" bash bench/h200_tests.sh
fi

#!/usr/bin/env bash
# One H200 pass for structured output (and a re-run of the GPU suites on the current code): the GPU
# tests side by side, then the demo pair's speculative speedup with and without a JSON schema (greedy,
# so speculation and plain decoding produce the same documents). Results land in $OUT.
#
#   OUT=/tmp/pass bash bench/h200_structured.sh      (xgrammar must be importable)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
start=$(date +%s)
for t in seeded cuda_graph overlap structured; do
    extra=""; [ $t = overlap ] && extra=tests/gpu/test_sampling_kernel_gpu.py
    timeout -k 5 ${TESTS_S:-200} python -m pytest -q -p no:cacheprovider tests/gpu/test_${t}_gpu.py $extra \
        > "$OUT/t_$t.log" 2>&1 &
done
wait
for f in "$OUT"/t_*.log; do echo "=== $f"; cat "$f"; done > "$OUT/gpu_tests.log"
rm -f "$OUT"/t_*.log
grep -E "^=== |passed|failed|error" "$OUT/gpu_tests.log" | grep -v "^E " | head -40
echo "tests: $(( $(date +%s) - start )) s"
for schema in none builtin; do
    start=$(date +%s)
    args=(); [ $schema = builtin ] && args=(--json-schema builtin)
    timeout -k 5 ${BENCH_S:-150} python -m tandem bench --batch-sizes 1 8 32 --input-len 64 --output-len 256 \
        --temperature 0 --no-plots --no-progress --repeats 2 "${args[@]}" \
        --out "$OUT/structured-demo-h200-$schema.json" > "$OUT/bench_$schema.log" 2>&1
    tail -5 "$OUT/bench_$schema.log"
    echo "bench ($schema): $(( $(date +%s) - start )) s"
done

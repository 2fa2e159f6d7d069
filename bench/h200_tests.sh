#!/usr/bin/env bash
# Every single-GPU test file, side by side on one H200 (each file in its own process), one log in $OUT.
#   OUT=/tmp/pass bash bench/h200_tests.sh        (xgrammar must be importable for the structured file)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT" /tmp/gputests
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
start=$(date +%s)
for t in seeded cuda_graph overlap sampling_kernel structured triton; do
    timeout -k 5 ${TESTS_S:-300} python -m pytest -q -p no:cacheprovider tests/gpu/test_${t}_gpu.py \
        > /tmp/gputests/t_$t.log 2>&1 &
done
wait
for f in /tmp/gputests/t_*.log; do echo "=== $f"; cat "$f"; done > "$OUT/gpu_tests.log"
grep -E "^=== |passed|failed|error" "$OUT/gpu_tests.log" | grep -v "^E " | head -40
echo "tests: $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# Every single-GPU test file, side by side on one H200 (each file in its own process), and the GPU-marked
# tests outside tests/gpu; one log in $OUT. Seven files share the GPU: the CUDA-graph file needed more than
# 280 s that way (222 s beside three others), hence 340 s each.
#   OUT=/tmp/pass bash bench/h200_tests.sh        (xgrammar must be importable for the structured file)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT" /tmp/gputests
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
start=$(date +%s)
for t in seeded cuda_graph overlap sampling_kernel structured triton; do
    timeout -k 5 ${TESTS_S:-340} python -m pytest -q -p no:cacheprovider tests/gpu/test_${t}_gpu.py \
        > /tmp/gputests/t_$t.log 2>&1 &
done
# GPU-marked tests outside tests/gpu (the chi-square of sampled speculation on the GPU, among others). The
# server and data-parallel files import openai, starlette and zmq, which the H200 lacks: skipped there.
timeout -k 5 ${TESTS_S:-340} python -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/gpu \
    --ignore=tests/server --ignore=tests/dp \
    > /tmp/gputests/t_marked_elsewhere.log 2>&1 &
wait
for f in /tmp/gputests/t_*.log; do echo "=== $f"; cat "$f"; done > "$OUT/gpu_tests.log"
grep -E "^=== |passed|failed|error" "$OUT/gpu_tests.log" | grep -v "^E " | head -40
echo "tests: $(( $(date +%s) - start )) s"

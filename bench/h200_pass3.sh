#!/usr/bin/env bash
# The third H200 pass of 2026-12-01: the GPU suites on the final code (side by side), then the sampling
# benchmark and the adaptive sweep (two runs per point, medians). At most 7 files land in $OUT.
#   OUT=/tmp/pass bash bench/h200_pass3.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT" /tmp/pass3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
t=$(date +%s)
for s in seeded cuda_graph overlap structured; do
    extra=""; [ $s = overlap ] && extra=tests/gpu/test_sampling_kernel_gpu.py
    timeout -k 5 ${TESTS_S:-200} python -m pytest -q -p no:cacheprovider tests/gpu/test_${s}_gpu.py $extra \
        > /tmp/pass3/t_$s.log 2>&1 &
done
wait
for f in /tmp/pass3/t_*.log; do echo "=== $f"; cat "$f"; done > "$OUT/gpu_tests.log"
grep -E "^=== |passed|failed" "$OUT/gpu_tests.log" | grep -v "^E "; echo "tests: $(( $(date +%s) - t )) s"
t=$(date +%s)
timeout -k 5 100 python bench/sampling_bench.py --shapes demo --batch-sizes 1 8 32 --repeats 3 \
    --out "$OUT/sampling_h200.json" > "$OUT/sampling.log" 2>&1
tail -11 "$OUT/sampling.log"; echo "sampling: $(( $(date +%s) - t )) s"
t=$(date +%s)
timeout -k 5 ${SWEEP_S:-280} python -m tandem bench --sweep --preset llama-3.1-8b --attention-backend triton \
    --input-len 64 --output-len 64 --cuda-graph-max-bs 128 --repeats 2 --out "$OUT/sweep-llama-3.1-8b-h200.json" \
    --no-progress > /tmp/pass3/sweep.log 2>&1
tail -56 /tmp/pass3/sweep.log; echo "sweep: $(( $(date +%s) - t )) s"

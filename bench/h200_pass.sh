#!/usr/bin/env bash
# One pass on one H200 for the device sampler and adaptive speculation, in a single call of under ten
# minutes: the GPU tests that cover them (correctness only, run side by side), then the benchmarks one
# after the other (nothing else on the GPU while they time). Everything lands in $OUT (default
# bench/results/pass): a combined test log, bench/sampling_bench.py's JSON, and the sweep's JSON and heatmaps.
#
#   OUT=/tmp/pass bash bench/h200_pass.sh
# PASS=bench (the second pass of 2026-12-01) skips the tests and runs the two benchmarks only, shorter.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/pass}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

if [ "${PASS:-all}" = all ]; then
start=$(date +%s)
timeout -k 5 190 python -m pytest -q -p no:cacheprovider tests/gpu/test_seeded_gpu.py \
    > "$OUT/t_seeded.log" 2>&1 &
timeout -k 5 190 python -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graph_gpu.py \
    > "$OUT/t_graphs.log" 2>&1 &
timeout -k 5 190 python -m pytest -q -p no:cacheprovider tests/gpu/test_overlap_gpu.py \
    tests/gpu/test_sampling_kernel_gpu.py > "$OUT/t_overlap.log" 2>&1 &
wait
for f in "$OUT"/t_*.log; do echo "=== $f"; cat "$f"; done > "$OUT/gpu_tests.log"
rm -f "$OUT"/t_*.log
grep -E "passed|failed|error" "$OUT/gpu_tests.log"
echo "tests: $(( $(date +%s) - start )) s"
fi
SAMPLING_S=${SAMPLING_S:-120} SWEEP_S=${SWEEP_S:-270}

start=$(date +%s)
timeout -k 5 "$SAMPLING_S" python bench/sampling_bench.py --shapes demo --batch-sizes 1 8 32 --repeats 3 \
    --out "$OUT/sampling_h200.json" > "$OUT/sampling.log" 2>&1
tail -12 "$OUT/sampling.log"
echo "sampling bench: $(( $(date +%s) - start )) s"

start=$(date +%s)
timeout -k 5 "$SWEEP_S" python -m tandem bench --sweep --preset llama-3.1-8b --attention-backend triton \
    --input-len 64 --output-len 64 --cuda-graph-max-bs 128 --out "$OUT/sweep-llama-3.1-8b-h200.json" --no-progress > "$OUT/sweep.log" 2>&1
tail -60 "$OUT/sweep.log"
echo "sweep: $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# Every GPU test: each file of tests/gpu in a process of its own, side by side (they share the GPU; on one
# H200 the slowest files took about four minutes so), and the GPU-marked tests elsewhere.
# One combined log, OUT_DIR/gpu-tests.log; exits 1 if any file failed.
#
#   scripts/gpu_tests.sh [OUT_DIR] [-k EXPR ...]     (extra arguments after OUT_DIR go to every pytest)
#
# OUT_DIR: the argument, else $OUT, else the current directory. TESTS_S: each file's time limit (default 600 s).
# Puts the checkout's src first on PYTHONPATH (nothing to install). Files that need what the machine lacks
# skip themselves: the two-GPU files with one GPU, the structured file without xgrammar and jsonschema;
# tests/server and tests/dp (the HTTP server: fastapi, uvicorn, pyzmq, openai) hold no GPU test and are left out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
if [ $# -gt 0 ] && [[ $1 != -* ]]; then OUT=$1; shift; fi
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
PY=${PYTHON:-python}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
start=$(date +%s)
pids=()
for f in tests/gpu/test_*_gpu.py; do
    name=$(basename "$f" .py)
    timeout -k 5 "${TESTS_S:-600}" $PY -m pytest -q -p no:cacheprovider "$f" "$@" > "$logs/$name.log" 2>&1 &
    pids+=($!)
done
timeout -k 5 "${TESTS_S:-600}" $PY -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/gpu \
    --ignore=tests/server --ignore=tests/dp "$@" > "$logs/marked_elsewhere.log" 2>&1 &
pids+=($!)
failed=0
for pid in "${pids[@]}"; do
    wait "$pid"
    rc=$?
    [ $rc = 0 ] || [ $rc = 5 ] || failed=1  # (5: nothing selected, as -k can leave a file)
done
for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; done > "$OUT/gpu-tests.log"
grep -E "^=== |passed|failed|error|skipped|no tests ran" "$OUT/gpu-tests.log" | grep -v "^E "
echo "gpu tests: $(( $(date +%s) - start )) s, log in $OUT/gpu-tests.log"
exit $failed

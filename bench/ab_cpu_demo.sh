#!/bin/bash
# The demo pair's CPU benchmark for two revisions, taking turns (old, new, old, new, ...), so that a slow
# stretch of the machine lands on both alike: on a 2-core CPU plain decoding's own 7-run medians moved
# 75-101 tokens/s at batch 1 over three rounds (six minutes).
#   bench/ab_cpu_demo.sh OLD_REV OUT_DIR [ROUNDS]
# writes OUT_DIR/old-N.json and OUT_DIR/new-N.json (new: the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
old_rev=$1 out=$2 rounds=${3:-3}
old_src=$(mktemp -d)
trap 'rm -rf "$old_src"' EXIT
git archive "$old_rev" src | tar -x -C "$old_src"
mkdir -p "$out"
python=${PYTHON:-python}
for i in $(seq 1 "$rounds"); do
  for side in old new; do
    src=$([ "$side" = old ] && echo "$old_src/src" || echo "$PWD/src")
    OMP_NUM_THREADS=1 PYTHONPATH=$src "$python" -m tandem bench --device cpu --batch-sizes 1 4 --input-len 64 \
      --output-len 64 --repeats 7 --out "$out/$side-$i.json" --no-progress --no-plots
    echo "round $i, $side: $out/$side-$i.json"
  done
done

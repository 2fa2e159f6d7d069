#!/usr/bin/env bash
# The demo pair's sampling benchmark (bench/sampling_bench.py) for two revisions, taking turns (old, new, old,
# new), so that the host's slow and fast stretches land on both alike: on an H200 the demo pair's plain
# sampled step at batch 32 took 0.51-1.09 ms from one call to the next.
#   git archive OLD_REV src bench/sampling_bench.py | tar -x -C OLD_TREE    (here; OLD_TREE git-ignored)
#   bench/ab_sampling_demo.sh OLD_TREE OUT_DIR [ROUNDS] [BATCH_SIZES...]    (on the GPU machine)
# writes OUT_DIR/ab_old_N.json and OUT_DIR/ab_new_N.json (new: the working tree). The old tree may leave out
# src/tandem/demo_models: the working tree's are linked in.
set -uo pipefail
cd "$(dirname "$0")/.."
old=$1 out=$2 rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
sizes=${*:-8 32}
[ -e "$old/src/tandem/demo_models" ] || ln -s "$PWD/src/tandem/demo_models" "$old/src/tandem/demo_models"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for round in $(seq 1 "$rounds"); do
  for side in old new; do
    script=$([ "$side" = old ] && echo "$old/bench/sampling_bench.py" || echo bench/sampling_bench.py)
    t=$(date +%s)
    # shellcheck disable=SC2086
    timeout -k 5 "${AB_S:-90}" python "$script" --shapes demo --batch-sizes $sizes --repeats 5 \
      --out "$out/ab_${side}_$round.json" > "/tmp/ab_${side}_$round.log" 2>&1
    echo "== $side, round $round ($(( $(date +%s) - t )) s)"; grep -A9 "^demo:" "/tmp/ab_${side}_$round.log"
  done
done

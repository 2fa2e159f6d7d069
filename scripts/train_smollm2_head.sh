#!/usr/bin/env bash
# Trains the EAGLE-3 head of smollm2-135m-instruct on a CPU, from its own answers to the composed
# instruction set (docs/training.md). Each stage resumes where it stopped: run the same command again.
#   scripts/train_smollm2_head.sh [RUN_DIR]     (default: runs/smollm2-eagle3)
# Environment: PYTHON (default .venv/bin/python), THREADS (default 2), PROMPTS (training prompts answered,
# default 4000), STEPS (default 1200). The defaults take about three hours on 2 cores (docs/training.md).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/smollm2-eagle3}
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${THREADS:-2} TQDM_MININTERVAL=60   # a progress line a minute in a log file
mkdir -p "$RUN"
echo "== $(date -u +%FT%TZ) pull"
$PY -m tandem pull smollm2-135m-instruct
echo "== $(date -u +%FT%TZ) self-distill"
$PY -m tandem self-distill --model-path smollm2-135m-instruct --output-dir "$RUN" --device cpu \
    --per-module 5 --eval-per-kind 60 --max-prompts "${PROMPTS:-4000}" --max-new-tokens 128 --batch-size 32 \
    --sampled-every 3
echo "== $(date -u +%FT%TZ) train-draft"
$PY -m tandem train-draft --model-path smollm2-135m-instruct --corpus "$RUN/distill.jsonl" \
    --output-dir "$RUN/head" --device cpu --steps "${STEPS:-1200}" --batch-size 4 --seq-len 512 --lr 8e-4 \
    --draft-vocab-size 8192 --ttt-steps 3 --save-every 50 --resume --eval-fraction 0.02 --eval-prompts 16
echo "== $(date -u +%FT%TZ) float16 copy"
$PY -c "from tandem.train.export import save_as; save_as('$RUN/head', '$RUN/head-fp16', 'float16')"
ls -l "$RUN/head-fp16"
echo "== $(date -u +%FT%TZ) done"

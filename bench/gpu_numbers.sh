#!/usr/bin/env bash
# Every GPU number in docs/performance.md, measured again: the commands of its tables, one after the other
# (nothing else on the GPU while one times), each writing its record and log into OUT_DIR.
#
#   bench/gpu_numbers.sh [--quick] [--tar] [--only PART[,PART...]] [OUT_DIR]
#
# OUT_DIR: the argument, else $OUT, else bench/results/gpu-numbers. --quick: shorter runs of every part (fewer
# batch sizes, repeats and tokens; a few minutes in all), to check that everything runs, not to quote.
# --tar: pack OUT_DIR's files into OUT_DIR/gpu-numbers.tar.gz at the end (for a machine that hands back few
# files). --only: some parts, by name:
#   bench8b      tandem bench, 8B shape, synthetic acceptance 0.81, fixed depth (the decode step, speculation)
#   demo         tandem bench on the demo pair against transformers generate, fixed depth
#   overlap      bench/overlap_bench.py: iteration time, GPU idle time, kernels by kind (the bandwidth floor)
#   sampling8b   bench/sampling_bench.py, 8B shape: sampled iterations against greedy ones
#   sweep        tandem bench --sweep: plain, fixed and adaptive depth over acceptance x batch x temperature
#   samplingdemo bench/sampling_bench.py, demo pair: adaptive and fixed depth against plain, per sampling mode;
#                and bench/admission_trace.py --choices, the policy's inputs step by step
#   ttft         bench/ttft_profile.py: where the time to first token goes
#   structured   tandem bench on the demo pair with and without a JSON schema (needs xgrammar)
#   constants    the measurements code constants rest on: depth 0's cost, sampling kernel pivot rounds, top-k cut
#   precision    bench/precision_equality.py: speculative against plain tokens in bf16
#   multiturn    tandem bench --workload multi-turn, 8B shape: prefix cache on and off, speculation on and off;
#                the same with a 4,096-token system prompt; and the no-reuse workload, each engine twice (the cache's cost)
#   twogpu       tensor and data parallelism, the sharded draft layer (skipped with fewer than 2 GPUs)
# Puts the checkout's src first on PYTHONPATH (nothing to install); needs torch with CUDA, triton, transformers
# (the demo part), matplotlib (plots), not the server's packages. Exits 1 if a part failed (the others run).
set -uo pipefail
cd "$(dirname "$0")/.."
quick=0 tar=0 only="" out=""
while [ $# -gt 0 ]; do
    case $1 in
        --quick) quick=1 ;;
        --tar) tar=1 ;;
        --only) only=$2; shift ;;
        --only=*) only=${1#--only=} ;;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown flag $1" >&2; exit 2 ;;
        *) out=$1 ;;
    esac
    shift
done
OUT=${out:-${OUT:-bench/results/gpu-numbers}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# A copy of the tree sent to the measuring machine may carry a stale git history: name the commit with
# TANDEM_RECORD_COMMIT=$(git rev-parse --short HEAD) there, or the records name what git says.
PY=${PYTHON:-python}
LOG=$OUT/gpu-numbers.log
failed=()
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$LOG"
gpus=$(nvidia-smi -L | wc -l)

# q FULL QUICK: the full run's arguments, or --quick's
q() { if [ $quick = 1 ]; then echo "$2"; else echo "$1"; fi; }
wanted() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }
# part NAME COMMAND...: runs one command, its output in OUT/NAME.log, its time and status in the main log
part() {
    local name=$1; shift
    local t=$(date +%s)
    echo "== $name: $*" | tee -a "$LOG"
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -vE "it/s\]|s/it\]|tensor/s\]|^\s*$" "$OUT/$name.log" | tail -${TAIL:-25} | tee -a "$LOG"
    echo "== $name: exit $rc, $(( $(date +%s) - t )) s" | tee -a "$LOG"
    [ $rc = 0 ] || failed+=("$name")
}
bench() { $PY -m tandem bench --no-progress "$@"; }

if wanted bench8b; then
    # shellcheck disable=SC2046
    part bench8b bench --preset llama-3.1-8b --synthetic-acceptance 0.81 --speculative-adaptive off \
        --attention-backend triton $(q "--batch-sizes 1 8 32 --input-len 128 --output-len 128 --repeats 3" \
        "--batch-sizes 1 32 --input-len 32 --output-len 32") --out "$OUT/bench-llama-3.1-8b.json"
fi
if wanted demo; then
    # shellcheck disable=SC2046
    part demo bench --device cuda --compare-hf --speculative-adaptive off --attention-backend triton --no-plots \
        $(q "--batch-sizes 1 8 --input-len 128 --output-len 128 --repeats 3" \
        "--batch-sizes 1 8 --input-len 32 --output-len 32") \
        --out "$OUT/bench-demo.json"
fi
if wanted overlap; then
    # shellcheck disable=SC2046
    part overlap $PY bench/overlap_bench.py --shapes llama-3.1-8b --attention-backend triton --plain \
        $(q "--batches 1 32" "--batches 1") --out "$OUT/overlap-llama-3.1-8b.json"
fi
if wanted sampling8b; then
    # shellcheck disable=SC2046
    part sampling8b $PY bench/sampling_bench.py --shapes llama-3.1-8b \
        $(q "--batch-sizes 1 32 --repeats 3" "--batch-sizes 1 --repeats 1 --output-len 32") \
        --out "$OUT/sampling-llama-3.1-8b.json"
fi
if wanted sweep; then
    # shellcheck disable=SC2046
    TAIL=60 part sweep bench --sweep --preset llama-3.1-8b --attention-backend triton --cuda-graph-max-bs 128 \
        $(q "--input-len 64 --output-len 64 --repeats 5" \
        "--input-len 32 --output-len 32 --repeats 1 --sweep-acceptance 0 0.81 --batch-sizes 1 32") \
        --out "$OUT/sweep-llama-3.1-8b.json"
fi
if wanted samplingdemo; then
    # shellcheck disable=SC2046
    TAIL=20 part samplingdemo $PY bench/sampling_bench.py --shapes demo \
        $(q "--batch-sizes 1 8 32 --repeats 5" "--batch-sizes 1 8 --repeats 1 --output-len 32") \
        --out "$OUT/sampling-demo.json"
    # Every admission and choice of the adaptive policy, as the bench above warms up (what its rows rest on).
    # shellcheck disable=SC2046
    part policytrace $PY bench/admission_trace.py --choices --warmup-len 8 \
        $(q "--batch-sizes 1 8 32 --runs 3" "--batch-sizes 1 8 --runs 1 --output-len 32") \
        --out "$OUT/policy-trace-demo.json"
fi
if wanted ttft; then
    part ttft $PY bench/ttft_profile.py --overlap-only --top 8 --out "$OUT/ttft-profile-llama-3.1-8b.json"
    [ $quick = 1 ] || part ttft-cli-sizing $PY bench/ttft_profile.py --overlap-only --top 8 \
        --max-running-requests 64 --cuda-graph-max-bs 64 --out "$OUT/ttft-profile-llama-3.1-8b-cli-sizing.json"
fi
if wanted structured; then
    if $PY -c "import xgrammar" 2>/dev/null; then
        for schema in none schema; do
            args=(); [ $schema = schema ] && args=(--json-schema builtin)
            # shellcheck disable=SC2046
            part "structured-$schema" bench --temperature 0 --no-plots "${args[@]}" \
                $(q "--batch-sizes 1 8 32 --input-len 64 --output-len 256 --repeats 2" \
                "--batch-sizes 1 8 --input-len 32 --output-len 64") --out "$OUT/structured-demo-$schema.json"
        done
    else
        echo "== structured: skipped (xgrammar is not importable)" | tee -a "$LOG"
    fi
fi
if wanted constants; then
    # shellcheck disable=SC2046
    part depth0 $PY bench/depth0_cost.py --shape llama-3.1-8b $(q "--batch-sizes 1 32 64 128" "--batch-sizes 1 32") \
        --out "$OUT/depth0-cost-llama-3.1-8b.json"
    part pivot-rounds $PY bench/sampling_kernel_bench.py --rows 1 32 128 --pivot-rounds 0 3 \
        --out "$OUT/sampling-kernel-pivot-rounds.json"
    part topk $PY bench/topk_threshold_bench.py --out "$OUT/topk-threshold.json"
fi
if wanted precision; then
    # shellcheck disable=SC2046
    part precision $PY bench/precision_equality.py $(q "" "--configs fixed --prompts 8 --max-new-tokens 32") \
        --out "$OUT/precision-bf16.json"
fi
if wanted multiturn; then
    mt="--preset llama-3.1-8b --synthetic-acceptance 0.81 --speculative-adaptive off --attention-backend triton
        --cuda-graph-max-bs 32"
    # shellcheck disable=SC2046,SC2086
    part multi-turn bench --workload multi-turn $mt $(q "" "--conversations 8 --conversation-turns 3") \
        --out "$OUT/multi-turn-llama-3.1-8b.json"
    # shellcheck disable=SC2046,SC2086
    part multi-turn-long bench --workload multi-turn $mt --system-len 4096 \
        $(q "" "--conversations 8 --conversation-turns 3") --out "$OUT/multi-turn-long-llama-3.1-8b.json"
    # Two runs of each engine, cache on and off taking turns at going first (the first engine pays compiles).
    # shellcheck disable=SC2046,SC2086
    part no-reuse bench --workload no-reuse $mt --repeats 2 $(q "" "--conversations 8 --conversation-turns 3") \
        --out "$OUT/no-reuse-llama-3.1-8b.json"
fi
if wanted twogpu; then
    if [ "$gpus" -ge 2 ]; then
        # (NVLink multicast off, as the two-GPU records were measured)
        NCCL_NVLS_ENABLE=0 TANDEM_GPU_RESULTS_DIR=$OUT part twogpu-tests $PY -m pytest -q -p no:cacheprovider \
            tests/gpu/test_tp_gpu.py tests/gpu/test_dp_gpu.py
        NCCL_NVLS_ENABLE=0 part draft-tp $PY bench/draft_tp_bench.py --out "$OUT/draft-tp-llama-3.1-8b.json"
    else
        echo "== twogpu: skipped ($gpus GPU)" | tee -a "$LOG"
    fi
fi

if [ $tar = 1 ]; then
    (cd "$OUT" && find . -maxdepth 1 -type f ! -name gpu-numbers.tar.gz -printf '%P\n' \
        | tar -czf gpu-numbers.tar.gz -T - && find . -maxdepth 1 -type f ! -name 'gpu-numbers.*' -delete)
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" | tee -a "$LOG"
    exit 1
fi
echo "every part passed; records in $OUT" | tee -a "$LOG"

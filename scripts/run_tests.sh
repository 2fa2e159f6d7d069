#!/usr/bin/env bash
# The whole test suite (GPU tests skip themselves without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
# tests/real_model runs SmolLM2-135M-Instruct, pulled once into the cache (TANDEM_CACHE, default
# ~/.cache/tandem; keep that directory between CI runs and this step is offline). Without the
# network and the cache, those tests skip.
.venv/bin/tandem pull smollm2-135m-instruct \
    || echo "run_tests.sh: smollm2-135m-instruct could not be pulled; tests/real_model will skip" >&2
exec .venv/bin/python -m pytest -q "$@"

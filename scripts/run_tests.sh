#!/usr/bin/env bash
# The whole test suite (GPU tests skip themselves without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"

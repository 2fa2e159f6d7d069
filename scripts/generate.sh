#!/usr/bin/env bash
# Sets up the environment if needed, then runs `tandem generate` (arguments are passed through).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
exec .venv/bin/tandem generate "$@"

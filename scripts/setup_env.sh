#!/usr/bin/env bash
# Creates (or reuses) the project-local virtual environment .venv and installs tandem into it.
# torch is pinned to the CPU wheel first so no CUDA build is pulled in on machines without a GPU;
# a machine that already has torch in .venv keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[test]"

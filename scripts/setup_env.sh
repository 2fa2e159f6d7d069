#!/usr/bin/env bash
# Creates (or reuses) the project-local virtual environment .venv and installs tandem into it.
# torch is pinned to the CPU wheel first so no CUDA build is pulled in on machines without a GPU;
# a machine that already has torch in .venv keeps it. Once installed, nothing is redone until
# pyproject.toml changes (its hash is kept in .venv): pip's own check that nothing changed took about
# 8 s on a 2-core machine, at every run of the scripts that call this one.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.tandem-pyproject-sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/tandem ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[test]"
echo "$want" > "$stamp"

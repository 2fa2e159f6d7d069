"""Every shell and Python block marked `<!-- runnable on a CPU -->` in README.md and docs/*.md runs and
exits 0, with the demo pair and small token counts, so the documentation cannot drift from the code.
Shell blocks run in the repository root with this interpreter's environment standing in for `.venv/`."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MARK = "<!-- runnable on a CPU -->"
BLOCK = re.compile(re.escape(MARK) + r"\s*\n```(bash|python)\n(.*?)\n```", re.S)


def runnable_blocks() -> list[tuple[str, str, str]]:
    blocks = []
    for path in [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        text = open(path).read()
        for i, m in enumerate(BLOCK.finditer(text)):
            blocks.append((f"{os.path.relpath(path, REPO)}#{i}", m.group(1), m.group(2)))
    return blocks


BLOCKS = runnable_blocks()


def test_the_docs_mark_enough_blocks():
    assert len(BLOCKS) >= 5, [b[0] for b in BLOCKS]  # the test below must not pass by finding nothing


@pytest.mark.parametrize("where,lang,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs(where, lang, code, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    if lang == "python":
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
    else:
        if "./scripts/" in code and not os.path.exists(os.path.join(REPO, ".venv", "bin", "python")):
            pytest.skip("the scripts create .venv/ (the README's set-up); this checkout runs without one")
        bin_dir = os.path.dirname(sys.executable)
        # Output files into this test's directory first (the checkout itself may live under /tmp/).
        script = code.replace(" /tmp/", f" {tmp_path}/").replace(".venv/bin/", bin_dir + "/")
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
    assert proc.returncode == 0, f"{where} failed:\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"

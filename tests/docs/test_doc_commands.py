"""Every shell and Python block marked `<!-- runnable on a CPU -->` in README.md and docs/*.md runs and
exits 0, with small token counts, so the documentation cannot drift from the code.
Shell blocks run in the repository root with this interpreter's environment standing in for `.venv/`.
Python blocks marked `<!-- runnable against the default server -->` run against `tandem serve` with no
model flag (smollm2-135m-instruct and its head on port 30000, as the blocks say), started once for them."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MARK = "<!-- runnable on a CPU -->"
SERVER_MARK = "<!-- runnable against the default server -->"
SERVER_PORT = 30000


def runnable_blocks(mark: str = MARK, langs: str = "bash|python") -> list[tuple[str, str, str]]:
    block = re.compile(re.escape(mark) + r"\s*\n```(" + langs + r")\n(.*?)\n```", re.S)
    blocks = []
    for path in [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        text = open(path).read()
        for i, m in enumerate(block.finditer(text)):
            blocks.append((f"{os.path.relpath(path, REPO)}#{i}", m.group(1), m.group(2)))
    return blocks


BLOCKS = runnable_blocks()
DEFAULT_MODEL_COMMAND = re.compile(r"(tandem (generate|serve)|generate\.sh)\b")


def needs_real_model(code: str) -> bool:
    """Whether a block runs smollm2-135m-instruct: by name, or as the default of `generate` and `serve`."""
    lines = code.replace("\\\n", " ").splitlines()  # (a command continued over lines is one line)
    return "smollm2-135m-instruct" in code or any(
        DEFAULT_MODEL_COMMAND.search(line) and "--model-path" not in line for line in lines)


SERVER_BLOCKS = runnable_blocks(SERVER_MARK, "python")


def test_the_docs_mark_enough_blocks():
    assert len(BLOCKS) >= 5, [b[0] for b in BLOCKS]  # the test below must not pass by finding nothing


@pytest.mark.parametrize("where,lang,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs(where, lang, code, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    if needs_real_model(code):
        from tandem import named_models, pull

        if not pull.is_pulled(named_models.MODELS["smollm2-135m-instruct"]):
            pytest.skip("smollm2-135m-instruct is not pulled here (./scripts/run_tests.sh pulls it first)")
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


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    import time
    import urllib.request

    from tandem import named_models, pull

    if not pull.is_pulled(named_models.MODELS["smollm2-135m-instruct"]):
        pytest.skip("smollm2-135m-instruct is not pulled here (./scripts/run_tests.sh pulls it first)")
    log = open(tmp_path_factory.mktemp("default-server") / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "--port", str(SERVER_PORT), "--device", "cpu"],
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "2"}, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{SERVER_PORT}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.5)
    yield proc
    proc.terminate()
    proc.wait(timeout=30)


def test_the_docs_mark_server_blocks():
    assert len(SERVER_BLOCKS) >= 2, [b[0] for b in SERVER_BLOCKS]


@pytest.mark.parametrize("where,lang,code", SERVER_BLOCKS, ids=[b[0] for b in SERVER_BLOCKS])
def test_server_block_runs(where, lang, code, default_server):
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{where} failed:\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"

"""Fixtures for `tandem bench`: a tiny real checkpoint with an EAGLE-3 head, and a runner of the command."""

import json
import os

import pytest

from tandem.cli import main
from tests.models.tiny_checkpoints import make_checkpoint
from tests.speculative.draft_checkpoints import write_eagle3_head

FAST = ["--device", "cpu", "--no-progress", "--page-size", "4"]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target dir, EAGLE-3 head dir, the transformers target model)."""
    root = tmp_path_factory.mktemp("bench_models")
    target, head = str(root / "target"), str(root / "eagle3")
    hf_model = make_checkpoint("llama3", target, seed=0)
    write_eagle3_head(head, json.load(open(os.path.join(target, "config.json"))), seed=2)
    return target, head, hf_model


@pytest.fixture
def bench(tmp_path, capsys):
    """Runs `tandem bench ARGS` in this process; returns (exit code, JSON record or None, stdout, stderr)."""

    def run(*args, out="r.json"):
        argv = ["--log-level", "WARNING", "bench", *FAST, *args]
        if out is not None:
            argv += ["--out", str(tmp_path / out)]
        rc = main(argv)
        captured = capsys.readouterr()
        record = json.load(open(tmp_path / out)) if rc == 0 and out is not None else None
        return rc, record, captured.out, captured.err

    return run

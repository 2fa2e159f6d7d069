"""Shared speculative-decoding fixtures: one tiny target and a draft of each kind, made once."""

import json
import os

import pytest

from tests.models.tiny_checkpoints import make_checkpoint
from tests.speculative.draft_checkpoints import write_eagle3_head, write_eagle_head

CHAIN = dict(speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=4)
TREE = dict(speculative_eagle_topk=4, speculative_num_steps=5, speculative_num_draft_tokens=8)
ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_total_tokens=16384, chunked_prefill_size=64)


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")
    target = str(root / "target")
    make_checkpoint("llama3", target, seed=0)
    cfg = json.load(open(os.path.join(target, "config.json")))
    other = str(root / "standalone")
    make_checkpoint("llama2_tied", other, seed=5)  # same vocabulary, different weights
    eagle, eagle3 = str(root / "eagle"), str(root / "eagle3")
    write_eagle_head(eagle, cfg, seed=1)
    write_eagle3_head(eagle3, cfg, seed=2)
    return {"target": target, "EAGLE": eagle, "EAGLE3": eagle3, "STANDALONE": other, "SELF": target}

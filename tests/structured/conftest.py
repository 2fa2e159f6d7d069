"""Structured-output fixtures: a tiny random target with a real (byte-level) tokenizer, and drafts for it."""

import json
import os

import pytest

from tests.engine.helpers import make_tokenizer_checkpoint
from tests.speculative.draft_checkpoints import write_eagle3_head

ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_total_tokens=32768, chunked_prefill_size=64)
CHAIN = dict(speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=4)
TREE = dict(speculative_eagle_topk=3, speculative_num_steps=4, speculative_num_draft_tokens=8)


@pytest.fixture(scope="session")
def grammar_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar_models")
    target, _, _ = make_tokenizer_checkpoint(str(root / "target"), seed=0)
    standalone, _, _ = make_tokenizer_checkpoint(str(root / "standalone"), seed=7)
    eagle3 = str(root / "eagle3")
    write_eagle3_head(eagle3, json.load(open(os.path.join(target, "config.json"))), seed=2)
    return {"target": target, "EAGLE3": eagle3, "STANDALONE": standalone, "SELF": target}

"""Tiny checkpoints for the tensor-parallel tests (CPU, gloo, two ranks, float32)."""

import json
import os

import pytest

from tests.models.tiny_checkpoints import make_checkpoint
from tests.speculative.draft_checkpoints import write_eagle3_head, write_eagle_head, write_mtp_head

ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=64)
CHAIN = dict(speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=4)
TREE = dict(speculative_eagle_topk=4, speculative_num_steps=5, speculative_num_draft_tokens=8)


@pytest.fixture(scope="session")
def tp_models(tmp_path_factory):
    """llama3: 4 query heads, 2 KV heads (one per rank), untied lm_head; mistral: 1 KV head
    (replicated on both ranks); qwen3: tied embeddings, q/k norms, head_dim != hidden / heads."""
    root = tmp_path_factory.mktemp("tp_models")
    paths = {}
    for family in ("llama3", "mistral", "qwen3"):
        paths[family] = str(root / family)
        make_checkpoint(family, paths[family], seed=0)
    cfg = json.load(open(os.path.join(paths["llama3"], "config.json")))
    paths["EAGLE"], paths["EAGLE3"] = str(root / "eagle"), str(root / "eagle3")
    write_eagle_head(paths["EAGLE"], cfg, seed=1)
    write_eagle3_head(paths["EAGLE3"], cfg, seed=2)
    paths["MTP"] = str(root / "mtp")
    write_mtp_head(paths["MTP"], cfg, num_modules=3, seed=3, own_heads=(1,))  # module 1 has its own head
    return paths

"""Our Llama-family implementation against Hugging Face transformers on tiny random checkpoints."""

import pytest
import torch

from tandem import Engine, SamplingParams
from tandem.layers.attention.base import AttentionBatch, positions_to_slots
from tandem.runtime.model_runner import FlatBatch
from tests.models.tiny_checkpoints import FAMILIES, checkpoint_dir, prompts

NEW_TOKENS = 64


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pair(request, tmp_path_factory):
    path, hf_model = checkpoint_dir(tmp_path_factory, request.param)
    engine = Engine(path, device="cpu", dtype="float32", page_size=4, max_total_tokens=8192)
    yield request.param, hf_model, engine
    engine.shutdown()


def _prefill_logits(engine, token_lists):
    """All prompts in one forward pass over the paged cache; logits of every position, per prompt."""
    runner = engine.runner
    ps = runner.page_size
    input_ids, positions, slots, kv_slots = [], [], [], []
    next_page = 0
    for ids in token_lists:
        pages = list(range(next_page, next_page + -(-len(ids) // ps)))
        next_page += len(pages)
        input_ids += ids
        positions += range(len(ids))
        kv_slots.append(positions_to_slots(pages, range(len(ids)), ps))
        slots += kv_slots[-1]
    lens = [len(ids) for ids in token_lists]
    batch = FlatBatch(input_ids, positions, AttentionBatch(lens, kv_slots, slots), [], [], [])
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.forward(batch))
    return logits.split(lens)


def test_logits_match_transformers(family_pair):
    _, hf_model, engine = family_pair
    token_lists = prompts(8)
    ours = _prefill_logits(engine, token_lists)
    for ids, got in zip(token_lists, ours):
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0].float()
        rel = (got - want).abs().max() / want.abs().max()
        assert rel <= 1e-4, f"relative logits error {rel:.2e} for a prompt of {len(ids)} tokens"


def _hf_greedy(hf_model, ids):
    hf_model.generation_config.eos_token_id = None  # compare full 64-token runs
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                            pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers_batched_and_alone(family_pair):
    family, hf_model, engine = family_pair
    token_lists = prompts(8)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    batched = engine.generate(input_ids=token_lists, sampling_params=params)
    for ids, out in zip(token_lists, batched):
        want = _hf_greedy(hf_model, ids)
        assert out.token_ids == want, f"{family}: batched greedy differs for a {len(ids)}-token prompt"
        alone = engine.generate(input_ids=[ids], sampling_params=params)[0]
        assert alone.token_ids == want, f"{family}: single greedy differs for a {len(ids)}-token prompt"
        assert out.finish_reason == "length"

"""Greedy output must not depend on how the engine schedules: a KV pool so small that requests are
retracted and recomputed, or a token budget so small that prompts are prefilled in chunks, must give
the tokens of a roomy engine (and of transformers' own generate)."""

import pytest
import torch

from tandem import SamplingParams
from tests.engine.helpers import checkpoint_dir, cpu_engine, hf_greedy, instrument_preemptions
from tests.models.tiny_checkpoints import prompts

NEW_TOKENS = 48
PAGE_SIZE = 4
PROMPTS = prompts(10)  # lengths 1 .. 60
# The longest request needs 60 + 48 - 1 = 107 KV slots (its last token is never fed): 27 pages.
# 28 pages hold that one request but nowhere near all ten at once.
SMALL_POOL = 112
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama3")


@pytest.fixture(scope="module")
def roomy(ckpt):
    return cpu_engine(ckpt[0], page_size=PAGE_SIZE, max_total_tokens=8192)


@pytest.fixture(scope="module")
def roomy_outputs(roomy):
    return [o.token_ids for o in roomy.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _watch(engine):
    """Records, per preemption, how many output tokens the victim had (they must be recomputed)."""
    preempted_outputs, max_step_tokens = [], [0]
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        for rid in out.preempted_ids:
            preempted_outputs.append(len(engine.scheduler.get_request(rid).output_token_ids))
        max_step_tokens[0] = max(max_step_tokens[0], out.num_tokens)
        return out

    engine.scheduler.schedule = watched
    return preempted_outputs, max_step_tokens


@pytest.mark.parametrize("chunked_prefill_size", [2048, 8])
def test_greedy_with_forced_preemption_equals_a_large_pool(ckpt, roomy_outputs, chunked_prefill_size):
    engine = cpu_engine(ckpt[0], page_size=PAGE_SIZE, max_total_tokens=SMALL_POOL,
                        chunked_prefill_size=chunked_prefill_size)
    alloc = engine.scheduler.allocator
    assert alloc.num_total == SMALL_POOL // PAGE_SIZE
    preempted_ids = instrument_preemptions(engine)
    preempted_outputs, max_step_tokens = _watch(engine)

    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)

    assert preempted_ids, "the small pool never forced a preemption; the test is not testing anything"
    assert max(preempted_outputs) > 0, "no request was preempted while decoding (outputs never recomputed)"
    assert max_step_tokens[0] <= chunked_prefill_size
    for ids, out, want in zip(PROMPTS, outs, roomy_outputs):
        assert out.finish_reason == "length"
        assert out.token_ids == want, f"greedy output differs under preemption for a {len(ids)}-token prompt"
    assert not engine.has_unfinished()
    assert alloc.num_free + alloc.num_cached == alloc.num_total, "KV pages leaked"


def test_preemption_frees_pages_and_engine_keeps_working(ckpt, roomy_outputs):
    # A second round on the same small engine: the pool is whole again and results unchanged.
    engine = cpu_engine(ckpt[0], page_size=PAGE_SIZE, max_total_tokens=SMALL_POOL)
    alloc = engine.scheduler.allocator
    preempted = instrument_preemptions(engine)
    for _ in range(2):
        outs = engine.generate(input_ids=PROMPTS[::-1], sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == roomy_outputs[::-1]
        assert alloc.num_free + alloc.num_cached == alloc.num_total
    assert len(preempted) >= 2


LONG_PROMPTS = [torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                for n in (45, 70, 101)]
CHUNK_NEW_TOKENS = 24


def test_chunked_prefill_matches_large_budget_and_transformers(ckpt, roomy):
    path, hf_model = ckpt
    params = SamplingParams(max_new_tokens=CHUNK_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    chunked = cpu_engine(path, page_size=PAGE_SIZE, max_total_tokens=8192, chunked_prefill_size=8)
    chunks_seen = []
    schedule = chunked.scheduler.schedule

    def watched():
        out = schedule()
        chunks_seen.extend(out.chunks)
        assert out.num_tokens <= 8
        return out

    chunked.scheduler.schedule = watched
    got = chunked.generate(input_ids=LONG_PROMPTS, sampling_params=params)
    # Each prompt really was prefilled in several pieces, resuming mid-prompt.
    for ids in LONG_PROMPTS:
        starts = [c.start_pos for c in chunks_seen if c.num_prompt_tokens == len(ids) and c.start_pos < len(ids)]
        assert len(starts) >= len(ids) // 8 and max(starts) > 0
    big = roomy.generate(input_ids=LONG_PROMPTS, sampling_params=params)
    for ids, g, b in zip(LONG_PROMPTS, got, big):
        want = hf_greedy(hf_model, ids, CHUNK_NEW_TOKENS)
        assert b.token_ids == want, f"large budget differs from transformers for a {len(ids)}-token prompt"
        assert g.token_ids == want, f"chunked prefill differs from transformers for a {len(ids)}-token prompt"
    alloc = chunked.scheduler.allocator
    assert alloc.num_free + alloc.num_cached == alloc.num_total

"""Greedy speculative output equals plain greedy output, token for token, for every draft kind,
chain and tree drafting, and several batch sizes."""

from dataclasses import replace

import pytest

from tandem import Engine, SamplingParams
from tests.models.tiny_checkpoints import prompts
from tests.speculative.conftest import CHAIN, ENGINE, TREE

NEW_TOKENS = 20
PROMPTS = prompts(10, seed=3) + prompts(10, seed=4) + prompts(10, seed=5) + prompts(2, seed=6)  # 32 prompts


@pytest.fixture(scope="module")
def reference(spec_models):
    with Engine(spec_models["target"], **ENGINE) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=params)]


def _spec_engine(spec_models, kind, shape, **extra):
    alg = "STANDALONE" if kind == "SELF" else kind
    return Engine(spec_models["target"], speculative_algorithm=alg,
                  speculative_draft_model_path=spec_models[kind], **shape, **{**ENGINE, **extra})


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3", "STANDALONE"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_speculative_equals_plain(spec_models, reference, kind, shape):
    with _spec_engine(spec_models, kind, shape) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        # Prompt chunks beside verify rows (prefill_first off), and prompt-only steps while requests wait.
        for batch, prefill_first in ((1, False), (3, False), (16, False), (16, True)):
            engine.scheduler.config = replace(engine.scheduler.config, max_num_seqs=batch, prefill_first=prefill_first)
            outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
            for i, (out, want) in enumerate(zip(outs, reference)):
                assert out.token_ids == want, f"{kind} batch {batch} prefill_first {prefill_first}: prompt {i} differs"
                assert sum(out.spec_accept_lengths) >= NEW_TOKENS - 1
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_target_as_its_own_draft(spec_models, reference, shape):
    """With the target drafting for itself every chain draft is accepted: tau = num_steps + 1."""
    with _spec_engine(spec_models, "SELF", shape, speculative_adaptive="off") as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=PROMPTS[:8], sampling_params=params)
        for out, want in zip(outs, reference):
            assert out.token_ids == want
            if shape is CHAIN:
                assert out.spec_accept_lengths == [4] * len(out.spec_accept_lengths)
            else:
                assert min(out.spec_accept_lengths) >= 2  # the target's own argmax is always drafted
        assert engine.runner.spec.stats.num_drafts > 0

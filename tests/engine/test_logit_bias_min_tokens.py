"""logit_bias and min_tokens against transformers' own logits processors (SequenceBiasLogitsProcessor,
MinNewTokensLengthLogitsProcessor) in greedy generation, float32; and the same tokens with
speculation on (the verify path applies them at every tree node)."""

import pytest

from tandem import SamplingParams
from tests.engine.helpers import CHAIN3, checkpoint_dir, cpu_engine, eagle3_head_for, hf_greedy
from tests.models.tiny_checkpoints import prompts

PROMPTS = prompts(4, seed=21)
N = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama3")


@pytest.fixture(scope="module")
def engines(ckpt, tmp_path_factory):
    head = eagle3_head_for(tmp_path_factory, ckpt[0], seed=3)
    plain = cpu_engine(ckpt[0], max_total_tokens=4096)
    spec = cpu_engine(ckpt[0], max_total_tokens=4096, speculative_draft_model_path=head, **CHAIN3)
    yield {"plain": plain, "spec": spec}
    plain.shutdown()
    spec.shutdown()


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_logit_bias_matches_transformers(engines, ckpt, kind):
    engine = engines[kind]
    changed = 0
    for prompt in PROMPTS:
        base = hf_greedy(ckpt[1], prompt, N)
        # Push up a token greedy decoding did not pick at step 3, push down the one it picked at step 1.
        up, down = (base[3] + 7) % 320, base[1]
        bias = {up: 6.0, down: -50.0}
        want = hf_greedy(ckpt[1], prompt, N, sequence_bias={(up,): 6.0, (down,): -50.0})
        out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
            max_new_tokens=N, temperature=0.0, ignore_eos=True, logit_bias=bias))[0]
        assert out.token_ids == want
        changed += want != base
    assert changed, "the bias changed nothing: the comparison proves little"


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_min_tokens_matches_transformers(engines, ckpt, kind):
    engine = engines[kind]
    for prompt in PROMPTS:
        first = hf_greedy(ckpt[1], prompt, 1)[0]  # greedy's first token, made a stop token below
        want = hf_greedy(ckpt[1], prompt, N, eos_token_id=first, min_new_tokens=5)
        assert len(want) >= 5
        params = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True, stop_token_ids=[first], min_tokens=5)
        out = engine.generate(input_ids=[prompt], sampling_params=params)[0]
        # transformers pads after its EOS; tandem stops at the stop token (kept in its output)
        assert out.token_ids == want[: len(out.token_ids)] and (len(out.token_ids) == N or out.token_ids[-1] == first)
        without = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
            max_new_tokens=N, temperature=0.0, ignore_eos=True, stop_token_ids=[first]))[0]
        assert without.token_ids == [first]  # without min_tokens the stop token ends it at once


def test_bad_values_are_refused():
    for kw in ({"min_tokens": -1}, {"min_tokens": 200, "max_new_tokens": 10}, {"logit_bias": {5: 101.0}},
               {"logit_bias": {-1: 1.0}}, {"logit_bias": {i: 1.0 for i in range(301)}}):
        with pytest.raises(ValueError, match="min_tokens|logit_bias"):
            SamplingParams(**kw)

"""Sampling through the whole engine: seeded requests are reproducible whatever they are batched
with, unseeded ones are random, logprobs are the model's, repetition penalty is transformers'."""

import pytest
import torch

from tandem import SamplingParams
from tests.engine.helpers import checkpoint_dir, cpu_engine, hf_greedy, hf_logprobs, instrument_preemptions
from tests.models.tiny_checkpoints import prompts

PROMPTS = prompts(10)
TARGET_PROMPT = PROMPTS[4]  # 17 tokens
NEW = 32


def seeded(seed=1234, **kw):
    return SamplingParams(**{"max_new_tokens": NEW, "temperature": 0.8, "top_p": 0.9, "seed": seed,
                             "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama3")


@pytest.fixture(scope="module")
def engine(ckpt):
    return cpu_engine(ckpt[0], max_total_tokens=4096)


@pytest.fixture(scope="module")
def alone(engine):
    return engine.generate(input_ids=[TARGET_PROMPT], sampling_params=seeded())[0].token_ids


def test_seeded_request_is_batch_invariant(engine, alone):
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    unseeded = SamplingParams(max_new_tokens=NEW, temperature=1.0, ignore_eos=True)
    batches = [
        ([PROMPTS[0], TARGET_PROMPT, PROMPTS[7]], [greedy, seeded(), unseeded]),
        ([PROMPTS[9], PROMPTS[2], PROMPTS[5], PROMPTS[1], TARGET_PROMPT, PROMPTS[3]],
         [seeded(7), unseeded, seeded(1234, max_new_tokens=5), SamplingParams(max_new_tokens=3, temperature=0.5),
          seeded(), seeded(99, top_k=5)]),
    ]
    for ids, params in batches:
        i = ids.index(TARGET_PROMPT)
        outs = engine.generate(input_ids=ids, sampling_params=params)
        assert outs[i].token_ids == alone, f"seeded output changed in a batch of {len(ids)}"
    # The same seed on another prompt (third request of batch 2) must not just replay these tokens.
    assert outs[2].token_ids != alone[:5]


def test_seeded_request_survives_preemption_and_chunking(ckpt, alone):
    # A pool and a token budget so small that the request is chunked and retracted mid-decode.
    small = cpu_engine(ckpt[0], max_total_tokens=80, chunked_prefill_size=8)
    preempted = instrument_preemptions(small)
    ids = [PROMPTS[7], TARGET_PROMPT, PROMPTS[5], PROMPTS[6]]
    params = [seeded(5), seeded(), seeded(6), SamplingParams(max_new_tokens=NEW, temperature=1.0, ignore_eos=True)]
    outs = small.generate(input_ids=ids, sampling_params=params)
    assert preempted, "no preemption happened"
    assert outs[1].token_ids == alone
    assert small.scheduler.allocator.num_used == 0  # every page is free or cached


def test_seed_matters_and_unseeded_requests_vary(engine, alone):
    other_seed = engine.generate(input_ids=[TARGET_PROMPT], sampling_params=seeded(4321))[0].token_ids
    assert other_seed != alone
    unseeded = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, ignore_eos=True)
    outs = engine.generate(input_ids=[TARGET_PROMPT] * 4, sampling_params=unseeded)
    again = engine.generate(input_ids=[TARGET_PROMPT], sampling_params=unseeded)[0]
    runs = {tuple(o.token_ids) for o in outs + [again]}
    assert len(runs) >= 4, "unseeded requests repeat each other"


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, logprobs=3, ignore_eos=True),
    SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True),
    SamplingParams(max_new_tokens=16, temperature=1.0, top_k=4, repetition_penalty=1.3, seed=4, logprobs=3,
                   ignore_eos=True),
], ids=["sampled", "greedy", "penalized"])
def test_logprobs_match_transformers(engine, ckpt, params):
    hf_model = ckpt[1]
    ids = [PROMPTS[2], PROMPTS[6], PROMPTS[9]]
    plain = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)  # a companion without logprobs
    outs = engine.generate(input_ids=ids + [PROMPTS[3]], sampling_params=[params] * 3 + [plain])
    assert outs[3].logprobs is None
    not_argmax = 0
    for prompt, out in zip(ids, outs):
        want = hf_logprobs(hf_model, prompt, out.token_ids)  # raw model distribution per step
        assert len(out.logprobs) == len(out.token_ids) == 16
        for t, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token_id == tok
            assert abs(lp.logprob - want[t, tok].item()) <= 1e-4, f"step {t}"
            top_vals, top_ids = want[t].topk(3)
            assert [i for i, _ in lp.top] == top_ids.tolist(), f"step {t}"
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_vals, atol=1e-4)
            not_argmax += tok != top_ids[0].item()
    if not params.greedy:
        assert not_argmax > 0, "every sampled token was the argmax: the chosen-token check is too weak"


def test_logprobs_zero_gives_chosen_token_only(engine, ckpt):
    out = engine.generate(input_ids=[PROMPTS[5]], sampling_params=SamplingParams(
        max_new_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True))[0]
    want = hf_logprobs(ckpt[1], PROMPTS[5], out.token_ids)
    assert [lp.top for lp in out.logprobs] == [[]] * 6
    assert all(abs(lp.logprob - want[t, lp.token_id].item()) <= 1e-4 for t, lp in enumerate(out.logprobs))


def test_repetition_penalty_matches_transformers(engine, ckpt):
    hf_model = ckpt[1]
    n = 24
    ids = [PROMPTS[1], PROMPTS[4], PROMPTS[8]]
    outs = engine.generate(input_ids=ids, sampling_params=SamplingParams(
        max_new_tokens=n, temperature=0.0, repetition_penalty=1.3, ignore_eos=True))
    changed = 0
    for prompt, out in zip(ids, outs):
        want = hf_greedy(hf_model, prompt, n, repetition_penalty=1.3)
        assert out.token_ids == want, f"repetition_penalty output differs for a {len(prompt)}-token prompt"
        changed += want != hf_greedy(hf_model, prompt, n)
    assert changed, "the penalty changed nothing on these prompts: the comparison proves little"

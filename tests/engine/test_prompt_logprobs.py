"""Prompt logprobs (SamplingParams.prompt_logprobs) against Hugging Face transformers' log-softmax over
the same checkpoint, float32: in one prefill and in chunks, with speculation on (the draft never
changes them), with overlap off, and when requests are preempted and recomputed (each position once)."""

import pytest
import torch

from tandem import SamplingParams
from tests.engine.helpers import CHAIN3, checkpoint_dir, cpu_engine, eagle3_head_for, instrument_preemptions
from tests.models.tiny_checkpoints import prompts

PROMPTS = prompts(6, seed=11)
TOP = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama3")


@pytest.fixture(scope="module")
def head(ckpt, tmp_path_factory):
    return eagle3_head_for(tmp_path_factory, ckpt[0], seed=2)


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row p is log P(. | prompt[:p + 1]), which scores prompt[p + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check(outs, ckpt, top=TOP):
    for prompt, out in zip(PROMPTS, outs):
        want = hf_prompt_logprobs(ckpt[1], prompt)
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        for t in range(1, len(prompt)):
            lp = lps[t]
            assert lp is not None and lp.token_id == prompt[t], t
            assert abs(lp.logprob - want[t - 1, prompt[t]].item()) <= 1e-4, t
            top_v, top_i = want[t - 1].topk(top)
            assert [i for i, _ in lp.top] == top_i.tolist(), t
            assert max((abs(v - w) for (_, v), w in zip(lp.top, top_v.tolist())), default=0) <= 1e-4, t


PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)


@pytest.mark.parametrize("extra", [{}, {"chunked_prefill_size": 7}, {"disable_overlap_schedule": True}],
                         ids=["one-prefill", "chunks-of-7", "no-overlap"])
def test_prompt_logprobs_match_transformers(ckpt, extra):
    with cpu_engine(ckpt[0], max_total_tokens=4096, **extra) as engine:
        plain = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=PROMPTS + [PROMPTS[0]], sampling_params=[PARAMS] * len(PROMPTS) + [plain])
    assert outs[-1].prompt_logprobs is None  # a companion that did not ask
    check(outs[:-1], ckpt)


def test_prompt_logprobs_with_speculation(ckpt, head):
    with cpu_engine(ckpt[0], max_total_tokens=4096, chunked_prefill_size=9, speculative_draft_model_path=head,
                    **CHAIN3) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    check(outs, ckpt)


def test_prompt_logprobs_survive_preemption(ckpt):
    long_params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    with cpu_engine(ckpt[0], max_total_tokens=96, chunked_prefill_size=8) as engine:
        preempted = instrument_preemptions(engine)
        outs = engine.generate(input_ids=PROMPTS, sampling_params=long_params)
        assert preempted, "no request was preempted: the pool is too large for this test"
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached
    check(outs, ckpt, top=0)


def test_bad_prompt_logprobs_value():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)

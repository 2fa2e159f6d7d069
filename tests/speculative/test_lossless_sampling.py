"""Speculative sampling is lossless: on a tiny-vocabulary target, the distribution of each generated
token under speculation equals the target's own distribution, computed exactly by enumerating every
prefix with Hugging Face transformers. A deliberately wrong noise key (every tree node drawing with the
root's noise, a forgotten "+ depth") fails the same test. The GPU case runs the fused sampling kernel
inside the CUDA-graphed iteration."""

import json
import random

import math

import pytest
import torch

import tandem.speculative.worker as worker_module
from tandem import Engine, SamplingParams
from tests.speculative.draft_checkpoints import write_eagle3_head

VOCAB = 8
PROMPT = [3, 5, 6]
NEW = 3
SAMPLES = 30_000
# chi-square critical value for 7 degrees of freedom at alpha = 1e-4 (scipy.stats.chi2.isf(1e-4, 7))
CHI2_CRIT_DF7 = 29.88


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("tiny_vocab")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.3, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(root / "target", safe_serialization=True)
    write_eagle3_head(str(root / "eagle3"), json.load(open(root / "target" / "config.json")), seed=3, draft_vocab=6)
    return str(root / "target"), str(root / "eagle3"), hf


def filtered_row(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """One row of the target distribution in float64, written out by hand: top-k keeps tokens at least
    as likely as the k-th, top-p (on the renormalised survivors) keeps a token while the mass strictly
    more likely than it is below top_p."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    p = [math.exp(x - top) for x in scaled]
    if 0 < top_k < len(p):
        kth = sorted(p, reverse=True)[top_k - 1]
        p = [x if x >= kth else 0.0 for x in p]
    total = sum(p)
    p = [x / total for x in p]
    if top_p < 1.0:
        p = [x if sum(y for y in p if y > x) < top_p else 0.0 for x in p]
    total = sum(p)
    return [x / total for x in p]


def exact_marginals(hf, temperature: float, top_k: int, top_p: float = 1.0) -> list[torch.Tensor]:
    """P(token at new position i) for i < NEW, by enumerating all prefixes (float64)."""
    def next_probs(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1].double()
        return torch.tensor([filtered_row(row, temperature, top_k, top_p) for row in logits.tolist()],
                            dtype=torch.float64)

    marginals = []
    prob_of = {(): 1.0}
    for _ in range(NEW):
        prefixes = list(prob_of)
        probs = next_probs(prefixes)
        marginal = torch.zeros(VOCAB, dtype=torch.float64)
        new_prob_of = {}
        for prefix, row in zip(prefixes, probs):
            marginal += prob_of[prefix] * row
            for tok in range(VOCAB):
                new_prob_of[prefix + (tok,)] = prob_of[prefix] * row[tok].item()
        marginals.append(marginal)
        prob_of = new_prob_of
    return marginals


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability zero was generated"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def generate_counts(target, draft, temperature, top_k, topk, steps, n_draft, top_p=1.0, device="cpu",
                    max_running=SAMPLES, adaptive="on") -> list[torch.Tensor]:
    random.seed(1234)  # each request's sampling seed is drawn at admission
    with Engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, device=device,
                dtype="float32", speculative_adaptive=adaptive, speculative_eagle_topk=topk,
                speculative_num_steps=steps,
                speculative_num_draft_tokens=n_draft, max_running_requests=max_running,
                chunked_prefill_size=max_running * len(PROMPT), page_size=16,
                max_total_tokens=max_running * 16) as engine:
        params = SamplingParams(max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p,
                                ignore_eos=True)
        outs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        assert engine.runner.spec.stats.num_accepted_tokens > 0.1 * SAMPLES, "too few accepts to test anything"
    tokens = torch.tensor([o.token_ids for o in outs])  # [SAMPLES, NEW]
    return [torch.bincount(tokens[:, i], minlength=VOCAB).double() for i in range(NEW)]


CASES = [  # temperature, top_k, top_p, (topk, steps, num_draft_tokens)
    (1.0, -1, 1.0, (1, 2, 3)),
    (0.7, 5, 0.8, (2, 2, 4)),
]


@pytest.mark.parametrize("temperature,top_k,top_p,shape", CASES, ids=["T1-chain", "T0.7-topk5-topp0.8-tree"])
def test_speculative_sampling_matches_target(tiny_vocab_pair, temperature, top_k, top_p, shape):
    target, draft, hf = tiny_vocab_pair
    want = exact_marginals(hf, temperature, top_k, top_p)
    got = generate_counts(target, draft, temperature, top_k, *shape, top_p=top_p)
    for pos, (counts, probs) in enumerate(zip(got, want)):
        stat = chi_square(counts, probs)
        assert stat < CHI2_CRIT_DF7, f"position {pos}: chi2 {stat:.1f}, counts {counts.tolist()}, want {probs.tolist()}"


def _root_noise_for_every_node(seq_lens, depths):
    """A plausible bug: every node draws with the root's noise key (the depth left out), so an accepted
    draft's successor reuses the noise that already picked it."""
    return seq_lens[:, None] + 1 + 0 * depths


def test_wrong_noise_key_is_caught(tiny_vocab_pair, monkeypatch):
    target, draft, hf = tiny_vocab_pair
    monkeypatch.setattr(worker_module, "predicted_positions", _root_noise_for_every_node)
    temperature, top_k, _, shape = CASES[0]
    want = exact_marginals(hf, temperature, top_k)
    got = generate_counts(target, draft, temperature, top_k, *shape)
    worst = max(chi_square(c, p) for c, p in zip(got, want))
    assert worst > CHI2_CRIT_DF7, f"the biased rule went unnoticed (chi2 {worst:.1f})"


@pytest.mark.gpu
def test_speculative_sampling_matches_target_on_gpu(tiny_vocab_pair):
    """Temperature 1, top-p 0.9, top-k 5 (of 8 tokens), tree drafting, CUDA graphs: the fused kernel
    and the graphed iteration draw from the target's distribution. At a fixed depth: on a GPU this tiny
    pair's drafts do not pay, so the adaptive policy soon drafts nothing (and admits requests dormant),
    which leaves the verify rule untested (the CPU cases above run adaptive)."""
    target, draft, hf = tiny_vocab_pair
    want = exact_marginals(hf, 1.0, 5, 0.9)
    got = generate_counts(target, draft, 1.0, 5, 2, 2, 4, top_p=0.9, device="cuda", max_running=256, adaptive="off")
    for pos, (counts, probs) in enumerate(zip(got, want)):
        stat = chi_square(counts, probs)
        assert stat < CHI2_CRIT_DF7, f"position {pos}: chi2 {stat:.1f}, counts {counts.tolist()}, want {probs.tolist()}"

"""Speculative sampling is lossless: on a tiny-vocabulary target, the distribution of each generated
token under speculation equals the target's own distribution, computed exactly by enumerating every
prefix with Hugging Face transformers. A deliberately wrong acceptance rule fails the same test."""

import itertools
import json

import pytest
import torch

import tandem.speculative.worker as worker_module
from tandem import Engine, SamplingParams
from tandem.speculative import verify
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


def exact_marginals(hf, temperature: float, top_k: int) -> list[torch.Tensor]:
    """P(token at new position i) for i < NEW, by enumerating all prefixes (float64)."""
    def next_probs(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1].double()
        logits = logits / temperature
        if 0 < top_k < VOCAB:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.softmax(logits, dim=-1)

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


def generate_counts(target, draft, temperature, top_k, topk, steps, n_draft) -> list[torch.Tensor]:
    torch.manual_seed(1234)
    with Engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, device="cpu",
                speculative_eagle_topk=topk, speculative_num_steps=steps, speculative_num_draft_tokens=n_draft,
                max_running_requests=SAMPLES, chunked_prefill_size=SAMPLES * len(PROMPT), page_size=16,
                max_total_tokens=SAMPLES * 16) as engine:
        params = SamplingParams(max_new_tokens=NEW, temperature=temperature, top_k=top_k, ignore_eos=True)
        outs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        assert engine.runner.spec.stats.num_accepted_tokens > 0.1 * SAMPLES, "too few accepts to test anything"
    tokens = torch.tensor([o.token_ids for o in outs])  # [SAMPLES, NEW]
    return [torch.bincount(tokens[:, i], minlength=VOCAB).double() for i in range(NEW)]


CASES = [  # temperature, top_k, (topk, steps, num_draft_tokens)
    (1.0, -1, (1, 2, 3)),
    (0.7, 5, (2, 2, 4)),
]


@pytest.mark.parametrize("temperature,top_k,shape", CASES, ids=["T1-chain", "T0.7-topk5-tree"])
def test_speculative_sampling_matches_target(tiny_vocab_pair, temperature, top_k, shape):
    target, draft, hf = tiny_vocab_pair
    want = exact_marginals(hf, temperature, top_k)
    got = generate_counts(target, draft, temperature, top_k, *shape)
    for pos, (counts, probs) in enumerate(zip(got, want)):
        stat = chi_square(counts, probs)
        assert stat < CHI2_CRIT_DF7, f"position {pos}: chi2 {stat:.1f}, counts {counts.tolist()}, want {probs.tolist()}"


def _accept_without_residual(tree, target_probs, uniforms, bonus_noise):
    """The classic bug: after rejecting drafts, draw the bonus from the full target row instead of
    the residual, so rejected tokens are drawn twice as often as they should be."""
    result = verify.tree_rejection_sample(tree, target_probs, uniforms, bonus_noise)
    rows = torch.arange(tree.tokens.shape[0])
    last = result.path.gather(1, (result.accept_lens - 1)[:, None]).squeeze(1)
    bonus = (target_probs[rows, last] / bonus_noise).argmax(-1)
    result.out_tokens.scatter_(1, (result.accept_lens - 1)[:, None], bonus[:, None])
    return result


def test_wrong_acceptance_rule_is_caught(tiny_vocab_pair, monkeypatch):
    target, draft, hf = tiny_vocab_pair
    monkeypatch.setattr(worker_module, "tree_rejection_sample", _accept_without_residual)
    temperature, top_k, shape = CASES[0]
    want = exact_marginals(hf, temperature, top_k)
    got = generate_counts(target, draft, temperature, top_k, *shape)
    worst = max(chi_square(c, p) for c, p in zip(got, want))
    assert worst > CHI2_CRIT_DF7, f"the biased rule went unnoticed (chi2 {worst:.1f})"

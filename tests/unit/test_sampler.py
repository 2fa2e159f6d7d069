"""Sampler tests (layers/sampler.py, layers/sampling_noise.py).

Every function is checked against a slow reference written here: per-row Python loops over lists in
float64, never the sampler's own output. Statistical tests draw many independent tokens by giving each
draw its own position (the noise is keyed by seed and position only) and compare the frequencies with
the reference distribution by a Pearson chi-square at the 0.999 level; a negative control shows that
test rejects a 1% bias. All inputs are seeded, so every test is deterministic.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tandem.layers import sampling_noise
from tandem.layers.sampler import (
    SamplingFeatures,
    SamplingMetadata,
    apply_penalties,
    choose_tokens,
    filter_threshold,
    gumbel_race_reference,
    logits_to_probs,
    scaled_logits,
    token_logprobs,
)
from tandem.request import SamplingParams

P = SamplingParams


def metadata(params, positions=None, seeds=None, prompts=None, outputs=None, vocab=None) -> SamplingMetadata:
    """Rows at positions 0..R-1 unless given. With `vocab`, also the penalty state (output counts and
    prompt mask; empty histories unless given), which any step running the penalty stage needs."""
    n = len(params)
    positions = list(range(n)) if positions is None else positions
    if vocab is None:
        assert prompts is None and outputs is None
        return SamplingMetadata.from_params(params, positions, seeds=seeds)
    return SamplingMetadata.from_params(
        params, positions, seeds=seeds, vocab=vocab,
        prompts=prompts if prompts is not None else [[] for _ in range(n)],
        outputs=outputs if outputs is not None else [[] for _ in range(n)],
    )


def distinct_logits(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, vocab] logits without ties: each row a shuffled ramp with a random slope."""
    ramp = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(batch)]).float()  # values 0..V-1
    slope = 0.5 + 12.0 * torch.rand(batch, 1, generator=gen)
    return (ramp / vocab - 0.5) * slope


def tied_logits(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, vocab] logits from a few levels (multiples of 0.5), so most values are shared."""
    return torch.randint(-4, 5, (batch, vocab), generator=gen).float() * 0.5


def kept_by_threshold(scaled_row: torch.Tensor, threshold: float, support: set[int]) -> set[int]:
    """The tokens `filter_threshold` keeps, among those of nonzero probability (a -inf logit is "kept"
    by a -inf threshold, but has no probability either way)."""
    return {i for i in support if scaled_row[i].item() >= threshold}


# ---------------------------------------------------------------------------
# Slow references (float64, one row at a time)


def ref_softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) for v in x]
    s = sum(e)
    return [v / s for v in e]


def ref_order(p: list[float]) -> list[int]:
    return sorted(range(len(p)), key=lambda i: -p[i])


def ref_top_k_keep(p: list[float], k: int) -> set[int]:
    """Every token at least as likely as the k-th most likely one (ties at the cut all stay)."""
    if k <= 0 or k >= len(p):
        return set(range(len(p)))
    kth = sorted(p, reverse=True)[k - 1]
    return {i for i, x in enumerate(p) if x >= kth}


def ref_top_p_keep(p: list[float], top_p: float) -> tuple[set[int], float]:
    """Tokens whose strictly more likely tokens hold less than top_p of the mass (a tie group is kept or
    dropped whole); and how close a group's preceding mass came to top_p (what a rounding must beat)."""
    kept, before, margin = set(), 0.0, math.inf
    for value in sorted({x for x in p if x > 0.0}, reverse=True):
        group = [i for i, x in enumerate(p) if x == value]
        if before > 0.0:  # the first group's 0 is exact: it is always kept
            margin = min(margin, abs(before - top_p))
        if before >= top_p:
            break
        kept.update(group)
        before += value * len(group)
    return kept, margin


def ref_min_p_keep(p: list[float], min_p: float) -> tuple[set[int], float]:
    """Tokens with p >= min_p * max(p); and the smallest relative distance of a probability to that cut."""
    threshold = min_p * max(p)
    kept = {i for i, x in enumerate(p) if x >= threshold}
    if threshold == 0.0:
        return kept, math.inf
    return kept, min((abs(x - threshold) / threshold for x in p if x != threshold), default=math.inf)


def ref_penalize(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    x = list(logits)
    for t in set(prompt) | set(output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x


def ref_keep_renormalize(p: list[float], kept: set[int]) -> list[float]:
    total = sum(p[i] for i in kept)
    return [p[i] / total if i in kept else 0.0 for i in range(len(p))]


def ref_near_tie_margin(x: list[float]) -> float:
    """Smallest relative gap between two distinct values: float32 may merge (or float64 split) values
    closer than that, which moves a tie-inclusive cut."""
    values = sorted({v for v in x if math.isfinite(v)})
    gaps = [(b - a) / max(1.0, abs(a), abs(b)) for a, b in zip(values, values[1:])]
    return min(gaps, default=math.inf)


def ref_probs(logits: list[float], params: SamplingParams, prompt=(), output=()) -> tuple[list[float], float]:
    """The whole chain for one row; also the smallest margin met on the way (a near tie, or a top-p /
    min-p cut that a float32 rounding could move)."""
    x = ref_penalize(logits, params, list(prompt), list(output))
    margin = ref_near_tie_margin(x)
    if params.temperature == 0:
        best = max(range(len(x)), key=lambda i: x[i])
        return [1.0 if i == best else 0.0 for i in range(len(x))], margin
    p = ref_softmax([v / params.temperature for v in x])
    p = ref_keep_renormalize(p, ref_top_k_keep(p, params.top_k))
    if params.top_p < 1.0:
        kept, m = ref_top_p_keep(p, params.top_p)
        margin = min(margin, m)
        p = ref_keep_renormalize(p, kept)
    if params.min_p > 0.0:
        kept, m = ref_min_p_keep(p, params.min_p)
        margin = min(margin, m)
        p = ref_keep_renormalize(p, kept)
    return p, margin


def as_lists(t: torch.Tensor) -> list[list[float]]:
    return t.double().tolist()


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------------------
# Chi-square machinery

# 0.999 quantiles of chi-square (scipy.stats.chi2.ppf(0.999, dof)); Wilson-Hilferty beyond the table.
_CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
             9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697}


def chi2_999(dof: int) -> float:
    if dof in _CHI2_999:
        return _CHI2_999[dof]
    z, a = 3.0902, 2.0 / (9.0 * dof)  # z: the standard normal's 0.999 quantile
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square_counts(counts: torch.Tensor, target: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of observed counts against the distribution `target` over its support; and the
    degrees of freedom. Counts outside the support make the statistic infinite."""
    counts, target = counts.double().flatten(), target.double().flatten()
    support = target > 0
    if counts[~support].sum() > 0:
        return math.inf, int(support.sum()) - 1
    expected = counts.sum() * target[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def chi_square(tokens: torch.Tensor, target: torch.Tensor) -> tuple[float, int]:
    return chi_square_counts(torch.bincount(tokens, minlength=target.numel()), target)


def test_chi2_table_matches_wilson_hilferty():
    # The approximation used beyond the table (dof 99 here) is within 1% of the table's upper end, and
    # improves with the degrees of freedom.
    for dof, q in _CHI2_999.items():
        if dof < 8:
            continue
        z, a = 3.0902, 2.0 / (9.0 * dof)
        assert dof * (1.0 - a + z * math.sqrt(a)) ** 3 == pytest.approx(q, rel=0.01)


# ---------------------------------------------------------------------------
# Filters: the kept set of `filter_threshold` (scaled >= threshold), one stage at a time


def test_top_k_matches_reference():
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 50, 300
    logits = torch.cat([distinct_logits(batch // 2, vocab, gen), tied_logits(batch // 2, vocab, gen)])
    rng = random.Random(0)
    ks = [rng.choice([-1, 0, 1, 1, 2, 5, 17, vocab - 1, vocab, vocab + 7, 10_000]) for _ in range(batch)]
    meta = metadata([P(top_k=k) for k in ks])

    threshold = filter_threshold(logits, meta)

    assert threshold.shape == (batch,) and threshold.dtype == torch.float32
    for i, (p, k) in enumerate(zip(as_lists(torch.softmax(logits.double(), -1)), ks)):
        want = ref_top_k_keep(p, k)
        assert kept_by_threshold(logits[i], threshold[i].item(), set(range(vocab))) == want, (i, k)
        if 0 < k < vocab and i < batch // 2:
            assert len(want) == k  # without ties exactly k survive
    # The tied half really exercised ties at the cut.
    tied_rows = zip(as_lists(logits[batch // 2:]), ks[batch // 2:])
    assert sum(len(ref_top_k_keep(p, k)) > k > 0 for p, k in tied_rows) >= 20


def test_top_p_matches_reference():
    gen = torch.Generator().manual_seed(1)
    vocab, batch = 50, 300
    logits = torch.cat([distinct_logits(batch // 2, vocab, gen), tied_logits(batch // 2, vocab, gen)])
    logits[::3, :10] = -math.inf  # some rows already have zero-probability tokens (e.g. a masked vocab)
    probs = as_lists(torch.softmax(logits.double(), -1))
    rng = random.Random(1)
    top_ps, wants = [], []
    for p in probs:
        while True:
            top_p = rng.choice([1e-6, 1e-3, 1.0, 0.999, rng.uniform(0.01, 1.0)])
            want, margin = ref_top_p_keep(p, top_p)
            if top_p in (1e-6, 1e-3, 1.0) or margin > 1e-4:  # a float32 cumsum cannot move the cut
                break
        top_ps.append(top_p)
        wants.append(want if top_p < 1.0 else {i for i, x in enumerate(p) if x > 0})

    threshold = filter_threshold(logits, metadata([P(top_p=t) for t in top_ps]))

    for i, (p, want, top_p) in enumerate(zip(probs, wants, top_ps)):
        support = {j for j, x in enumerate(p) if x > 0}
        got = kept_by_threshold(logits[i], threshold[i].item(), support)
        assert got == want, (i, top_p)
        if top_p <= 1e-3:  # only the most likely value (with its ties) survives a tiny top_p
            assert got == {j for j, x in enumerate(p) if x == max(p)}


def test_top_p_applies_to_the_top_k_survivors():
    # p = (0.3, 0.2, 0.2, 0.2, 0.1), top_k=2: the tie at the 2nd value keeps 4 tokens, renormalised to
    # (0.333, 0.222, 0.222, 0.222). top_p=0.32 keeps the 0.2 group if measured on the full row
    # (0.3 < 0.32) but not on the renormalised survivors (0.333 >= 0.32), which is the documented rule.
    p = [0.3, 0.2, 0.2, 0.2, 0.1]
    logits = torch.tensor([[math.log(x) for x in p]])
    threshold = filter_threshold(logits, metadata([P(top_k=2, top_p=0.32)]))
    assert kept_by_threshold(logits[0], threshold.item(), set(range(5))) == {0}
    assert ref_top_p_keep(p, 0.32)[0] == {0, 1, 2, 3}  # what measuring on the full row would keep
    assert ref_top_p_keep(ref_keep_renormalize(p, ref_top_k_keep(p, 2)), 0.32)[0] == {0}


def test_top_p_one_keeps_every_token_despite_rounding():
    # One dominant token and a long tail: the float32 cumulative sum reaches 1 before the tail ends.
    logits = torch.full((1, 50_000), -12.0)
    logits[0, 7] = 10.0
    meta = metadata([P(top_p=1.0)])
    everything = set(range(50_000))
    assert kept_by_threshold(logits[0], filter_threshold(logits, meta).item(), everything) == everything
    want = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(logits_to_probs(logits, meta).double(), want, rtol=1e-5, atol=1e-12)


def test_min_p_matches_reference():
    gen = torch.Generator().manual_seed(2)
    vocab, batch = 50, 300
    logits = torch.cat([distinct_logits(batch // 2, vocab, gen), tied_logits(batch // 2, vocab, gen)])
    probs = as_lists(torch.softmax(logits.double(), -1))
    rng = random.Random(2)
    min_ps, wants = [], []
    for p in probs:
        while True:
            min_p = rng.choice([0.0, 1.0, rng.uniform(0.0, 1.0)])
            want, margin = ref_min_p_keep(p, min_p)
            if min_p in (0.0, 1.0) or margin > 1e-5:
                break
        min_ps.append(min_p)
        wants.append(want)

    threshold = filter_threshold(logits, metadata([P(min_p=m) for m in min_ps]))

    for i, (want, min_p) in enumerate(zip(wants, min_ps)):
        got = kept_by_threshold(logits[i], threshold[i].item(), set(range(vocab)))
        assert got == want, (i, min_p)
        if min_p == 0.0:
            assert len(got) == vocab
        if min_p == 1.0:  # the maximum and its ties
            assert got == {j for j in range(vocab) if logits[i, j] == logits[i].max()}


def test_ties_at_the_cut_are_kept_together():
    # Three tokens at logit 2, two at 1, two at 0, one at -1: the top group holds 0.74 of the mass.
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, -1.0, 1.0, 2.0, 0.0]])
    top, second = {1, 3, 6}, {2, 5}
    p = ref_softmax(logits[0].tolist())
    group_mass = 3 * p[1]
    cases = [
        (P(top_k=1), top),  # the k-th is tied with two others: all three stay
        (P(top_k=2), top),
        (P(top_k=4), top | second),  # the cut falls inside the pair at logit 1
        (P(top_p=0.01), top),  # the group's first member alone reaches top_p; its ties still stay
        (P(top_p=group_mass - 0.05), top),
        (P(top_p=group_mass + 0.05), top | second),  # the mass before the pair is < top_p: both stay
        (P(top_k=4, top_p=0.75), top),  # renormalised over the 5 survivors the top group holds 0.80
        (P(min_p=1.0), top),
        # At T=0.5 the pair is at e^-2 = 0.135 of the maximum: min-p 0.1 keeps it, 0.2 does not.
        (P(temperature=0.5, top_k=4, min_p=0.1), top | second),
        (P(temperature=0.5, top_k=4, min_p=0.2), top),
    ]
    for params, want in cases:
        ref, margin = ref_probs(logits[0].tolist(), params)
        assert margin > 1e-3
        assert {i for i, x in enumerate(ref) if x > 0} == want, params  # the reference follows the rule
        meta = metadata([params])
        scaled = scaled_logits(logits, meta)
        got = kept_by_threshold(scaled[0], filter_threshold(scaled, meta).item(), set(range(8)))
        assert got == want, params
        # The distribution gives each member of a group the same probability.
        torch.testing.assert_close(logits_to_probs(logits, meta)[0].double(), f64(ref), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# Penalties


def test_repetition_penalty_matches_transformers():
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    vocab, batch = 64, 40
    logits = torch.randn(batch, vocab, generator=gen) * 3
    logits[:, :4] = 0.0  # zero logits: HF divides, the sampler multiplies; both must give 0
    params, prompts, outputs = [], [], []
    for _ in range(batch):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        cut = rng.randrange(len(ids) + 1)
        params.append(P(repetition_penalty=rng.choice([0.5, 0.9, 1.0, 1.2, 2.0, rng.uniform(0.1, 3.0)])))
        prompts.append(ids[:cut])
        outputs.append(ids[cut:])
    before = logits.clone()

    out = apply_penalties(logits, metadata(params, prompts=prompts, outputs=outputs, vocab=vocab))

    assert torch.equal(logits, before)  # input untouched
    for i, sp in enumerate(params):
        ids = torch.tensor([prompts[i] + outputs[i]])
        hf = RepetitionPenaltyLogitsProcessor(penalty=sp.repetition_penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(out[i : i + 1], hf, rtol=0, atol=0)


def test_frequency_presence_and_repetition_match_reference():
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    vocab, batch = 64, 60
    logits = torch.randn(batch, vocab, generator=gen) * 3
    params, prompts, outputs = [], [], []
    for _ in range(batch):
        # Small id range so tokens repeat, within the output and between prompt and output.
        prompts.append([rng.randrange(20) for _ in range(rng.randrange(0, 15))])
        outputs.append([rng.randrange(20) for _ in range(rng.randrange(0, 15))])
        params.append(P(repetition_penalty=rng.choice([1.0, 1.0, 1.5, 0.7]),
                        frequency_penalty=rng.choice([0.0, 0.5, -0.3, 2.0]),
                        presence_penalty=rng.choice([0.0, 0.8, -1.0, -2.0])))

    out = apply_penalties(logits, metadata(params, prompts=prompts, outputs=outputs, vocab=vocab))

    for i, sp in enumerate(params):
        want = ref_penalize(logits[i].tolist(), sp, prompts[i], outputs[i])
        torch.testing.assert_close(out[i].double(), f64(want), rtol=1e-6, atol=1e-6)


def test_prompt_tokens_do_not_count_for_frequency_or_presence():
    logits = torch.zeros(1, 8)
    meta = metadata([P(frequency_penalty=1.0, presence_penalty=0.5)], prompts=[[1, 1, 2]], outputs=[[2, 3, 3]],
                    vocab=8)
    assert apply_penalties(logits, meta)[0].tolist() == [0.0, 0.0, -1.5, -2.5, 0.0, 0.0, 0.0, 0.0]


def test_neutral_penalties_are_a_no_op():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(15))
    meta = metadata([P()] * 3, prompts=[[1, 2]] * 3, outputs=[[3, 3]] * 3, vocab=10)
    assert torch.equal(apply_penalties(logits, meta), logits)


# ---------------------------------------------------------------------------
# The whole chain


def random_request(rng: random.Random, vocab: int) -> tuple[SamplingParams, list[int], list[int]]:
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
    params = P(
        temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([-1, 0, 1, 3, 10, vocab, 10_000]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.8, 0.5, 1e-6]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3, 1.0]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.5]),
        presence_penalty=rng.choice([0.0, 0.0, 0.7, -1.0]),
    )
    return params, prompt, output


def test_logits_to_probs_matches_reference_chain():
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    vocab, batch = 40, 400
    logits = torch.cat([torch.randn(batch // 2, vocab, generator=gen) * 2, tied_logits(batch // 2, vocab, gen)])
    requests = [random_request(rng, vocab) for _ in range(batch)]
    params, prompts, outputs = map(list, zip(*requests))
    meta = metadata(params, prompts=prompts, outputs=outputs, vocab=vocab)

    probs = logits_to_probs(logits, meta)

    assert probs.dtype == torch.float32 and probs.shape == (batch, vocab)
    torch.testing.assert_close(probs.sum(-1), torch.ones(batch))
    checked = 0
    for i, (sp, prompt, output) in enumerate(requests):
        want, margin = ref_probs(logits[i].tolist(), sp, prompt, output)
        if margin < 1e-4:  # a float32 rounding could legitimately move a cut here
            continue
        torch.testing.assert_close(probs[i].double(), f64(want), rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"row {i} {sp}: {m}")
        checked += 1
    assert checked >= batch - 15, checked


def test_logits_to_probs_each_parameter_alone():
    # One stage at a time, so a parameter mix-up between stages cannot hide behind another.
    gen = torch.Generator().manual_seed(6)
    vocab = 30
    params = [
        P(),
        P(temperature=0.5),
        P(temperature=2.0),
        P(top_k=4),
        P(top_p=0.6),
        P(min_p=0.4),
        P(temperature=0.0, top_k=4),
        P(repetition_penalty=1.7),
        P(frequency_penalty=0.9),
        P(presence_penalty=-1.5),
    ]
    logits = torch.randn(len(params), vocab, generator=gen)
    prompts = [[0, 1, 2]] * len(params)
    outputs = [[2, 3, 3, 4]] * len(params)
    probs = logits_to_probs(logits, metadata(params, prompts=prompts, outputs=outputs, vocab=vocab))
    for i, sp in enumerate(params):
        want, _ = ref_probs(logits[i].tolist(), sp, prompts[i], outputs[i])
        torch.testing.assert_close(probs[i].double(), f64(want), rtol=1e-4, atol=1e-6, msg=lambda m: f"{sp}: {m}")


def test_scaled_logits_divide_by_temperature():
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(16))
    temps = [0.0, 0.25, 1.0, 3.0]
    out = scaled_logits(logits, metadata([P(temperature=t) for t in temps]))
    for i, t in enumerate(temps):
        want = [x / (t or 1.0) for x in logits[i].tolist()]  # greedy rows are left as they are
        torch.testing.assert_close(out[i].double(), f64(want), rtol=1e-6, atol=0)


def test_features_of_params():
    assert SamplingFeatures.of([P(temperature=0.0)]) == SamplingFeatures()
    # top-k on a greedy row needs no sort; penalties on one do need the penalty stage.
    feats = SamplingFeatures.of([P(temperature=0.0, top_k=3, repetition_penalty=1.2), P()])
    assert feats == SamplingFeatures(sampled=True, top_k=False, penalties=True)
    assert SamplingFeatures.of([P(temperature=0.0), P(top_k=5)]).top_k
    for filt in (dict(top_p=0.9), dict(min_p=0.1)):  # applied by the race itself: no extra stage
        assert SamplingFeatures.of([P(temperature=0.0), P(**filt)]) == SamplingFeatures(sampled=True), filt
    for pen in (dict(repetition_penalty=0.9), dict(frequency_penalty=0.1), dict(presence_penalty=-0.1)):
        assert SamplingFeatures.of([P(), P(**pen)]).penalties, pen
    assert SamplingFeatures.of([P(logprobs=2), P(logprobs=0), P()]).logprobs == 2
    assert SamplingFeatures.of([P(), P()]).logprobs is None


# ---------------------------------------------------------------------------
# Drawing tokens: frequencies


STAT_LOGITS = torch.tensor([0.5, 0.35, 0.2, 0.1, 0.0, -0.15, -0.6, -2.0])
STAT_PARAMS = P(temperature=0.9, top_k=7, top_p=0.97, min_p=0.3)
NUM_DRAWS = 50_000


def draw_at_positions(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int, start: int = 0
                      ) -> torch.Tensor:
    """n tokens of one request, each at its own position start..start+n-1: n independent draws."""
    meta = metadata([params] * n, positions=list(range(start, start + n)), seeds=[seed] * n,
                    vocab=logits_row.numel())
    return choose_tokens(logits_row.expand(n, -1), meta, SamplingFeatures.of([params]))


def test_sampling_matches_target_distribution():
    want, margin = ref_probs(STAT_LOGITS.tolist(), STAT_PARAMS)
    assert margin > 1e-3
    target = f64(want)
    assert 5 <= int((target > 0).sum()) < 8  # the filters really removed tokens
    torch.testing.assert_close(logits_to_probs(STAT_LOGITS[None], metadata([STAT_PARAMS]))[0].double(), target,
                               rtol=1e-4, atol=1e-6)

    tokens = draw_at_positions(STAT_LOGITS, STAT_PARAMS, NUM_DRAWS, seed=7)

    assert tokens.dtype == torch.int64 and tokens.shape == (NUM_DRAWS,)
    assert set(tokens.tolist()) == set(torch.nonzero(target).flatten().tolist())
    stat, dof = chi_square(tokens, target)
    assert stat < chi2_999(dof), (stat, dof)


def test_chi_square_flags_a_one_percent_bias():
    # Negative control: draw from a distribution with 1% of the mass moved between the two most likely
    # tokens (the hardest place to see it) and check the statistic above rejects it.
    target = f64(ref_probs(STAT_LOGITS.tolist(), STAT_PARAMS)[0])
    biased = target.clone()
    first, second = target.argsort(descending=True)[:2].tolist()
    biased[first] -= 0.01
    biased[second] += 0.01

    tokens = draw_at_positions(biased.log().float(), P(), NUM_DRAWS, seed=8)

    stat, dof = chi_square(tokens, target)
    assert stat > chi2_999(dof), (stat, dof)
    # ... while the same draws pass against the distribution they really came from.
    stat_true, dof_true = chi_square(tokens, biased)
    assert stat_true < chi2_999(dof_true), (stat_true, dof_true)


def test_gumbel_race_reference_matches_softmax_of_kept_tokens():
    # The race alone: argmax of (logit * inv_t + noise) over logit * inv_t >= threshold.
    logits = torch.tensor([1.2, -0.3, 0.4, 0.9, -1.5, 0.0, 0.7, -0.8, 0.25, 2.0])
    inv_t = 1.0 / 0.7
    scaled = [x * inv_t for x in logits.tolist()]
    threshold = 0.1 * inv_t  # keeps the 6 tokens with logit >= 0.25
    kept = [s >= threshold for s in scaled]
    assert sum(kept) == 6
    m = max(scaled)
    w = [math.exp(s - m) if k else 0.0 for s, k in zip(scaled, kept)]
    target = f64([x / sum(w) for x in w])
    n = 40_000

    tokens = gumbel_race_reference(logits.expand(n, -1), torch.full((n,), inv_t), torch.full((n,), threshold),
                                   torch.full((n,), 99, dtype=torch.int64), torch.arange(n))

    stat, dof = chi_square(tokens, target)
    assert stat < chi2_999(dof), (stat, dof)
    # Without the temperature the frequencies are measurably different (the test sees inv_t).
    w1 = [math.exp(s / inv_t - m / inv_t) if k else 0.0 for s, k in zip(scaled, kept)]
    stat1, _ = chi_square(tokens, f64([x / sum(w1) for x in w1]))
    assert stat1 > chi2_999(dof), stat1


def test_zero_probability_tokens_are_never_sampled():
    gen = torch.Generator().manual_seed(9)
    vocab, draws = 12, 5_000
    logits = torch.randn(vocab, generator=gen) * 0.5  # flat-ish: the cut-off tokens would be drawn often
    for params in (P(top_k=2), P(top_p=0.3), P(min_p=0.9), P(top_k=3, top_p=0.5, min_p=0.5),
                   P(temperature=0.4, top_k=6, min_p=0.2)):
        probs, margin = ref_probs(logits.tolist(), params)
        assert margin > 1e-4
        support = {i for i, x in enumerate(probs) if x > 0}
        assert len(support) < vocab, params
        tokens = draw_at_positions(logits, params, draws, seed=11)
        assert set(tokens.tolist()) == support, params  # nothing outside it, and every kept token drawn


def test_masked_tokens_are_never_sampled():
    # -inf logits (a masked or padded vocabulary) must never win, filtered or not.
    vocab, draws = 64, 4_000
    logits = torch.zeros(vocab)
    logits[vocab // 2:] = -math.inf
    for params in (P(), P(top_p=0.999), P(temperature=1.7)):
        tokens = draw_at_positions(logits, params, draws, seed=12)
        assert tokens.max().item() < vocab // 2, params


def test_a_dominant_token_is_always_drawn_at_a_large_vocabulary():
    # Every other token has probability < 1e-8 in all: over 16 draws none should ever win. At seed 0,
    # positions 70..85 include 78, where the current hash puts one token's 24-bit uniform in the top
    # bucket (2^24 - 1), which must still give finite noise. 150k is a typical vocabulary size.
    vocab = 150_000
    logits = torch.zeros(vocab)
    logits[4242] = 30.0
    assert draw_at_positions(logits, P(), 16, seed=0, start=70).tolist() == [4242] * 16
    # Masking every token but a few (-inf logits) must hold at every key too.
    masked = torch.full((vocab,), -math.inf)
    masked[:3] = 0.0
    assert draw_at_positions(masked, P(), 16, seed=0, start=70).max().item() < 3


def test_greedy_with_penalties_is_argmax_of_penalized_logits():
    gen = torch.Generator().manual_seed(13)
    rng = random.Random(13)
    vocab, batch = 32, 64
    logits = torch.randn(batch, vocab, generator=gen) * 2
    params, prompts, outputs = [], [], []
    for i in range(batch):
        top = logits[i].argmax().item()
        outputs.append([top] * rng.randrange(0, 3) + [rng.randrange(vocab) for _ in range(3)])
        prompts.append([rng.randrange(vocab) for _ in range(4)])
        params.append(P(temperature=0.0, top_k=rng.choice([-1, 2]), repetition_penalty=rng.choice([1.0, 1.5, 3.0]),
                        frequency_penalty=rng.choice([0.0, 1.0]), presence_penalty=rng.choice([0.0, 2.0])))
    want = []
    for i, sp in enumerate(params):
        x = ref_penalize(logits[i].tolist(), sp, prompts[i], outputs[i])
        want.append(max(range(vocab), key=lambda j: x[j]))
    assert sum(w != logits[i].argmax().item() for i, w in enumerate(want)) >= 10  # penalties matter here

    # All-greedy batch (greedy features) ...
    meta = metadata(params, prompts=prompts, outputs=outputs, vocab=vocab)
    features = SamplingFeatures.of(params)
    assert not features.sampled and features.penalties
    assert choose_tokens(logits, meta, features).tolist() == want
    # ... and the same rows mixed with sampled, filtered rows (the sampled path).
    mixed = [r for pair in zip(params, [P(top_k=3)] * batch) for r in pair]
    mixed_meta = metadata(mixed, prompts=[p for p in prompts for _ in (0, 1)],
                          outputs=[o for o in outputs for _ in (0, 1)], vocab=vocab)
    mixed_features = SamplingFeatures.of(mixed)
    assert mixed_features.sampled and mixed_features.top_k and mixed_features.penalties
    assert choose_tokens(logits.repeat_interleave(2, dim=0), mixed_meta, mixed_features)[::2].tolist() == want


# ---------------------------------------------------------------------------
# Drawing tokens: the noise key (seed, position)


def test_seeded_row_ignores_batch_companions():
    gen = torch.Generator().manual_seed(10)
    vocab = 1000
    row_logits = torch.randn(vocab, generator=gen) * 0.1  # nearly uniform: any leak changes the token
    # Neutral penalties but a history: the token must not depend on whether the batch runs penalties.
    target = (P(seed=1234, top_p=0.99), [1, 2], [5, 6, 7], 17)  # params, prompt, output, position

    def run(companions, index: int, row=target) -> int:
        rows = companions[:index] + [row] + companions[index:]
        params, prompts, outputs, positions = map(list, zip(*rows))
        logits = torch.randn(len(rows), vocab, generator=gen)
        logits[index] = row_logits
        meta = metadata(params, positions=positions, prompts=prompts, outputs=outputs, vocab=vocab)
        return choose_tokens(logits, meta, SamplingFeatures.of(params))[index].item()

    others = [
        (P(), [], [], 17),
        (P(seed=99), [], [5, 6, 7], 17),  # other seed, same position
        (P(temperature=0.0, repetition_penalty=1.3), [], [1], 3),
        (P(seed=1234), [1, 2], [5, 6], 16),  # same seed, other position
        (P(top_k=5, logprobs=3), [], [], 40),
        (P(seed=7, frequency_penalty=0.5), [9], [9, 9], 17),
    ]
    alone = run([], 0)
    results = [run(others[:2], 1), run(others[2:5], 3), run(others, 5), run(others, 0),
               run([(P(), [], [], k) for k in range(40)], 17)]
    assert results == [alone] * len(results)
    # Its own seed and position are what it depends on: moving either changes the token (on 1000
    # near-uniform tokens a repeat has probability ~1e-3 each).
    assert run([], 0, (P(seed=1235, top_p=0.99), [1, 2], [5, 6, 7], 17)) != alone
    assert run([], 0, (P(seed=1234, top_p=0.99), [1, 2], [5, 6, 7], 18)) != alone


def test_seeded_generation_is_reproducible_across_recompute():
    # Generate 20 tokens twice in different batches, as a request would before and after preemption.
    gen = torch.Generator().manual_seed(11)
    vocab, prompt = 500, [3, 4]
    step_logits = [torch.randn(vocab, generator=gen) * 0.2 for _ in range(20)]
    sp = P(seed=42, temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5)  # the history matters

    def generate(batch_size: int, index: int, noise_seed: int) -> list[int]:
        noise = torch.Generator().manual_seed(noise_seed)
        output: list[int] = []
        for logits_row in step_logits:
            params = [P(seed=s, top_k=7) for s in range(batch_size)]
            params[index] = sp
            prompts = [[1]] * batch_size
            prompts[index] = prompt
            outputs = [[2] * s for s in range(batch_size)]
            outputs[index] = output
            positions = [len(pr) + len(o) for pr, o in zip(prompts, outputs)]
            logits = torch.randn(batch_size, vocab, generator=noise)  # companions' logits
            logits[index] = logits_row
            meta = metadata(params, positions=positions, prompts=prompts, outputs=outputs, vocab=vocab)
            output = output + [choose_tokens(logits, meta, SamplingFeatures.of(params))[index].item()]
        return output

    first = generate(1, 0, 0)
    assert len(set(first)) >= 15  # a real sequence of draws, not a stuck one
    assert generate(5, 3, 1) == first
    assert generate(9, 8, 2) == first


def test_positions_and_seeds_give_fresh_draws():
    vocab, steps = 1000, 50
    logits = torch.zeros(vocab)  # uniform
    by_position = draw_at_positions(logits, P(), steps, seed=5).tolist()
    meta = metadata([P()] * steps, positions=[3] * steps, seeds=list(range(steps)), vocab=vocab)
    by_seed = choose_tokens(logits.expand(steps, -1), meta, SamplingFeatures.of([P()])).tolist()
    # 50 uniform draws from 1000 tokens repeat about once; a stuck stream gives 1 distinct value.
    for draws in (by_position, by_seed):
        assert len(set(draws)) >= 40, draws
    # One row at a time gives the same tokens as the batch: the key is (seed, position), not the row.
    assert [draw_at_positions(logits, P(), 1, seed=5, start=t).item() for t in (0, 17, 49)] == \
        [by_position[0], by_position[17], by_position[49]]
    # Large (63-bit) and negative seeds are keys like any other.
    big = [draw_at_positions(logits, P(), 1, seed=s).item() for s in (2**62 + 5, 2**62 + 5 + 2**32, -5)]
    assert len(set(big)) == 3


def contingency(first: torch.Tensor, second: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(first * vocab + second, minlength=vocab * vocab)


def test_draws_at_neighbouring_keys_are_independent():
    # On 4 equally likely tokens the pair (draw at key A, draw at key B) must be uniform over the 16
    # pairs: a correlation between neighbouring positions or seeds (a weak hash) shows as a chi-square.
    vocab, n = 4, 40_000
    logits = torch.zeros(vocab)
    a = draw_at_positions(logits, P(), n + 1, seed=3)
    b = draw_at_positions(logits, P(), n, seed=4)
    c = draw_at_positions(logits, P(), n, seed=3 + 2**32)  # differs only in the seed's high word
    uniform_pairs = torch.full((vocab * vocab,), 1.0 / vocab**2, dtype=torch.float64)
    for name, first, second in (("position t, t+1", a[:-1], a[1:]), ("seed 3, 4", a[:-1], b),
                                ("seed 3, 3 + 2^32", a[:-1], c)):
        stat, dof = chi_square_counts(contingency(first, second, vocab), uniform_pairs)
        assert stat < chi2_999(dof), (name, stat)
        agree = (first == second).double().mean().item()  # 1/4 by chance; near 1 if the keys collide
        assert abs(agree - 0.25) < 0.015, (name, agree)


def test_contingency_flags_correlated_draws():
    # Negative control for the test above: the second draw copies the first 3% of the time.
    vocab, n = 4, 40_000
    logits = torch.zeros(vocab)
    a = draw_at_positions(logits, P(), n, seed=3)
    b = draw_at_positions(logits, P(), n, seed=4)
    copy = torch.rand(n, generator=torch.Generator().manual_seed(17)) < 0.03
    b = torch.where(copy, a, b)
    stat, dof = chi_square_counts(contingency(a, b, vocab), torch.full((16,), 1 / 16, dtype=torch.float64))
    assert stat > chi2_999(dof), stat


# ---------------------------------------------------------------------------
# The noise itself


def test_gumbel_noise_has_the_gumbel_distribution():
    rows, vocab = 200, 1000  # 200k values
    seeds = torch.cat([torch.full((100,), 21), torch.full((100,), -8)]).long()
    g = sampling_noise.gumbel_noise(seeds, torch.arange(rows) * 7, vocab)
    assert g.shape == (rows, vocab) and g.dtype == torch.float32
    assert torch.isfinite(g).all()
    x = g.double().flatten()
    n = x.numel()
    euler_gamma, var = 0.5772156649, math.pi**2 / 6
    assert abs(x.mean().item() - euler_gamma) < 5 * math.sqrt(var / n)
    # Var of the sample variance: sigma^4 (2 / (n - 1) + kurtosis_excess / n), Gumbel's excess is 2.4.
    assert abs(x.var().item() - var) < 5 * var * math.sqrt(2.0 / n + 2.4 / n)
    # Kolmogorov-Smirnov against F(g) = exp(-exp(-g)); 1.95 / sqrt(n) is the 0.001 level.
    cdf = torch.exp(-torch.exp(-x.sort().values))
    grid = torch.arange(n + 1, dtype=torch.float64) / n
    ks = max((grid[1:] - cdf).abs().max().item(), (cdf - grid[:-1]).abs().max().item())
    assert ks < 1.95 / math.sqrt(n), ks
    # Chi-square of the underlying uniforms in 100 equal bins (finer than KS in the tails).
    u = torch.exp(-torch.exp(-x))
    counts = torch.bincount((u * 100).long().clamp(max=99), minlength=100)
    stat, dof = chi_square_counts(counts, torch.full((100,), 0.01, dtype=torch.float64))
    assert stat < chi2_999(dof), stat
    # The tails: P(g > 5) = 1 - exp(-exp(-5)) ~ 0.0067, P(g < -1.5) = exp(-exp(1.5)) ~ 0.0113.
    for observed, p in (((x > 5).double().mean(), 1 - math.exp(-math.exp(-5))), ((x < -1.5).double().mean(),
                        math.exp(-math.exp(1.5)))):
        assert abs(observed.item() - p) < 5 * math.sqrt(p / n), (observed.item(), p)


def test_gumbel_noise_is_uncorrelated_across_tokens_positions_and_seeds():
    rows, vocab = 400, 500
    seeds = torch.full((rows,), 5, dtype=torch.int64)
    g = sampling_noise.gumbel_noise(seeds, torch.arange(rows), vocab).double()
    g2 = sampling_noise.gumbel_noise(seeds + 1, torch.arange(rows), vocab).double()

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return ((a * b).sum() / (a.norm() * b.norm())).item()

    for name, a, b in (("token t, t+1", g[:, :-1], g[:, 1:]), ("position t, t+1", g[:-1], g[1:]),
                       ("seed 5, 6", g, g2)):
        assert abs(corr(a, b)) < 5 / math.sqrt(a.numel()), name
    # Each token's noise over positions and each position's noise over tokens are both Gumbel: no
    # token gets a systematic advantage (per-token means over 400 positions).
    per_token = g.mean(0)
    sd = math.sqrt(math.pi**2 / 6 / rows)
    assert ((per_token - 0.5772156649).abs() < 5 * sd).all()


def test_noise_depends_only_on_seed_position_and_token():
    seeds = torch.tensor([5, 5, 6, 5])
    positions = torch.tensor([9, 10, 9, 9])
    g = sampling_noise.gumbel_noise(seeds, positions, 300)
    assert torch.equal(g[0], g[3])  # same key, different row
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    # A longer vocabulary extends the row: token i's noise does not depend on the row's width.
    assert torch.equal(sampling_noise.gumbel_noise(seeds, positions, 1000)[:, :300], g)


def test_uniforms_are_strictly_inside_the_unit_interval():
    # The docstring's contract: the top 24 bits map into (0, 1), so the Gumbel noise is always finite.
    # The extreme hashes: each end bucket and its neighbours.
    h = torch.tensor([0, 0xFF, 0x100, 0x7FFFFFFF, 0x80000000, 0xFFFFFDFF, 0xFFFFFE00, 0xFFFFFEFF,
                      0xFFFFFF00, 0xFFFFFFFF], dtype=torch.int64)
    u = sampling_noise.uniform_from_hash(h)
    assert ((u > 0) & (u < 1)).all(), u.tolist()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


# ---------------------------------------------------------------------------
# Logprobs


def test_logprobs_are_of_raw_logits():
    gen = torch.Generator().manual_seed(14)
    vocab = 50
    logits = torch.randn(5, vocab, generator=gen) * 2
    params = [
        P(),
        P(temperature=0.5),
        P(repetition_penalty=2.0),
        P(temperature=0.0, frequency_penalty=1.0),
        P(top_k=4, seed=3),
    ]
    prompts = [[], [], [3, 4, 5], [], []]
    outputs = [[], [1, 2], [], [int(logits[3].argmax())], []]
    before = logits.clone()
    meta = metadata(params, prompts=prompts, outputs=outputs, vocab=vocab)
    token_ids = choose_tokens(logits, meta, SamplingFeatures.of(params))
    assert torch.equal(logits, before)  # sampling never writes the logits the logprobs are taken from

    chosen, top_v, top_i = token_logprobs(logits, token_ids, 5)

    assert chosen.dtype == torch.float32 and chosen.shape == (5,)
    assert top_v.dtype == torch.float32 and top_v.shape == (5, 5)
    assert top_i.dtype == torch.int64 and top_i.shape == (5, 5)
    ref = torch.log_softmax(logits.double(), dim=-1)  # the raw logits: no penalty, temperature or filter
    for i in range(5):
        raw = ref[i].tolist()
        assert chosen[i].item() == pytest.approx(raw[token_ids[i].item()], abs=1e-5)
        order = ref_order(raw)[:5]
        assert top_i[i].tolist() == order
        assert top_v[i].tolist() == pytest.approx([raw[j] for j in order], abs=1e-5)
    # Row 3 is greedy on penalized logits: its token is not the raw argmax, and its logprob is the raw one.
    assert token_ids[3].item() != logits[3].argmax().item()
    assert chosen[3].item() < top_v[3, 0].item()


def test_logprobs_top_n_is_clamped_to_the_vocabulary():
    logits = torch.randn(2, 3, generator=torch.Generator().manual_seed(18))
    chosen, top_v, top_i = token_logprobs(logits, torch.tensor([2, 0]), 20)
    assert top_i.shape == (2, 3)
    ref = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(chosen.double(), ref[[0, 1], [2, 0]], rtol=0, atol=1e-6)
    assert sorted(top_i[0].tolist()) == [0, 1, 2]


def test_unfiltered_and_min_p_rows_draw_as_the_sorted_threshold_does():
    """On a CPU a batch without top-k or top-p skips the sort (min-p needs only the maximum): the same
    tokens as the race over the sorted threshold, which the tests above check against references.
    Masked (-inf) entries, greedy rows and a min-p of 1 ride along."""
    from tandem.layers.sampler import SAMPLED, inverse_temperature

    gen = torch.Generator().manual_seed(9)
    vocab, batch = 64, 240
    logits = torch.cat([distinct_logits(batch // 2, vocab, gen), tied_logits(batch // 2, vocab, gen)])
    logits[torch.rand(batch, vocab, generator=gen) < 0.2] = float("-inf")
    logits[:, 0] = 0.0  # every row keeps a finite token
    rng = random.Random(9)
    params = [P(temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), min_p=rng.choice([0.0, 0.0, 0.05, 0.3, 1.0]), seed=i)
              for i in range(batch)]
    meta = metadata(params, positions=[rng.randrange(1000) for _ in range(batch)])
    inv_t = inverse_temperature(meta)
    want = gumbel_race_reference(logits, inv_t, filter_threshold(logits * inv_t[:, None], meta), meta.seed,
                                 meta.position, (meta.temperature > 0).float())
    got = choose_tokens(logits, meta, SAMPLED)
    assert torch.equal(got, want)
    assert bool((meta.min_p > 0).any()) and bool((meta.min_p == 0).any())


def test_top_k_threshold_by_selection_and_by_sort():
    """The k-th largest value of each row: from a selection of the 1024 largest (k <= 1024) or a sort
    (`large`), against Python's sorted lists; rows without top-k get -inf; features mark large k."""
    from tandem.layers.sampler import MAX_SELECTED_TOP_K, top_k_threshold

    gen = torch.Generator().manual_seed(11)
    vocab = 6000
    small, large = [1, 7, 40, MAX_SELECTED_TOP_K, 0], [MAX_SELECTED_TOP_K + 1, 5000, vocab, 3]
    for ks, is_large in ((small, False), (large, True)):
        scaled = torch.cat([distinct_logits(len(ks) - 1, vocab, gen), tied_logits(1, vocab, gen)])
        got = top_k_threshold(scaled, metadata([P(temperature=1.0, top_k=k) for k in ks]), large=is_large)
        for i, k in enumerate(ks):
            want = sorted(scaled[i].tolist(), reverse=True)[k - 1] if k > 0 else float("-inf")
            assert got[i].item() == want, (k, is_large)
    assert SamplingFeatures.of([P(temperature=1.0, top_k=MAX_SELECTED_TOP_K + 1)]).large_top_k
    assert not SamplingFeatures.of([P(temperature=1.0, top_k=MAX_SELECTED_TOP_K)]).large_top_k

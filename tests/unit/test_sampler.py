"""Sampler tests. Every function is checked against a slow reference written here:
per-row Python loops over sorted lists in float64, never the sampler's own output."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tandem.layers.sampler import (
    SampleRow,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    logits_to_probs,
    sample,
)
from tandem.request import SamplingParams


def make_row(prompt=(), output=(), **params) -> SampleRow:
    return SampleRow(SamplingParams(**params), list(prompt), list(output))


def distinct_logits(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, vocab] logits without ties: each row a shuffled ramp with a random slope."""
    ramp = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(batch)]).float()  # values 0..V-1
    slope = 0.5 + 12.0 * torch.rand(batch, 1, generator=gen)
    return (ramp / vocab - 0.5) * slope


# ---------------------------------------------------------------------------
# Slow references (float64, one row at a time)


def ref_order(p: list[float]) -> list[int]:
    return sorted(range(len(p)), key=lambda i: -p[i])


def ref_top_k_keep(p: list[float], k: int) -> set[int]:
    if k <= 0:
        k = len(p)
    return set(ref_order(p)[:k])


def ref_top_p_keep(p: list[float], top_p: float) -> tuple[set[int], float]:
    """Kept tokens, and how close the cut came to top_p (the distance a rounding error must beat)."""
    kept, total, margin = set(), 0.0, math.inf
    for i in ref_order(p):
        if p[i] == 0.0:
            break
        kept.add(i)
        total += p[i]
        margin = min(margin, abs(total - top_p))
        if total >= top_p:
            break
    return kept, margin


def ref_min_p_keep(p: list[float], min_p: float) -> tuple[set[int], float]:
    threshold = min_p * max(p)
    kept = {i for i, x in enumerate(p) if x >= threshold}
    margin = min((abs(x - threshold) for x in p if x != threshold), default=math.inf)
    return kept, margin


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


def ref_probs(logits: list[float], row: SampleRow) -> tuple[list[float], float]:
    """The whole chain for one row; also the smallest top-p / min-p margin met on the way."""
    params = row.params
    x = ref_penalize(logits, params, list(row.prompt_token_ids), list(row.output_token_ids))
    if params.temperature == 0:
        best = max(range(len(x)), key=lambda i: x[i])
        return [1.0 if i == best else 0.0 for i in range(len(x))], math.inf
    m = max(x)
    e = [math.exp((v - m) / params.temperature) for v in x]
    p = [v / sum(e) for v in e]
    p = ref_keep_renormalize(p, ref_top_k_keep(p, params.top_k))
    margin = math.inf
    if params.top_p < 1.0:
        kept, margin = ref_top_p_keep(p, params.top_p)
        p = ref_keep_renormalize(p, kept)
    if params.min_p > 0.0:
        kept, m2 = ref_min_p_keep(p, params.min_p)
        margin = min(margin, m2)
        p = ref_keep_renormalize(p, kept)
    return p, margin


def as_lists(t: torch.Tensor) -> list[list[float]]:
    return t.double().tolist()


# ---------------------------------------------------------------------------
# Filters


def test_top_k_matches_reference():
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 50, 300
    logits = distinct_logits(batch, vocab, gen)
    probs = torch.softmax(logits, dim=-1)
    rng = random.Random(0)
    ks = [rng.choice([-1, 0, 1, 1, 2, 5, 17, vocab - 1, vocab, vocab + 7, 10_000]) for _ in range(batch)]

    out = apply_top_k(probs, torch.tensor(ks))

    for i, (p, k) in enumerate(zip(as_lists(probs), ks)):
        want = ref_top_k_keep(p, k)
        got = set(torch.nonzero(out[i]).flatten().tolist())
        assert got == want, (i, k)
        assert torch.equal(out[i][list(want)], probs[i][list(want)])  # kept values untouched, not renormalized


def test_top_p_matches_reference():
    gen = torch.Generator().manual_seed(1)
    vocab, batch = 50, 300
    logits = distinct_logits(batch, vocab, gen)
    logits[::3, :10] = -math.inf  # some rows already have zeros (e.g. after top-k)
    probs = torch.softmax(logits, dim=-1)
    rng = random.Random(1)
    top_ps, wants = [], []
    for p in as_lists(probs):
        while True:
            top_p = rng.choice([1e-6, 1e-3, 1.0, 0.999, rng.uniform(0.01, 1.0)])
            want, margin = ref_top_p_keep(p, top_p)
            if top_p in (1e-6, 1e-3, 1.0) or margin > 1e-4:  # float32 cumsum cannot flip the cut
                break
        top_ps.append(top_p)
        wants.append(want if top_p < 1.0 else {i for i, x in enumerate(p) if x > 0})

    out = apply_top_p(probs, torch.tensor(top_ps))

    for i, (want, top_p) in enumerate(zip(wants, top_ps)):
        got = set(torch.nonzero(out[i]).flatten().tolist())
        assert got == want, (i, top_p)
        assert torch.equal(out[i][list(want)], probs[i][list(want)])
        if top_p <= 1e-3:
            assert len(got) == 1  # only the top-1 survives a tiny top_p


def test_top_p_one_keeps_every_token_despite_rounding():
    # One dominant token and a long tail: the float32 cumulative sum reaches 1 before the tail ends.
    logits = torch.full((1, 50_000), -12.0)
    logits[0, 7] = 10.0
    probs = torch.softmax(logits, dim=-1)
    out = apply_top_p(probs, torch.tensor([1.0]))
    assert torch.equal(out, probs)


def test_min_p_matches_reference():
    gen = torch.Generator().manual_seed(2)
    vocab, batch = 50, 300
    probs = torch.softmax(distinct_logits(batch, vocab, gen), dim=-1)
    rng = random.Random(2)
    min_ps, wants = [], []
    for p in as_lists(probs):
        while True:
            min_p = rng.choice([0.0, 1.0, rng.uniform(0.0, 1.0)])
            want, margin = ref_min_p_keep(p, min_p)
            if min_p in (0.0, 1.0) or margin > 1e-6:
                break
        min_ps.append(min_p)
        wants.append(want)

    out = apply_min_p(probs, torch.tensor(min_ps))

    for i, (want, min_p) in enumerate(zip(wants, min_ps)):
        got = set(torch.nonzero(out[i]).flatten().tolist())
        assert got == want, (i, min_p)
        if min_p == 1.0:
            assert len(got) == 1
        if min_p == 0.0:
            assert len(got) == vocab


# ---------------------------------------------------------------------------
# Penalties


def test_repetition_penalty_matches_transformers():
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    vocab, batch = 64, 40
    logits = torch.randn(batch, vocab, generator=gen) * 3
    logits[:, :4] = 0.0  # zero logits: HF divides, we multiply; both must give 0
    rows = []
    for _ in range(batch):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        cut = rng.randrange(len(ids) + 1)
        penalty = rng.choice([0.5, 0.9, 1.0, 1.2, 2.0, rng.uniform(0.1, 3.0)])
        rows.append(make_row(ids[:cut], ids[cut:], repetition_penalty=penalty))
    before = logits.clone()

    out = apply_penalties(logits, rows)

    assert torch.equal(logits, before)  # input untouched
    for i, r in enumerate(rows):
        ids = torch.tensor([[*r.prompt_token_ids, *r.output_token_ids]])
        hf = RepetitionPenaltyLogitsProcessor(penalty=r.params.repetition_penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(out[i : i + 1], hf, rtol=0, atol=0)


def test_frequency_presence_and_repetition_match_reference():
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    vocab, batch = 64, 60
    logits = torch.randn(batch, vocab, generator=gen) * 3
    rows = []
    for _ in range(batch):
        # Small id range so tokens repeat, within the output and between prompt and output.
        prompt = [rng.randrange(20) for _ in range(rng.randrange(0, 15))]
        output = [rng.randrange(20) for _ in range(rng.randrange(0, 15))]
        rows.append(
            make_row(
                prompt,
                output,
                repetition_penalty=rng.choice([1.0, 1.0, 1.5, 0.7]),
                frequency_penalty=rng.choice([0.0, 0.5, -0.3, 2.0]),
                presence_penalty=rng.choice([0.0, 0.8, -1.0, -2.0]),
            )
        )

    out = apply_penalties(logits, rows)

    for i, r in enumerate(rows):
        want = ref_penalize(logits[i].tolist(), r.params, list(r.prompt_token_ids), list(r.output_token_ids))
        torch.testing.assert_close(out[i].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_prompt_tokens_do_not_count_for_frequency_or_presence():
    logits = torch.zeros(1, 8)
    row = make_row(prompt=[1, 1, 2], output=[2, 3, 3], frequency_penalty=1.0, presence_penalty=0.5)
    out = apply_penalties(logits, [row])
    assert out[0].tolist() == [0.0, 0.0, -1.5, -2.5, 0.0, 0.0, 0.0, 0.0]


def test_penalties_fast_path_is_a_no_op():
    logits = torch.randn(3, 10)
    rows = [make_row([1, 2], [3, 3]) for _ in range(3)]
    assert torch.equal(apply_penalties(logits, rows), logits)


# ---------------------------------------------------------------------------
# The whole chain


def random_row(rng: random.Random, vocab: int) -> SampleRow:
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
    return make_row(
        prompt,
        output,
        temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([-1, 0, 1, 3, 10, vocab, 10_000]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.8, 0.5, 1e-6]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3, 1.0]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.5]),
        presence_penalty=rng.choice([0.0, 0.0, 0.7, -1.0]),
    )


def test_logits_to_probs_matches_reference_chain():
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    vocab, batch = 40, 400
    logits = torch.randn(batch, vocab, generator=gen) * 2
    rows = [random_row(rng, vocab) for _ in range(batch)]

    probs = logits_to_probs(logits, rows)

    assert probs.dtype == torch.float32 and probs.shape == (batch, vocab)
    torch.testing.assert_close(probs.sum(-1), torch.ones(batch))
    checked = 0
    for i, r in enumerate(rows):
        want, margin = ref_probs(logits[i].tolist(), r)
        if margin < 1e-4:  # a float32 rounding could legitimately move a top-p / min-p cut here
            continue
        torch.testing.assert_close(probs[i].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6)
        checked += 1
    assert checked >= batch - 5


def test_logits_to_probs_each_parameter_alone():
    # One filter at a time, so a parameter mix-up between stages cannot hide behind another.
    gen = torch.Generator().manual_seed(6)
    vocab = 30
    logits = torch.randn(6, vocab, generator=gen)
    rows = [
        make_row(),
        make_row(temperature=0.5),
        make_row(top_k=4),
        make_row(top_p=0.6),
        make_row(min_p=0.4),
        make_row(temperature=0.0, top_k=4),
    ]
    probs = logits_to_probs(logits, rows)
    for i, r in enumerate(rows):
        want, _ = ref_probs(logits[i].tolist(), r)
        torch.testing.assert_close(probs[i].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------
# Sampling


CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}  # 0.999 quantiles


def chi_square(tokens: torch.Tensor, target: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of the drawn tokens against `target` over its support, and its dof."""
    counts = torch.bincount(tokens, minlength=target.numel()).double()
    support = target > 0
    expected = tokens.numel() * target[support].double()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


STAT_LOGITS = torch.tensor([0.5, 0.35, 0.2, 0.1, 0.0, -0.15, -0.6, -2.0])
STAT_PARAMS = dict(temperature=0.9, top_k=7, top_p=0.97, min_p=0.3)
NUM_DRAWS = 50_000


def test_sampling_matches_target_distribution():
    row = make_row(**STAT_PARAMS)
    target = logits_to_probs(STAT_LOGITS[None], [row])[0]
    want, _ = ref_probs(STAT_LOGITS.tolist(), row)
    torch.testing.assert_close(target.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    assert 5 <= int((target > 0).sum()) < 8  # the filters really removed tokens

    gen = torch.Generator().manual_seed(7)
    tokens = sample(STAT_LOGITS.expand(NUM_DRAWS, -1), [row] * NUM_DRAWS, generator=gen).token_ids

    assert set(tokens.tolist()) == set(torch.nonzero(target).flatten().tolist())
    stat, dof = chi_square(tokens, target)
    assert stat < CHI2_999[dof], (stat, dof)


def test_chi_square_flags_a_one_percent_bias():
    # Negative control: draw from a distribution with 1% of the mass moved between the two most
    # likely tokens (the hardest place to see it) and check the statistic above rejects it.
    row = make_row(**STAT_PARAMS)
    target = logits_to_probs(STAT_LOGITS[None], [row])[0]
    biased = target.clone()
    first, second = target.argsort(descending=True)[:2].tolist()
    biased[first] -= 0.01
    biased[second] += 0.01

    gen = torch.Generator().manual_seed(7)
    tokens = sample(biased.log().expand(NUM_DRAWS, -1), [make_row()] * NUM_DRAWS, generator=gen).token_ids

    stat, dof = chi_square(tokens, target)
    assert stat > CHI2_999[dof], (stat, dof)
    # ... while the same draws pass against the distribution they really came from.
    stat_true, dof_true = chi_square(tokens, biased)
    assert stat_true < CHI2_999[dof_true]


@pytest.mark.parametrize("seeded", [False, True])
def test_zero_probability_tokens_are_never_sampled(seeded):
    gen = torch.Generator().manual_seed(8)
    vocab, draws = 16, 20_000 if not seeded else 2_000
    logits = torch.randn(vocab, generator=gen) * 0.3  # flat: the cut-off tokens would be drawn often
    top2 = set(logits.topk(2).indices.tolist())
    rows = [make_row(top_k=2, seed=(i if seeded else None)) for i in range(draws)]
    tokens = sample(logits.expand(draws, -1), rows, generator=gen).token_ids
    assert set(tokens.tolist()) == top2


def test_zero_probability_tokens_from_each_filter():
    gen = torch.Generator().manual_seed(9)
    vocab, draws = 12, 5_000
    logits = torch.randn(vocab, generator=gen) * 0.5
    for params in (dict(top_p=0.3), dict(min_p=0.9), dict(top_k=3, top_p=0.5, min_p=0.5)):
        row = make_row(**params)
        support = set(torch.nonzero(logits_to_probs(logits[None], [row])[0]).flatten().tolist())
        tokens = sample(logits.expand(draws, -1), [row] * draws, generator=gen).token_ids
        assert set(tokens.tolist()) <= support, params


def test_seeded_row_ignores_batch_companions_and_position():
    gen = torch.Generator().manual_seed(10)
    vocab = 1000
    row_logits = torch.randn(vocab, generator=gen) * 0.1  # nearly uniform: any leak changes the token
    target = make_row(prompt=[1, 2], output=[5, 6, 7], seed=1234, top_p=0.99)

    def run(companions: list[SampleRow], position: int, generator: torch.Generator | None) -> int:
        rows = companions[:position] + [target] + companions[position:]
        logits = torch.randn(len(rows), vocab, generator=gen)
        logits[position] = row_logits
        return sample(logits, rows, generator=generator).token_ids[position].item()

    others = [
        make_row(),
        make_row(seed=99, output=[5, 6, 7]),
        make_row(temperature=0.0, repetition_penalty=1.3, output=[1]),
        make_row(seed=1234, output=[5, 6]),  # same seed, other step
        make_row(top_k=5, logprobs=3),
        make_row(seed=7),
    ]
    alone = run([], 0, None)
    results = [
        run(others[:2], 1, torch.Generator().manual_seed(1)),
        run(others[2:5], 3, torch.Generator().manual_seed(2)),
        run(others, 5, None),
        run(others, 0, torch.Generator().manual_seed(3)),
        run([make_row()] * 40, 17, None),
    ]
    assert results == [alone] * len(results)


def test_seeded_generation_is_reproducible_across_recompute():
    # Generate 20 tokens twice in different batches, as a request would before and after preemption.
    gen = torch.Generator().manual_seed(11)
    vocab = 500
    step_logits = [torch.randn(vocab, generator=gen) * 0.2 for _ in range(20)]

    def generate(batch_size: int, position: int) -> list[int]:
        output: list[int] = []
        for logits_row in step_logits:
            rows = [make_row(seed=s) for s in range(batch_size)]
            rows[position] = make_row(prompt=[3, 4], output=output, seed=42, temperature=0.8)
            logits = torch.randn(batch_size, vocab)  # companions' logits: from the global RNG
            logits[position] = logits_row
            output = output + [sample(logits, rows).token_ids[position].item()]
        return output

    assert generate(1, 0) == generate(5, 3) == generate(9, 8)


def test_seed_steps_and_unseeded_rows_give_fresh_draws():
    vocab, steps = 1000, 50
    logits = torch.zeros(1, vocab)  # uniform
    by_step = [sample(logits, [make_row(seed=5, output=[0] * n)]).token_ids.item() for n in range(steps)]
    by_seed = [sample(logits, [make_row(seed=s, output=[0])]).token_ids.item() for s in range(steps)]
    gen = torch.Generator().manual_seed(12)
    unseeded = [sample(logits, [make_row()], generator=gen).token_ids.item() for _ in range(steps)]
    # 50 uniform draws from 1000 tokens repeat about once; a stuck stream gives 1 distinct value.
    for draws in (by_step, by_seed, unseeded):
        assert len(set(draws)) >= 40, draws
    # Output contents do not matter, only their count (the step).
    assert sample(logits, [make_row(seed=5, output=[9, 9, 9])]).token_ids.item() == by_step[3]


def test_greedy_with_penalties_is_argmax_of_penalized_logits():
    gen = torch.Generator().manual_seed(13)
    rng = random.Random(13)
    vocab, batch = 32, 64
    logits = torch.randn(batch, vocab, generator=gen) * 2
    rows = []
    for i in range(batch):
        top = logits[i].argmax().item()
        output = [top] * rng.randrange(0, 3) + [rng.randrange(vocab) for _ in range(3)]
        rows.append(
            make_row(
                prompt=[rng.randrange(vocab) for _ in range(4)],
                output=output,
                temperature=0.0,
                top_k=rng.choice([-1, 2]),
                repetition_penalty=rng.choice([1.0, 1.5, 3.0]),
                frequency_penalty=rng.choice([0.0, 1.0]),
                presence_penalty=rng.choice([0.0, 2.0]),
            )
        )
    want = []
    for i, r in enumerate(rows):
        x = ref_penalize(logits[i].tolist(), r.params, list(r.prompt_token_ids), list(r.output_token_ids))
        want.append(max(range(vocab), key=lambda j: x[j]))
    assert sum(w != logits[i].argmax().item() for i, w in enumerate(want)) >= 10  # penalties matter here

    # All-greedy batch (fast path) and the same rows mixed with sampled rows (probability path).
    assert sample(logits, rows).token_ids.tolist() == want
    mixed_rows = [r for pair in zip(rows, [make_row(top_k=3)] * batch) for r in pair]
    mixed_logits = logits.repeat_interleave(2, dim=0)
    assert sample(mixed_logits, mixed_rows).token_ids[::2].tolist() == want


def test_logprobs_are_of_raw_logits():
    gen = torch.Generator().manual_seed(14)
    vocab = 50
    logits = torch.randn(5, vocab, generator=gen) * 2
    rows = [
        make_row(logprobs=None),
        make_row(logprobs=0, temperature=0.5, output=[1, 2]),
        make_row(logprobs=3, repetition_penalty=2.0, prompt=[3, 4, 5]),
        make_row(logprobs=5, temperature=0.0, frequency_penalty=1.0, output=[int(logits[3].argmax())]),
        make_row(logprobs=2, top_k=4, seed=3),
    ]

    out = sample(logits, rows, generator=gen)

    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (5,)
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.shape == (5, 5)
    assert out.top_logprob_ids.dtype == torch.int64 and out.top_logprob_ids.shape == (5, 5)
    for i in range(5):
        row = logits[i].double()
        raw = (row - torch.logsumexp(row, 0)).tolist()  # reference log-softmax of the raw logits
        assert out.logprobs[i].item() == pytest.approx(raw[out.token_ids[i].item()], abs=1e-5)
        order = ref_order(raw)[:5]
        assert out.top_logprob_ids[i].tolist() == order
        assert out.top_logprobs[i].tolist() == pytest.approx([raw[j] for j in order], abs=1e-5)
        assert out.top_logprobs[i].tolist() == sorted(out.top_logprobs[i].tolist(), reverse=True)


def test_no_logprobs_when_no_row_asks():
    logits = torch.randn(3, 10)
    for rows in ([make_row()] * 3, [make_row(temperature=0.0)] * 3):
        out = sample(logits, rows)
        assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


def test_logprobs_zero_gives_chosen_only():
    out = sample(torch.randn(2, 10), [make_row(logprobs=0), make_row(temperature=0.0)])
    assert out.logprobs.shape == (2,) and out.top_logprobs.shape == (2, 0)

"""The adaptive speculation policy (speculative/policy.py) against expected tokens per millisecond worked
out by hand from a cost table: it drafts nothing when acceptance is low, the full depth when it is
high, fewer tokens as the batch (and the verify cost of each draft) grows, and a tree when trees pay."""

import pytest

from tandem.speculative.policy import DepthPolicy, DraftShape

D = 3


def policy_with_costs(costs: dict[int, list[float]], tree=False, **kw) -> DepthPolicy:
    """costs: padded batch -> ms of an iteration at depth 0..D (then the tree's, with tree=True)."""
    p = DepthPolicy(D, tree=tree, **kw)
    for bs, row in costs.items():
        for shape, ms in zip(p.options, row):
            p.observe_time(bs, shape, ms, weight=1.0)
    return p


def teach(p: DepthPolicy, rate_per_position: list[float], steps=400, rid="r") -> None:
    """Feeds full-depth verify steps whose accept lengths follow the given conditional rates (deterministic:
    step i accepts position j while u_i < the running product, u_i an evenly spread, shuffled sequence)."""
    for i in range(steps):
        u = (i * 0.6180339887498949 + 0.5) % 1.0
        run, accepted = 1.0, 0
        for a in rate_per_position:
            run *= a
            if u < run:
                accepted += 1
            else:
                break
        p.observe_accept(rid, DraftShape(D), accepted + 1)


def set_acceptance(p: DepthPolicy, rates: list[float], sampled: bool | None = None) -> None:
    """The engine-wide rates of a sampling class (None: both), as if measured over many steps (requests
    without history use them)."""
    for cls in p.rates_by_class.values() if sampled is None else [p.rates_by_class[sampled]]:
        cls.acceptance = list(rates)
        cls.seen = [10**6] * D
        cls.expected = cls.spread = None


def test_expected_tokens_by_hand():
    p = DepthPolicy(D, tree=False, prior=0.5)
    # 1 + 0.5 + 0.25 + 0.125 for one request at depth 3; twice that for two.
    assert p.expected_tokens(["a"], DraftShape(3)) == pytest.approx(1.875)
    assert p.expected_tokens(["a", "b"], DraftShape(1)) == pytest.approx(3.0)
    assert p.expected_tokens(["a"], DraftShape(0)) == 1.0


def test_low_acceptance_drafts_nothing():
    p = policy_with_costs({1: [1.0, 1.1, 1.2, 1.3]}, probe_every=10**9)
    teach(p, [0.05, 0.05, 0.05])
    # depth 0: 1 / 1.0 = 1.0; depth 1: 1.05 / 1.1 = 0.955: no draft pays.
    assert p.choose(["r"], 1) == DraftShape(0)


def test_high_acceptance_drafts_full_depth():
    p = policy_with_costs({1: [1.0, 1.1, 1.2, 1.3]}, probe_every=10**9)
    teach(p, [0.9, 0.9, 0.9])
    # depth 3: (1 + .9 + .81 + .729) / 1.3 = 2.64 per ms, the best.
    assert p.choose(["r"], 1) == DraftShape(3)


def test_prompt_chunks_in_the_step_count_as_rows_that_accept_nothing():
    """Drafting lengthens a step that also processes prompts, which delays those requests' first
    token for nothing: they count as rows with one token's worth each."""
    p = policy_with_costs({8: [1.0, 1.2, 1.4, 1.6]}, probe_every=10**9)
    teach(p, [0.6, 0.6, 0.6])
    rids = ["r"] * 8
    # Alone, by hand with a = 0.6 (tokens 1, 1.6, 1.96, 2.176 per row): 8.0, 10.67, 11.2, 10.88 per ms -> 2.
    assert p.choose(rids, 8) == DraftShape(2)
    # With 24 prompt rows: (8 t + 24) / ms = 32.0, 30.67, 28.34, 25.88 per ms -> depth 0.
    assert p.choose(rids, 8, prefill_rows=24) == DraftShape(0)


def test_depth_zero_pays_for_its_catch_ups():
    """A catch-up runs the draft over the tokens depth-0 steps deferred: its time per deferred step is
    part of depth 0's cost. By hand with a = 0.08: depth 1 gives 1.08 / 1.1 = 0.982 tokens per ms,
    depth 0 1 / 1.0 (-> depth 0), or 1 / 1.1 = 0.909 once each step owes 0.1 ms of catch-up (-> 1)."""
    p = policy_with_costs({1: [1.0, 1.1, 1.2, 1.3]}, probe_every=10**9)
    teach(p, [0.08, 0.08, 0.08])
    assert p.choose(["r"], 1) == DraftShape(0)
    p.observe_catch_up(1, 0.1)
    assert p.choose(["r"], 1) == DraftShape(1)


def test_depth_falls_as_the_batch_grows():
    # Batch 1: drafts are nearly free. Batch 64: each verified draft costs half a plain step.
    p = policy_with_costs({1: [1.0, 1.05, 1.1, 1.15], 64: [1.0, 1.5, 2.0, 2.5]}, probe_every=10**9)
    teach(p, [0.6, 0.6, 0.6])
    # By hand with a = 0.6: tokens 1, 1.6, 1.96, 2.176.
    # batch 1:  1.00, 1.524, 1.782, 1.892 per ms -> depth 3
    # batch 64: 1.00, 1.067, 0.980, 0.870 per ms -> depth 1
    rates = p.acceptance
    assert rates == pytest.approx([0.6, 0.6, 0.6], abs=0.06)  # a moving average over ~20 steps
    assert p.choose(["r"], 1) == DraftShape(3)
    assert p.choose(["r"] * 64, 64) == DraftShape(1)


def test_untimed_shapes_are_tried_first_and_probes_keep_acceptance_known():
    p = DepthPolicy(D, tree=False, probe_every=4)
    seen = []
    for _ in range(D + 1):  # nothing timed at batch 8: each option once, deepest first
        shape = p.choose(["r"], 8)
        seen.append(shape.depth)
        p.observe_time(8, shape, 1.0 + 10 * shape.depth)  # drafts are ruinous here
    assert seen == [3, 2, 1, 0]
    # Position 1 was never observed, and a step of the deepest would observe it: one learning probe. Then a
    # probe (the deepest, 31 ms) costs 30 ms more than a 1 ms step: at most 0.5% of the time means one per
    # 6000 steps. (No acceptance is reported here: the learning probe is not repeated for that.)
    choices = [p.choose(["r"], 8).depth for _ in range(12001)]
    assert choices[0] == 3 and set(choices[1:6000]) == {0} and choices[6000] == 3 and choices.count(3) == 3


def test_cheap_probes_run_every_probe_every_steps():
    p = policy_with_costs({1: [1.0, 1.001, 1.002, 1.003]}, probe_every=4)
    teach(p, [0.0, 0.0, 0.0])  # nothing is ever accepted: depth 0 wins
    choices = [p.choose(["r"], 1).depth for _ in range(8)]
    assert choices == [0, 0, 0, 3, 0, 0, 0, 3]


def test_one_early_rejection_is_not_a_rate_of_zero():
    p = DepthPolicy(D, tree=False, prior=0.6)
    p.observe_accept("r", DraftShape(D), 1)  # position 1 tried and rejected, once
    # The prior counts as 1 observation: (0.6 + 0) / 2.
    assert p.acceptance[0] == pytest.approx(0.3)
    assert p.acceptance[1:] == [0.6, 0.6]


def test_nothing_accepted_stops_drafting_within_a_few_steps():
    """The 8B shape on an H200 at batch 1 (bench/results/depth0-cost-llama-3.1-8b-h200-6603c51.json): depth 0
    4.74 ms, chains of 1, 2, 3 5.2, 5.5, 5.84 ms. Position 1 after k rejections is a_1 = 0.6 / (k + 1) (the
    prior worth 1 observation); positions past it are never observed and take a_1 (effective_acceptance). Step 1: the
    prior (0.6 everywhere) picks the chain of 3. k = 1, a = 0.3: the chain of 2 (1.39 / 5.5 = 0.2527 a ms)
    beats the chain of 3 (1.417 / 5.84 = 0.2426) by more than the 3% hysteresis. k = 2, a = 0.2: the chain
    of 1 (0.2308) is not 3% better than the chain of 2 (0.2255): kept. k = 3, a = 0.15: the chain of 1
    (0.2212 against 0.2132). Depth 0 beats the chain of 1 once 1 / 4.74 > 1.03 (1 + a_1) / 5.2:
    a_1 < 0.065, k = 9. Wasted: 5.4 ms (with the prior kept for unobserved positions, 5 chains of 3 and 4
    of 1: 7.3 ms; with the prior worth 2 observations, 2.9 steps' time; with a request's own rates
    decaying at 5% a step from the prior, 35 steps of drafting)."""
    p = DepthPolicy(3, tree=False, probe_every=10**9)
    for shape, ms in zip(p.options, (4.74, 5.2, 5.5, 5.84)):
        p.observe_time(1, shape, ms, weight=1.0)
    chosen = []
    for _ in range(30):
        shape = p.choose(["r"], 1)
        chosen.append(shape.depth)
        p.observe_accept("r", shape, 1)
    assert chosen[0] == 3, chosen
    first = chosen.index(0)
    assert chosen[:9] == [3, 2, 2] + [1] * 6 and first == 9 and set(chosen[first:]) == {0}, chosen


def test_a_request_with_enough_history_uses_its_own_rates():
    p = policy_with_costs({2: [1.0, 1.1, 1.2, 1.3]}, probe_every=10**9, min_request_obs=8)
    teach(p, [0.05] * 3, rid="chat")  # the engine-wide average learns from both requests
    teach(p, [0.95] * 3, steps=80, rid="code")
    own = p.expected_tokens(["code"], DraftShape(3))
    assert own > 3.0  # its own rates, not the engine's mixed average
    assert p.choose(["code", "code"], 2) == DraftShape(3)
    assert p.choose(["chat", "chat"], 2) == DraftShape(0)


def test_tree_is_chosen_when_its_accept_lengths_pay():
    p = policy_with_costs({1: [1.0, 1.1, 1.2, 1.3, 1.5]}, tree=True, probe_every=10**9)
    assert p.options[-1] == DraftShape(D, tree=True)
    teach(p, [0.5, 0.5, 0.5])  # chains: at best (1.875 / 1.3 = 1.44 per ms)
    for _ in range(400):
        p.observe_accept("r", DraftShape(D, tree=True), 4)  # the tree accepts everything
    assert p.choose(["r"], 1) == DraftShape(D, tree=True)  # 4 / 1.5 = 2.67 per ms
    for _ in range(400):
        p.observe_accept("r", DraftShape(D, tree=True), 1)
    assert not p.choose(["r"], 1).tree


def test_requests_are_admitted_dormant_only_when_drafting_does_not_pay():
    """Costs 1.0 ms at depth 0 and 1.3 / 1.5 / 1.7 ms at depth 1..3. Taught acceptance 0.1 over 64 steps: the
    learned a_1 is under 0.15 and the upper end of its 95% interval over 64 observations about 0.2, so depth 1
    gives at most 1.2 / 1.3 = 0.92 tokens per ms and deeper less: drafting loses to depth 0's 1.0, new
    requests are dormant, but every eighth keeps its draft (a sentinel). Acceptance 0.9: depth 1 alone gives
    about 1.9 / 1.3: nobody is dormant."""
    from tandem.speculative.policy import SENTINEL_EVERY

    costs = {8: [1.0, 1.3, 1.5, 1.7]}
    p = policy_with_costs(costs)
    assert not p.admit("early", 8)  # the prior alone never makes a request dormant
    teach(p, [0.1, 0.1, 0.1], steps=64)
    assert p.acceptance[0] < 0.15 and all(a <= 0.6 for a in p.acceptance)
    assert p.optimistic_acceptance()[0] < 0.23
    admitted = [p.admit(f"q{i}", 8) for i in range(2 * SENTINEL_EVERY)]
    assert admitted.count(False) == 2 and admitted[SENTINEL_EVERY - 1] is False
    assert p.dormant == {f"q{i}" for i, d in enumerate(admitted) if d}
    assert not p.admit("unknown batch", 64)  # no cost table there: keep the draft

    q = policy_with_costs(costs)
    teach(q, [0.9, 0.9, 0.9], steps=64)
    assert q.acceptance[0] > 0.8
    assert not any(q.admit(f"q{i}", 8) for i in range(2 * SENTINEL_EVERY))


def test_one_request_the_draft_cannot_follow_does_not_make_the_next_ones_dormant(monkeypatch):
    """Batch 1, costs 1.0 ms at depth 0 and 1.3 / 1.5 / 1.66 ms at depth 1..3: a chain of three pays from 1.66
    expected tokens. Two requests accept 0.7 at every position (1 + 0.7 + 0.49 + 0.343 = 2.53 tokens a chain of
    three), then one accepts nothing for 60 steps: the engine's moving average of a_1 falls near 0 (one row a
    step, so the last request is all it remembers), and at its rates no drafting pays. The three requests'
    mean, one vote each, is (2.53 + 2.53 + 1) / 3 = 2.02 tokens at 1.66 ms, 1.22 a ms against depth 0's 1.0:
    later requests keep their draft. Controls: with the population rule off, and when all three accepted
    nothing, they are admitted dormant."""
    from tandem.speculative.policy import dormancy

    costs = {1: [1.0, 1.3, 1.5, 1.66]}

    def after(rates_by_request):
        p = policy_with_costs(costs, probe_every=10**9)
        for i, rates in enumerate(rates_by_request):
            teach(p, rates, steps=60, rid=f"done{i}")
            p.forget([f"done{i}"])
        return p

    good, hopeless = [0.7, 0.7, 0.7], [0.0, 0.0, 0.0]
    p = after([good, good, hopeless])
    assert p.acceptance[0] < 0.1  # the moving average is the last request's
    assert p.population_expected(False)[3] == pytest.approx((2 * 2.533 + 1.0) / 3, abs=0.03)
    assert not any(p.admit(f"next{i}", 1) for i in range(5))

    monkeypatch.setattr(dormancy, "DORMANT_POPULATION_MIN_REQUESTS", 10**6)
    assert after([good, good, hopeless]).admit("next", 1)  # without the population's vote: dormant
    monkeypatch.undo()
    assert after([hopeless, hopeless, hopeless]).admit("next", 1)  # the population agrees: dormant


def test_running_requests_drop_their_draft_once_drafting_cannot_pay():
    """Costs where a chain of one costs 1.6x depth 0 (it pays only at a_1 > 0.6): before 8 observations
    nothing is demoted; after 8 rejections every running request but the sentinels drops its draft state;
    at acceptance 0.9 nobody does."""
    from tandem.speculative.policy import SENTINEL_EVERY

    costs = {8: [1.0, 1.6, 2.0, 2.4]}
    p = policy_with_costs(costs, probe_every=10**9)
    teach(p, [0.0, 0.0, 0.0], steps=4)
    assert p.demote(["a", "b"], 8) == []  # too early to tell
    teach(p, [0.0, 0.0, 0.0], steps=4)
    for i in range(SENTINEL_EVERY):  # the SENTINEL_EVERY-th admission keeps its draft
        p.admit(f"late{i}", 8)
    sentinel = f"late{SENTINEL_EVERY - 1}"
    assert sentinel in p.sentinels and sentinel not in p.dormant
    assert p.demote(["a", "b", sentinel, "late0"], 8) == ["a", "b"]
    assert {"a", "b"} <= p.dormant and sentinel not in p.dormant
    assert p.demote(["a", "b", sentinel], 8) == []  # nothing left to drop
    assert p.demote(["c"], 64) == []  # no cost table there
    q = policy_with_costs(costs, probe_every=10**9)
    teach(q, [0.9, 0.9, 0.9], steps=8)
    assert q.demote(["a", "b"], 8) == []


def test_a_dormant_steps_cost_decides_once_it_is_timed():
    """Drafting is judged against a dormant row's own step (plain decoding's) once that is timed: chain one
    costs 1.2 ms, depth 0 1.0 ms (a_1 must beat 0.2); with dormant steps at 0.7 ms a_1 must beat 0.71, so
    a learned a_1 of about 0.5 (upper end of its interval about 0.6 after 64 observations) keeps drafting
    against depth 0 but not against the dormant step."""
    costs = {8: [1.0, 1.2, 1.6, 2.0]}
    p = policy_with_costs(costs, probe_every=10**9)
    teach(p, [0.5, 0.0, 0.0], steps=64)
    assert 0.4 < p.acceptance[0] < 0.6 and p.optimistic_acceptance()[0] < 0.65
    assert not p.admit("r1", 8)
    p.observe_dormant_time(8, 0.7, weight=1.0)
    assert p.admit("r2", 8)


def wilson_upper(a: float, n: int, z: float = 1.64) -> float:
    """The upper end of the one-sided Wilson interval, written out independently of the policy's."""
    return (a + z * z / (2 * n) + z * ((a * (1 - a) + z * z / (4 * n)) / n) ** 0.5) / (1 + z * z / n)


@pytest.mark.parametrize("chain1_ms, dormant_at", [(1.6, 8), (1.2, 64)])
def test_dormancy_needs_as_many_observations_as_the_margin_asks(chain1_ms, dormant_at):
    """A request is dormant once even an optimistic a_1 (the upper end of its 95% interval) cannot make
    drafting pay. Nothing is ever accepted. Where a chain of one costs 1.6x depth 0 it pays only at
    a_1 > 0.6, which 8 rejections already rule out (upper end about 0.31); at 1.2x it pays at a_1 > 0.2,
    which needs more: not after 8 observations, but after 64. (A fixed 32 observations before: neither.)"""
    from tandem.speculative.policy import DORMANT_MIN_OBSERVATIONS

    costs = {8: [1.0, chain1_ms, chain1_ms + 0.4, chain1_ms + 0.8]}
    for steps in (DORMANT_MIN_OBSERVATIONS, 64):
        p = policy_with_costs(costs, probe_every=10**9)
        teach(p, [0.0, 0.0, 0.0], steps=steps)
        a1, n = p.acceptance[0], p._seen[0]
        assert n == steps and p.optimistic_acceptance()[0] == pytest.approx(wilson_upper(a1, n))
        # By hand: the best drafting option's tokens per ms with a_1 at its upper end (deeper positions
        # never observed take a_1's rate), against depth 0's 1.0 per ms.
        up = wilson_upper(a1, n)
        best = max((1 + up) / chain1_ms, (1 + up + up * a1) / (chain1_ms + 0.4),
                   (1 + up + up * a1 + up * a1 * a1) / (chain1_ms + 0.8))
        assert p.admit("r", 8) == (best < 1.0) == (steps >= dormant_at)

def test_dormant_rows_accept_nothing_and_teach_nothing():
    """A dormant request's drafts come from no state: the policy counts it as 1 token at every depth and
    ignores its accept lengths. Batch of 8 at costs 1.0 / 1.5 / 2.0 / 2.5 ms, acceptance 0.9: 8 drafted
    rows make depth 3 pay (8 * 3.44 / 2.5 = 11.0 per ms against 8.0); with 7 of them dormant, depth 0
    (8 / 1.0) beats depth 3 ((7 + 3.44) / 2.5 = 4.2). (The learned rates are above 0.8, not exactly 0.9.)"""
    p = policy_with_costs({8: [1.0, 1.5, 2.0, 2.5]}, probe_every=10**9)
    teach(p, [0.9, 0.9, 0.9], steps=64)
    rows = [f"r{i}" for i in range(8)]
    assert p.choose(rows, 8) == DraftShape(3)
    p.dormant.update(rows[1:])
    a1, a2, a3 = p.acceptance
    assert min(p.acceptance) > 0.8
    assert p.expected_tokens(rows, DraftShape(3)) == pytest.approx(7 + 1 + a1 + a1 * a2 + a1 * a2 * a3)
    assert p.choose(rows, 8) == DraftShape(0)
    before = list(p.acceptance)
    p.observe_accept("r1", DraftShape(3), 1)
    assert p.acceptance == before
    p.forget(["r1"])
    assert "r1" not in p.dormant


def test_catch_up_charge_is_that_of_the_rows_that_defer():
    """Depth 0 owes the catch-ups of the rows that defer, at their padded size. Costs 1.0 / 1.3 / 1.4 /
    1.5 ms, position 1 accepted at a = 0.1 (nothing after). A catch-up share of 0.2 ms a step for 32 rows
    makes depth 0 worth 1 / 1.2 = 0.833 tokens a row per ms, less than a chain of one's 1.1 / 1.3 = 0.846
    (chosen); with 28 of the 32 dormant, 4 rows defer and owe 0.01 ms: depth 0 (0.990) again; with no row
    deferring, it owes nothing."""
    p = policy_with_costs({32: [1.0, 1.3, 1.4, 1.5]}, probe_every=10**9, hysteresis=0.0)
    set_acceptance(p, [0.1, 0.0, 0.0])
    p.observe_catch_up(32, 0.2)
    p.observe_catch_up(4, 0.01)
    rows = [f"r{i}" for i in range(32)]
    assert p.choose(rows, 32) == DraftShape(1)  # the default: the whole batch defers
    assert p.choose(rows, 32, catch_up_batch=32) == DraftShape(1)
    assert p.choose(rows, 32, catch_up_batch=4) == DraftShape(0)
    assert p.choose(rows, 32, catch_up_batch=0) == DraftShape(0)


def test_no_chain_costs_more_than_a_deeper_one():
    """A table where depth 0 (with its catch-up share) or a short chain costs more than a deeper chain is
    stale: each does a subset of the deeper one's work. At acceptance 0 every option yields one token a
    row, so depth 0 is chosen whatever the stale entries say (before, 1.2 ms with its share against a
    chain of one's 1.1 ms chose the chain, which drafts in vain)."""
    p = policy_with_costs({32: [1.0, 1.1, 1.05, 1.3]}, probe_every=10**9, hysteresis=0.0)
    set_acceptance(p, [0.0, 0.0, 0.0])
    p.observe_catch_up(32, 0.2)
    rows = [f"r{i}" for i in range(32)]
    assert p.choose(rows, 32) == DraftShape(0)


def test_a_cost_that_keeps_its_option_from_running_is_refreshed():
    """The H200's worst sweep point (batch 32, acceptance 0): depth 0's cost in the table was too high,
    so a chain of one ran, in vain, every step, and depth 0 never ran to correct its cost. Here the
    table says depth 0 costs 1.12 ms and a chain of one 1.1 (true: 1.0 and 1.1) and the chain of one was
    the last choice: hysteresis keeps it while depth 0 looks no better. A refresh runs depth 0 within
    REFRESH_EVERY steps; its true time then moves the cost (1.12 -> 1.06: 3.8% better than the chain,
    past the 3% hysteresis), and depth 0 alone is chosen from then on: its cost soon reads its true 1.0 ms,
    and the chain of one, 10% dearer, is outside REFRESH_MARGIN (5%)."""
    from tandem.speculative.policy import REFRESH_EVERY

    true_ms = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}
    p = policy_with_costs({32: [1.12, 1.1, 1.2, 1.3]}, probe_every=10**9)
    set_acceptance(p, [0.0, 0.0, 0.0])
    rows = [f"r{i}" for i in range(32)]
    p._last_choice[32] = DraftShape(1)
    chosen = []
    for _ in range(4 * REFRESH_EVERY):
        shape = p.choose(rows, 32, catch_up_batch=0)
        chosen.append(shape.depth)
        p.observe_time(32, shape, true_ms[shape.depth])
    first = chosen.index(0)
    assert first <= REFRESH_EVERY, chosen
    assert set(chosen[first:]) == {0}, chosen
def test_drafts_past_a_requests_last_token_are_worth_nothing():
    """Acceptance 0.9 at costs 1.0 / 1.1 / 1.2 / 1.3 ms: one request drafts 3 (1 + 0.9 + 0.81 + 0.73 =
    3.44 tokens in 1.3 ms). With 2 tokens left it can use one draft at most: depth 1 (1.9 / 1.1 = 1.73 per
    ms) beats depth 3 (1.9 / 1.3 = 1.46); with 1 left, nothing drafted pays: depth 0."""
    p = policy_with_costs({1: [1.0, 1.1, 1.2, 1.3]}, probe_every=10**9, hysteresis=0.0)
    teach(p, [0.9, 0.9, 0.9])
    assert min(p.acceptance) > 0.85
    assert p.choose(["r"], 1) == DraftShape(3)
    assert p.choose(["r"], 1, remaining=[10]) == DraftShape(3)
    assert p.choose(["r"], 1, remaining=[2]) == DraftShape(1)
    assert p.choose(["r"], 1, remaining=[1]) == DraftShape(0)
    # In a batch, only the finishing request's tail is cut: two rows, one with 1 token left, one with
    # many: depth 3 gives 1 + 3.44 in 1.3 ms (3.4 per ms) against depth 0's 2 in 1.0.
    assert p.choose(["r", "s"], 1, remaining=[1, 50]) == DraftShape(3)


def test_spread_of_one_steps_tokens_by_hand():
    """Rates 0.5, 0.5: depth 1 yields 1 or 2 tokens (even odds): sd 0.5; depth 2 yields 1, 2 or 3 with
    chances 0.5, 0.25, 0.25: mean 1.75, E[T^2] = 3.75, sd sqrt(0.6875)."""
    from tandem.speculative.policy import spread_by_depth

    assert spread_by_depth([0.5, 0.5]) == pytest.approx([0.0, 0.5, 0.6875 ** 0.5])
    assert spread_by_depth([1.0, 1.0]) == pytest.approx([0.0, 0.0, 0.0])  # always every draft


def test_straggler_factor_matches_a_simulated_batch():
    """A batch of 64 requests each needing 64 tokens, a chain of one accepted with probability 0.3 (the
    sweep's worst kind of point): the mean over 400 simulated batches of the steps its slowest request
    needs, against the policy's R / E times its factor."""
    import random

    from tandem.speculative.policy import expected_max_of_normals

    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(64) == pytest.approx(2.41, abs=0.1)  # tabulated: 2.4090
    p = DepthPolicy(D, tree=False)
    set_acceptance(p, [0.3, 0.3, 0.3])
    factors = p._straggler_factors(64, 64, p.rates_by_class[False])
    rng = random.Random(0)

    def steps_to(tokens):
        steps = 0
        while tokens > 0:
            tokens -= 2 if rng.random() < 0.3 else 1
            steps += 1
        return steps

    slowest = sum(max(steps_to(64) for _ in range(64)) for _ in range(400)) / 400
    assert factors[0] == 1.0
    assert 64 / 1.3 * factors[1] == pytest.approx(slowest, rel=0.03)


def test_a_batch_that_finishes_with_its_slowest_request_drafts_only_where_that_pays():
    """Batch 64, costs 5.48 / 6.64 / 7.9 / 9.0 ms (the H200's 8B shape), acceptance 0.3 at every position,
    64 tokens left each. Per step a chain of one pays (1.3 / 6.64 = 0.196 tokens per ms a row against
    1 / 5.48 = 0.182); a batch that ends with its slowest request needs 1.117 times the mean steps at
    that depth (1.3 / 1.117 / 6.64 = 0.175): depth 0. One request alone has no slowest: its choice stays
    (at batch 1 a chain of two, 1.39 / 5.5 = 0.253, a hair above the chain of one's 1.3 / 5.2 = 0.250).
    At acceptance 0.9 the chain of three pays either way."""
    p = policy_with_costs({1: [4.74, 5.2, 5.5, 5.84], 64: [5.48, 6.64, 7.9, 9.0]}, probe_every=10**9,
                          hysteresis=0.0)
    set_acceptance(p, [0.3, 0.3, 0.3])
    rows = [f"r{i}" for i in range(64)]
    assert p.choose(rows, 64, catch_up_batch=0, remaining=[64] * 64) == DraftShape(1)
    assert p.choose(rows, 64, catch_up_batch=0, remaining=[64] * 64, finish_together=[True] * 64) == DraftShape(0)
    assert p.choose(["r0"], 1, catch_up_batch=0, remaining=[64], finish_together=[True]) == DraftShape(2)
    set_acceptance(p, [0.9, 0.9, 0.9])
    assert p.choose(rows, 64, catch_up_batch=0, remaining=[64] * 64, finish_together=[True] * 64) == DraftShape(3)


def test_positions_never_drafted_take_the_rate_of_the_one_before():
    """Batch 64 (costs 5.52 / 6.66 / 8.19 / 9.5 ms, the H200's 8B shape), a batch job of 64 tokens a
    request, and only chains of one run so far, accepting 95% (a_2, a_3 never observed). Taking the prior
    (0.6) for them, the chain of one looked best (1.95 / 1.046 / 6.66 = 0.280 tokens per ms a row against
    the chain of two's 2.52 / 1.109 / 8.19 = 0.277) and nothing ever showed otherwise; taking a_1 for
    them, the chain of three (3.71 / 1.118 / 9.5 = 0.349) is chosen, and then measured."""
    p = policy_with_costs({64: [5.52, 6.66, 8.19, 9.5]}, probe_every=10**9)
    for i in range(400):
        p.observe_accept("r", DraftShape(1), 1 if i % 20 == 0 else 2)
    assert p._seen == [400, 0, 0] and p.acceptance[0] > 0.9
    assert p.effective_acceptance() == [p.acceptance[0]] * 3
    rows = [f"q{i}" for i in range(64)]
    assert p.choose(rows, 64, catch_up_batch=0, remaining=[64] * 64, finish_together=[True] * 64) == DraftShape(3)
    # A first observation of position 2 starts from the rate assumed (a_1), not from the prior.
    p.observe_accept("r", DraftShape(3), 4)
    assert p.acceptance[1] > 0.9 and p._seen[1] == 1


def test_a_batch_that_never_drafted_learns_its_acceptance_from_one_probe():
    """Batch 128, costs 6.35 / 9.77 / 12.57 / 15.59 ms (the H200's 8B shape), a batch job of 64 tokens a
    request. From the prior (0.6) and the straggler charge depth 0 wins (1 / 6.35 = 0.157 tokens per ms a
    row against the chain of one's 1.6 / 1.126 / 9.77 = 0.145), and a regular probe comes once per 290
    steps. Position 1 was never observed, and one step of the deepest observes it 128 times: a learning
    probe, once (the next step is chosen before its results arrive). At acceptance 0.95 the chain of
    three then pays (3.69 / 1.13 / 15.59 = 0.209); at 0 depth 0 stays, with no second learning probe."""
    for accept_len, after in ((4, DraftShape(3)), (1, DraftShape(0))):
        p = policy_with_costs({128: [6.35, 9.77, 12.57, 15.59]}, hysteresis=0.0)
        rows = [f"r{i}" for i in range(128)]
        job = dict(catch_up_batch=0, remaining=[64] * 128, finish_together=[True] * 128)
        assert p.choose(rows, 128, **job) == DraftShape(3)  # the learning probe
        assert p.choose(rows, 128, **job) == DraftShape(0)  # its results not yet in
        lens = [accept_len if i % 20 else max(accept_len - 1, 1) for i in range(128)]
        p.observe_step(DraftShape(3), rows, lens)
        assert [p.choose(rows, 128, **job) for _ in range(100)] == [after] * 100


def test_the_engines_rates_move_once_a_step_by_the_steps_own_rates():
    """One step of 128 rows, the first 108 accepting all three drafts and the last 20 rejecting the third:
    position 3's rate is the mean of the prior (0.6, one observation) and the 128, (0.6 + 108) / 129 =
    0.842, whatever the rows' order (moved once a row at 5%, the last 20 rows pulled it to 0.36). A second
    step with all 128 accepting: the mean of all 257, (0.6 + 236) / 257 = 0.921. Once there are many
    observations a step weighs the decay (5%), at any batch size."""
    p = DepthPolicy(D, tree=False)
    rows = [f"r{i}" for i in range(128)]
    p.observe_step(DraftShape(3), rows, [4] * 108 + [3] * 20)
    assert p.acceptance == pytest.approx([(0.6 + 128) / 129, (0.6 + 128) / 129, (0.6 + 108) / 129])
    p.observe_step(DraftShape(3), rows, [4] * 128)
    assert p.acceptance[2] == pytest.approx((0.6 + 236) / 257)
    set_acceptance(p, [0.5] * 3)
    p.observe_step(DraftShape(3), rows, [1] * 128)
    assert p.acceptance[0] == pytest.approx(0.5 * 0.95)


def test_a_requests_own_rate_at_a_position_counts_once_it_has_enough_observations_there():
    """A request with 20 chains of one accepted and 3 chains of three rejected at position 3: its own
    rate at position 1 decides (20 + observations); at positions 2 and 3 (3 observations each, fewer than
    min_request_obs = 8) the engine's 0.6 as far as the request's own one-sided 95% Wilson interval allows:
    at position 2 (3 hits of 3: at least 3 / (3 + z^2) = 0.53) 0.6 itself, at position 3 (0 of 3: at most
    z^2 / (3 + z^2) = 0.47) 0.47, not its own near-0.3 running rate from three rejections."""
    p = DepthPolicy(D, tree=False, min_request_obs=8)
    set_acceptance(p, [0.6] * 3)
    for _ in range(20):
        p.observe_accept("r", DraftShape(1), 2)
    for _ in range(3):
        p.observe_accept("r", DraftShape(3), 3)
    own = p._requests["r"]
    assert own.seen == [23, 3, 3] and own.rates[2] < 0.35
    set_acceptance(p, [0.6] * 3)  # the engine's, as if measured over many others
    a1, z2 = own.rates[0], 1.64 ** 2
    a3 = z2 / (3 + z2)
    assert p.expected_tokens(["r"], DraftShape(3)) == pytest.approx(1 + a1 + a1 * 0.6 + a1 * 0.6 * a3)


def test_a_requests_own_evidence_moves_its_class_rate_before_it_has_enough_history():
    """The demo pair on a CPU at batch 1: depth 0 12.2 ms, chains of 1, 2, 3 17.0, 20.5, 22.5 ms; the
    greedy class accepts 0.7 at every position. A request that accepts nothing: after n rejections of
    position 1 its rate there is at most z^2 / (n + z^2) (z = 1.64: 0.73, 0.57, 0.47, 0.40, 0.35), deeper
    positions keep the class's 0.7 (never tried). Chain of 3 after n: (1 + a (1 + 0.7 + 0.49)) / 22.5 per
    ms = 0.1123, 0.1003, 0.0904, 0.0836, 0.0785 against depth 0's 1 / 12.2 = 0.0820 (the chains of 1 and
    2 lose to it throughout): five chains of three, then depth 0 (the class's rate until eight
    drafting steps: eight). And a request that accepts everything under a class rate of 0.2 (depth 0 1.0
    ms, chains 1.3, 1.5, 1.7): after three full chains each position is at least 3 / (3 + z^2) = 0.527,
    so a chain of two yields (1 + 0.527 + 0.278) / 1.5 = 1.20 tokens a ms (of one 1.17, of three 1.15)
    against depth 0's 1 (at the class's 0.2 the best chain, of one, 0.92)."""
    p = policy_with_costs({1: [12.2, 17.0, 20.5, 22.5]}, probe_every=10**9)
    set_acceptance(p, [0.7] * 3)
    chosen = []
    for _ in range(10):
        shape = p.choose(["r"], 1)
        chosen.append(shape.depth)
        if shape.drafts:
            p.observe_accept("r", shape, 1)
    assert chosen == [3] * 5 + [0] * 5, chosen

    p = policy_with_costs({1: [1.0, 1.3, 1.5, 1.7]}, probe_every=10**9)
    set_acceptance(p, [0.2] * 3)
    assert p.choose(["r"], 1) == DraftShape(0)
    for _ in range(3):
        p.observe_accept("r", DraftShape(3), 4)
    assert p.expected_tokens(["r"], DraftShape(3)) == pytest.approx(1 + 0.527 + 0.527 ** 2 + 0.527 ** 3, abs=2e-3)
    assert p.choose(["r"], 1) == DraftShape(2)


def test_a_drained_batch_drafts_for_the_rows_that_end_last():
    """Batch 64 (costs 5.49 / 6.80 / 8.44 / 9.83 ms, the H200's 8B shape) at acceptance 0.95 in a batch job:
    60 rows have 1 token left, 4 have 13. Summed over the batch (the throughput view) depth 0 wins:
    64 / 5.49 = 11.7 tokens per ms against (60 + 4 x 3.71) / 9.83 = 7.6. But the batch ends with the 4:
    at depth 0 they need 13 steps (71 ms), and a chain of three gives them 3.71 tokens a step over the
    straggler factor of 4 rows with 13 left, 1 + 1.05 x 0.775 / sqrt(13 x 3.71) = 1.117 (0.338 tokens
    per ms against depth 0's 0.182). With requests queued to take the freed slots, depth 0 stays."""
    p = policy_with_costs({64: [5.49, 6.80, 8.44, 9.83]}, probe_every=10**9, hysteresis=0.0)
    set_acceptance(p, [0.95] * 3)
    rows = [f"r{i}" for i in range(64)]
    left = [1] * 60 + [13] * 4
    assert p.choose(rows, 64, catch_up_batch=0, remaining=left) == DraftShape(0)
    assert p.choose(rows, 64, catch_up_batch=0, remaining=left, finish_together=[True] * 64) == DraftShape(3)


def test_probes_and_refreshes_wait_for_a_catch_up_that_is_due_anyway():
    """At depth 0 the rows defer their draft extends; a drafting step first catches them up, which a depth-0
    step does only once a buffer is full. A probe due while that would be forced waits for the step
    whose catch-up is due anyway: probe_every 4, buffers full at every 6th step here."""
    p = policy_with_costs({1: [1.0, 1.001, 1.002, 1.003]}, probe_every=4)
    teach(p, [0.0, 0.0, 0.0])  # nothing is ever accepted: depth 0 wins
    choices = [p.choose(["r"], 1, catch_up_forced=i % 6 != 5).depth for i in range(12)]
    assert choices == [0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 3]


def test_one_slow_step_moves_a_cost_no_more_than_a_quarter_of_its_weight():
    """A step of 2.15 ms among depth-0 steps of 0.25 (a host stall, or a batch's last step), the first online
    step after start-up timing (which counts as 10 observations: weight 1/10): counted as such it lifts
    the cost by 0.19 ms (76%), for dozens of steps; clipped at 1.25 times the cost so far, by 0.006 ms.
    A real rise (to 0.40 ms a step) still shows within a few dozen steps."""
    p = policy_with_costs({1: [0.25, 0.45, 0.5, 0.55]})
    p.observe_time(1, DraftShape(0), 2.15)
    assert p.cost_ms[(1, DraftShape(0))] == pytest.approx(0.25 + 0.1 * 0.25 * 0.25)
    for _ in range(60):
        p.observe_time(1, DraftShape(0), 0.40)
    assert p.cost_ms[(1, DraftShape(0))] > 0.39


def test_dormancy_takes_the_estimate_as_it_is_once_settled():
    """Costs where a chain of one costs 1.6x depth 0 (it pays at a_1 > 0.6); position 1 is accepted half
    the time, nothing deeper. With 24 observations the upper end of a_1's interval (about 0.66, worked out
    by `wilson_upper`) still lets drafting pay: drafts are kept. From DORMANT_SETTLED_OBSERVATIONS (32)
    the estimate (about 0.5: 1.5 / 1.6 = 0.94 tokens per ms against depth 0's 1.0) decides: dormant."""
    from tandem.speculative.policy import DORMANT_SETTLED_OBSERVATIONS

    costs = {8: [1.0, 1.6, 2.0, 2.4]}
    early = policy_with_costs(costs, probe_every=10**9)
    teach(early, [0.5, 0.0, 0.0], steps=24)
    a1 = early.acceptance[0]
    assert 0.4 < a1 < 0.6 and wilson_upper(a1, 24) > 0.6
    assert not early.admit("r", 8) and early.demote(["a"], 8) == []
    settled = policy_with_costs(costs, probe_every=10**9)
    teach(settled, [0.5, 0.0, 0.0], steps=DORMANT_SETTLED_OBSERVATIONS)
    a1 = settled.acceptance[0]
    assert 0.4 < a1 < 0.6 and wilson_upper(a1, DORMANT_SETTLED_OBSERVATIONS) > 0.6
    assert settled.admit("r", 8) and settled.demote(["a"], 8) == ["a"]


def test_dormancy_takes_the_estimate_once_the_batch_has_stayed_at_depth_0():
    """The same costs and acceptance with 24 observations (unsettled by count: drafts kept), but a batch
    of 8 chooses depth 0 (1.5 / 1.6 per ms < 1.0) step after step: after DORMANT_SETTLED_STEPS such steps
    the estimate decides there (dormant), not at batch 16 (no steps chosen there yet)."""
    p = policy_with_costs({8: [1.0, 1.6, 2.0, 2.4], 16: [1.0, 1.6, 2.0, 2.4]}, probe_every=10**9)
    teach(p, [0.5, 0.0, 0.0], steps=24)
    rows = [f"r{i}" for i in range(8)]
    for step in range(64):  # DORMANT_SETTLED_STEPS
        assert not p.admit(f"early{step}", 8)
        assert p.choose(rows, 8) == DraftShape(0)
    assert p.admit("late", 8)
    assert not p.admit("elsewhere", 16)


def test_a_batch_that_finishes_together_is_judged_at_its_slowest_rows_pace():
    """Costs 17 / 23 / 29 / 34 ms at batch 4 (the demo pair's on a CPU), engine-wide acceptance 0.6, 0.7,
    0.7: by the engine's rates a chain of one pays (1.6 / 23 = 0.070 tokens per ms against a dormant row's
    1 / 17 = 0.059). Four finished requests showed 14, 13, 4 and 12 hits of 20 at position 1 and none at
    position 2 (tried after each hit); none tried position 3, which takes the class's 0.7 as one try. Their
    expected tokens by depth: [1, 1.7, 1.7, 1.7], [1, 1.65, 1.65, 1.65], [1, 1.6, 1.6, 1.6] and, for the
    one with 4 hits (position 2: 0 of 4 tries, fewer than 8, so (0 + 0.7) / 5 = 0.14), [1, 1.2, 1.228,
    1.2476]. A request joining a batch of four that finishes together goes at the slowest row's pace, the
    1/5 quantile at each depth (the lowest of four): a chain of one gives 1.2 / 23 = 0.052, two 1.228 / 29
    = 0.042, three 1.2476 / 34 = 0.037, all under 0.059 (dormant). Alone (the median, 1.65 at every depth,
    capped by the engine's 1.6 for a chain of one: 1.6 / 23 = 0.070) or in a batch that a queue refills
    (the engine's rates), it keeps its draft; with three finished requests, too few, too."""
    p = policy_with_costs({1: [17.0, 23.0, 29.0, 34.0], 4: [17.0, 23.0, 29.0, 34.0]}, probe_every=10**9)
    for n, hits in enumerate([14, 13, 4, 12]):
        if n == 3:
            assert not p.admit("three finished", 4, finish_together=True)
        p.observe_step(DraftShape(3), [f"done{n}"] * 20, [2] * hits + [1] * (20 - hits))  # (20 tries of position 1)
        set_acceptance(p, [0.6, 0.7, 0.7])
        p.forget([f"done{n}"])
    assert p.slowest_row_expected(4, False) == pytest.approx([1.0, 1.2, 1.228, 1.2476])
    assert p.slowest_row_expected(1, False) == pytest.approx([1.0, 1.65, 1.65, 1.65])
    assert p.admit("joins four", 4, finish_together=True)
    assert not p.admit("refilled batch", 4)
    assert not p.admit("alone", 1, finish_together=True)
    assert p.slowest_row_expected(4, True) is None  # (sampled requests keep rates of their own)


def test_the_slowest_row_is_judged_at_its_own_deeper_rates_too():
    """The demo pair's batch of four on a CPU (costs 8.56 / 13.1 / 16.9 / 18.5 ms, a dormant row's step
    8.56, its draft prefill 0.169 ms a step, engine-wide acceptance 0.657, 0.9, 0.75): the engine's deeper
    rates come mostly from rows that accept position 1 often. Four finished requests, each 40 tries of
    position 1: three accept each position at about 0.75 (30 of 40, 22 of 30, 16 of 22), one 20 of 40, then
    6 of 20 and 1 of 6 (six tries, short of 8: (1 + 0.75) / 7 = 0.25). With position 1 alone taken from the
    slowest (0.5) and the engine's deeper rates, a chain of three would promise 1 + 0.5 + 0.45 + 0.3375 =
    2.2875 tokens, 2.2875 / 18.5 = 0.1236 per ms against a dormant row's 1 / (8.56 - 0.169) = 0.1192: kept.
    At its own rates the slowest makes 1, 1.5, 1.65, 1.6875: a chain of one 1.5 / 13.1 = 0.1145, two 1.65 /
    16.9 = 0.0976, three 1.6875 / 18.5 = 0.0912, all under 0.1192, so a request joining four is admitted
    dormant."""
    p = policy_with_costs({4: [8.56, 13.1, 16.9, 18.5]}, probe_every=10**9)
    p.observe_dormant_time(4, 8.56, weight=1.0)
    rows = {"fast0": (30, 22, 16), "fast1": (30, 22, 16), "fast2": (30, 22, 16), "slow": (20, 6, 1)}
    for rid, (h1, h2, h3) in rows.items():
        # Accept lengths: 40 - h1 rejected at position 1, h1 - h2 at 2, h2 - h3 at 3, h3 accepting all three.
        lens = [1] * (40 - h1) + [2] * (h1 - h2) + [3] * (h2 - h3) + [4] * h3
        p.observe_step(DraftShape(3), [rid] * 40, lens)
        set_acceptance(p, [0.657, 0.9, 0.75])
        p.forget([rid])
    assert p.slowest_row_expected(4, False) == pytest.approx([1.0, 1.5, 1.65, 1.6875])
    p.observe_draft_prefill(64, 64 * 0.169 / 4)  # (0.169 ms a step for 4 rows of 64 prompt tokens over 64 steps)
    assert p.admit("joins four", 4, prompt_tokens=64, max_new_tokens=64, finish_together=True)


def test_a_batch_at_depth_0_from_the_start_goes_dormant_without_observations():
    """Costs 0.22 / 0.40 / 0.50 / 0.58 ms at batch 1 (the demo pair on a fast host): at the prior (0.6)
    no chain pays (1.6 / 0.40 = 4.0, 1.96 / 0.50 = 3.9, 2.18 / 0.58 = 3.8 tokens per ms against 1 / 0.22 =
    4.5), so a sampled request's batch chooses depth 0 from its first step and its class gets no
    observations (probes aside). After DORMANT_SETTLED_STEPS such steps, not before, its requests are
    admitted dormant and the running one drops its draft; greedy requests, judged apart, are not."""
    p = policy_with_costs({1: [0.22, 0.40, 0.50, 0.58]}, probe_every=10**9)
    assert not p.admit("r", 1, sampled=True)
    choices = [p.choose(["r"], 1) for _ in range(63)]
    assert not p.admit("after 63", 1, sampled=True) and p.demote(["r"], 1) == []
    choices.append(p.choose(["r"], 1))  # the 64th: DORMANT_SETTLED_STEPS
    assert choices[-63:] == [DraftShape(0)] * 63 and p.rates_by_class[True].seen[0] <= 1
    assert not p.admit("greedy", 1)
    assert p.demote(["r"], 1) == ["r"]
    assert p.admit("late", 1, sampled=True)


def test_sentinels_come_as_rarely_as_their_upkeep_asks():
    """A sentinel makes its whole batch take depth-0 steps instead of dormant ones. Batch 32, depth 0 0.78
    ms, a dormant step 0.73 (the demo pair on an H200): 32 x 0.05 / 0.73 / 0.005 = 438.4, one sentinel per
    439 admissions; batch 1, depth 0 0.24, dormant 0.23 (1 x 0.01 / 0.23 / 0.005 = 8.7): one per
    SENTINEL_EVERY (32); depth 0's catch-up share counts in its upkeep (0.02 ms at batch 1: 26.1, still 32;
    0.2 ms: 1 x 0.21 / 0.23 / 0.005 = 182.6, one per 183)."""
    p = policy_with_costs({1: [0.24, 0.30, 0.36, 0.42], 32: [0.78, 1.0, 1.2, 1.4]}, probe_every=10**9)
    p.observe_dormant_time(1, 0.23, weight=1.0)
    p.observe_dormant_time(32, 0.73, weight=1.0)
    set_acceptance(p, [0.05, 0.05, 0.05])  # (drafting pays nowhere: every admission but a sentinel dormant)
    assert p.sentinel_spacing(32) == 439 and p.sentinel_spacing(1) == 32
    admitted = [p.admit(f"q{i}", 32) for i in range(2 * 439)]
    assert [i for i, a in enumerate(admitted) if not a] == [438, 877]
    p.catch_up_per_step_ms[1] = 0.02
    assert p.sentinel_spacing(1) == 32
    p.catch_up_per_step_ms[1] = 0.2
    assert p.sentinel_spacing(1) == 183


@pytest.mark.parametrize("depth0_observations", [2, 10])
def test_a_cheap_option_timed_in_a_slow_stretch_is_re_timed(depth0_observations):
    """Batch 1 timed online (a CPU): chains of one, two and three at 13.8, 16.9 and 17.0 ms (ten steps each),
    depth 0 at 12.35 ms from two steps in a slow stretch. At acceptance 0.5 the chain of three is chosen
    (1.875 / 17.0 = 0.110 tokens per ms against 1 / 12.35 = 0.081). Depth 0, cheaper and timed fewer than
    TRUSTED_OBSERVATIONS times, is re-run once 16 steps (UNTRUSTED_REFRESH_EVERY) went without it; its 7.5 ms step then
    replaces the cost (a faster step), and depth 0 wins (0.133). Timed ten times, its cost is trusted: no
    refresh comes in those steps (it is 26% under the choice's rate, past REFRESH_MARGIN)."""
    p = DepthPolicy(D, tree=False, probe_every=10**9)
    for shape, ms in zip(p.options, [12.35, 13.8, 16.9, 17.0]):
        for _ in range(depth0_observations if shape.depth == 0 else 10):
            p.observe_time(1, shape, ms)
    set_acceptance(p, [0.5, 0.5, 0.5])
    choices = [p.choose(["r"], 1) for _ in range(17)]
    if depth0_observations == 10:
        assert choices == [DraftShape(3)] * 17
        return
    assert choices[:-1] == [DraftShape(3)] * 16 and choices[-1] == DraftShape(0)
    p.observe_time(1, DraftShape(0), 7.5)
    assert p.cost_ms[(1, DraftShape(0))] == 7.5
    assert p.choose(["r"], 1) == DraftShape(0)


def test_a_new_requests_draft_prefill_is_paid_out_of_what_drafting_saves():
    """Admission weighs the draft's prefill. Costs: depth 0 1.0 ms, a chain of one 1.2 ms; acceptance 0.3
    measured over many steps: a chain of one gives 1.3 / 1.2 = 1.083 tokens per ms, 8% over depth 0.
    Prefill timed at 0.01 ms per token: a batch of 8 whose 64-token prompts are paid back over 64 tokens
    owes 8 * 64 * 0.01 / 64 = 0.08 ms a step, so drafting must beat 1 / 0.92 = 1.087 per ms: it does not
    (dormant). Paid back over 256 tokens it owes 0.02 ms (1 / 0.98 = 1.020): drafts kept."""
    p = policy_with_costs({8: [1.0, 1.2, 1.6, 2.0]}, probe_every=10**9)
    set_acceptance(p, [0.3, 0.0, 0.0])
    assert p.prefill_share_ms(8, 64, 64) == 0.0  # nothing timed yet
    p.observe_draft_prefill(640, 9.0)  # the first (a warm-up) is replaced by the second
    p.observe_draft_prefill(640, 6.4)
    assert p.draft_prefill_ms_per_token == pytest.approx(0.01)
    assert p.prefill_share_ms(8, 64, 64) == pytest.approx(0.08)
    assert not p.admit("long", 8, prompt_tokens=64, max_new_tokens=256)
    assert p.admit("short", 8, prompt_tokens=64, max_new_tokens=64)
    assert not p.admit("no prompt", 8)


def test_a_repeated_depth_0_choice_is_the_one_choose_would_make():
    """`repeat_depth0` skips choose's full pass for a batch that chose depth 0 (policy.REPEAT_DEPTH0_STEPS):
    step for step it must answer what choose answers, probes and refreshes included. At a_1 = 0.2 depth 0
    wins at batch 8 (8 / 1.0 against 9.6 / 1.22 = 7.87 tokens per ms for a chain of one), the chain of one
    within the 5% of a refresh (every 128 steps), and the deepest is probed every 32 steps or, with
    0.9 ms more a step and a 0.5% budget, every 180."""
    costs = {8: [1.0, 1.22, 1.6, 1.9]}
    full, repeated = policy_with_costs(costs), policy_with_costs(costs)
    for p in (full, repeated):
        set_acceptance(p, [0.2, 0.2, 0.2])
    ids = tuple(f"r{i}" for i in range(8))
    passes, chosen = 0, set()
    for step in range(600):
        want = full.choose(ids, 8)
        chosen.add(want.name)
        got = repeated.repeat_depth0(ids, 8)
        if got is None:
            passes += 1
            got = repeated.choose(ids, 8)
        assert got == want, f"step {step}"
        if want.drafts:  # its results, the same for both: position 1 accepted by one row in five
            lens = [2 if (step + i) % 5 == 0 else 1 for i in range(8)]
            for p in (full, repeated):
                p.observe_step(want, list(ids), lens)
    assert chosen == {"chain0", "chain1", "chain3"}  # depth 0, its refreshes and the probes
    assert full._steps[8] == repeated._steps[8] == 600
    # Probes at 180-step intervals and refreshes every 128: about 8 full passes a 64 steps, not 64.
    assert passes < 120
    # Another batch (here: one request fewer) is decided afresh, and so is the same batch once observations
    # came in (here: every draft accepted, so that drafting pays).
    assert repeated.repeat_depth0(ids[:7], 8) is None
    while repeated.choose(ids, 8).drafts:
        pass
    for _ in range(20):
        repeated.observe_step(DraftShape(3), list(ids), [4] * 8)
    assert repeated.repeat_depth0(ids, 8) is None and repeated.choose(ids, 8).drafts


def test_greedy_and_sampled_requests_keep_acceptances_of_their_own():
    """Greedy requests accept far more than sampled ones (the demo pair: 2.4-2.6 tokens a chain of three
    against 1.3 at temperature 1). Each class keeps its own engine-wide rates: here greedy a = 0.9 and
    sampled a = 0.1 at every position, batch 8, costs 1.0 / 1.3 / 1.6 / 1.9 ms at depth 0..3. By hand:
    greedy rows yield 8 x 3.439 / 1.9 = 14.5 tokens per ms at depth 3 against 8 at depth 0; sampled rows
    at best 8 x 1.1 / 1.3 = 6.8 (depth 1), so depth 0, and a new sampled request is admitted dormant
    (the rates are settled) while a new greedy one keeps its draft. One engine-wide rate (0.5 here)
    would treat both alike."""
    p = policy_with_costs({8: [1.0, 1.3, 1.6, 1.9]}, probe_every=10**9)
    greedy, sampled = [f"g{i}" for i in range(8)], [f"s{i}" for i in range(8)]
    for g, s in zip(greedy, sampled):  # before any observation: nobody is dormant
        assert not p.admit(g, 8) and not p.admit(s, 8, sampled=True)
    teach(p, [0.9, 0.9, 0.9], rid="g0")
    teach(p, [0.1, 0.1, 0.1], rid="s0")
    assert p.rates_by_class[False].acceptance[0] > 0.85 and p.rates_by_class[True].acceptance[0] < 0.15
    assert p.choose(greedy, 8) == DraftShape(3)
    assert p.choose(sampled, 8) == DraftShape(0)
    assert p.admit("new sampled", 8, sampled=True) and not p.admit("new greedy", 8)
    # Demotion judges each class at its own rates: only the sampled rows drop their drafts.
    assert sorted(p.demote(greedy + sampled, 8)) == sorted(sampled)


def test_the_prefill_charge_is_what_a_prompt_token_adds_not_a_calls_fixed_part():
    """A prefill call costs a fixed part and a part per token (here 0.5 ms for 128 tokens and 0.6 ms for
    1,024: 0.1 ms over 896 tokens, 1.116e-4 ms a token). Costs at batch 32: depth 0 1.0 ms, a chain of one
    1.2 ms, a_1 = 0.3, so a chain of one gives 1.3 / 1.2 = 1.083 tokens per ms. Charged the slope, a batch
    of 32 whose 128-token prompts are paid back over 96 tokens owes 32 * 128 * 1.116e-4 / 96 = 0.0048 ms a
    step (drafting must beat 1 / 0.9952 = 1.005: drafts kept). At a moving average of each call's time per
    token (the rule before: 0.0021 for these calls) it would owe 0.088 ms (1 / 0.912 = 1.096:
    dormant), the fixed part of the small calls counted once per row."""
    p = policy_with_costs({32: [1.0, 1.2, 1.6, 2.0]}, probe_every=10**9)
    set_acceptance(p, [0.3, 0.0, 0.0])
    for _ in range(20):
        p.observe_draft_prefill(128, 0.5)
        p.observe_draft_prefill(1024, 0.6)
    assert p.draft_prefill_ms_per_token == pytest.approx(0.1 / 896, rel=1e-6)
    assert p.prefill_share_ms(32, 128, 96) == pytest.approx(32 * 128 * (0.1 / 896) / 96, rel=1e-6)
    assert not p.admit("keeps its draft", 32, prompt_tokens=128, max_new_tokens=96)


def test_a_start_up_timing_of_the_draft_prefill_keeps_calls_of_one_size_from_charging_a_burst():
    """The demo pair on an H200: single requests only (128-token calls of 3.1 ms each, a host-bound eager
    prefill) tell nothing of how the time splits into a call's fixed part and a part per token, so the mean
    rate (0.024 ms a token) stood in, and a burst of 32 owed 32 * 128 * 0.024 / 96 = 1.03 ms a step, more
    than its step (0.64 ms): it was admitted dormant, and no draft prefill ran to correct that. Timed at
    start-up at 16 and 512 tokens (3.0 and 3.2 ms: a fixed part of 2.99 ms, 4.0e-4 ms a token), each online
    call's time beyond the fixed part is its per-token part: the burst owes 0.017 ms a step, and drafts."""
    tables = {32: [0.66, 0.89, 0.96, 1.03]}
    p = policy_with_costs(tables, probe_every=10**9)
    p.observe_draft_prefill_startup([(16, 3.0), (512, 3.2)])
    set_acceptance(p, [0.82, 0.6, 0.37])
    slope = 0.2 / 496
    for _ in range(30):
        p.observe_draft_prefill(128, 3.0 + 128 * slope - 16 * slope)
    assert p.draft_prefill_ms_per_token == pytest.approx(slope, rel=1e-3)
    assert p.prefill_share_ms(32, 128, 96) == pytest.approx(32 * 128 * slope / 96, rel=1e-3)
    assert not p.admit("keeps its draft", 32, prompt_tokens=128, max_new_tokens=96)
    # The same calls with no start-up timing: the mean rate, a share past the step, and dormant.
    q = policy_with_costs(tables, probe_every=10**9)
    set_acceptance(q, [0.82, 0.6, 0.37])
    for _ in range(30):
        q.observe_draft_prefill(128, 3.0 + 128 * slope - 16 * slope)
    assert q.prefill_share_ms(32, 128, 96) > 1.0
    assert q.admit("dormant", 32, prompt_tokens=128, max_new_tokens=96)


def test_a_dormant_cost_not_timed_for_a_while_counts_at_no_more_than_its_start_up_timing():
    """Demo pair, batch 8, H200: a chain of one replays in 0.514 ms and position 1 is accepted about 95% of
    the time; dormant steps timed 0.1 ms at start-up but 0.5 ms online in a slow stretch of the host, so
    every online step carries 0.4 ms of host work: the chain of one costs 0.914 (1.95 / 0.914 = 2.13 tokens a
    ms) against the dormant step's 2.0 a ms, and drafts are kept. After DORMANT_STALE_STEPS policy steps there
    without a dormant step, the dormant step counts at 0.1 ms and its host share at nothing (10 a ms against
    the chain's 3.8): the batch is demoted and new requests are admitted dormant; one fresh online timing
    (0.49 ms, 2.03 a ms against 2.15) decides again."""
    from tandem.speculative.policy import DORMANT_STALE_STEPS

    p = policy_with_costs({8: [0.52, 0.514, 0.553, 0.622]}, probe_every=10**9)
    p.observe_dormant_time(8, 0.1, weight=1.0)
    for _ in range(400):
        p.observe_dormant_time(8, 0.5)
    assert p.dormant_cost_ms[8] == pytest.approx(0.5, abs=1e-3)
    teach(p, [0.95, 0.0, 0.0], steps=400)
    assert 0.9 < p.acceptance[0] < 1.0
    rows = [f"r{i}" for i in range(8)]
    for _ in range(DORMANT_STALE_STEPS - 1):
        p.choose(rows, 8)
    assert p.demote(rows, 8) == [] and not p.admit("early", 8)
    p.choose(rows, 8)
    assert p.demote(rows, 8) == rows and p.admit("late", 8)
    p.observe_dormant_time(8, 0.33)
    assert p.dormant_cost_ms[8] == pytest.approx(0.4915, abs=1e-3)
    assert not p.admit("after", 8)


def test_options_carry_the_host_share_learned_from_dormant_steps():
    """A host-bound engine (the demo pair on the H200) with every row dormant: depth 0 never runs, so its
    cost stays at its replay (0.21 ms), as do the chains' (0.40 / 0.48 / 0.60), while the dormant step runs
    online at 0.52 ms (0.21 at start-up: 0.31 ms of host work a step). Priced at replays alone, against a
    dormant step capped at depth 0's replay (4.8 tokens a ms), no chain pays (at acceptance 0.7 / 0.5 / 0.4:
    1.7 / 0.40 = 4.3, 2.05 / 0.48 = 4.3, 2.19 / 0.60 = 3.7 a ms). Online no step runs faster than the
    dormant step's 0.52 ms of host work (a chain of two: 2.05 / 0.52 = 3.9 a ms at most, against the dormant
    step's 1.9): with depth 0 and every option floored there, drafting is kept and new requests draft."""
    tables = {32: [0.21, 0.40, 0.48, 0.60]}
    rows = [f"r{i}" for i in range(32)]
    p = policy_with_costs(tables, probe_every=10**9)
    p.observe_dormant_time(32, 0.21, weight=1.0)
    for _ in range(400):
        p.observe_dormant_time(32, 0.52)
    teach(p, [0.7, 0.5, 0.4], steps=400)
    host = p.dormant_cost_ms[32] - 0.21
    assert 0.30 < host < 0.32
    assert p.depth0_ms(32) == pytest.approx(0.21 + host)
    assert p.dormant_step_ms(32, 0.21) == pytest.approx(p.dormant_cost_ms[32])
    assert p.demote(rows, 32) == [] and not p.admit("new", 32)
    # Negative control: the same tables where online steps take no longer than their replays: dormant.
    q = policy_with_costs(tables, probe_every=10**9)
    q.observe_dormant_time(32, 0.21, weight=1.0)
    for _ in range(400):
        q.observe_dormant_time(32, 0.21)
    teach(q, [0.7, 0.5, 0.4], steps=400)
    assert q.demote(rows, 32) == rows and q.admit("new", 32)


def test_a_first_burst_at_a_batch_size_borrows_the_host_share_of_a_smaller_one():
    """The demo pair on the H200: batches of 8 ran dormant online at 0.52 ms a step against a 0.15 ms replay
    (0.37 ms of host work), and the first burst of 32 arrives, where nothing has run online: replays put depth
    0 and the dormant step at 0.197 ms and the chains at 0.35 / 0.42 / 0.50; each request's draft prefill
    costs its batch 0.064 ms a step (32 rows x 128 prompt tokens x 0.001 ms over 64 new tokens). At replays
    alone the dormant step saves 1 / (0.197 - 0.064) = 7.5 tokens a ms against the chain of three's 2.952 /
    0.50 = 5.9, and the request is admitted dormant. With batch 8's share the dormant step costs 0.567, and
    so does the chain at least: 1.99 against 5.2 tokens a ms, and it keeps its draft."""
    def burst_after_batches_of_8(online_ms):
        p = policy_with_costs({8: [0.15, 0.30, 0.35, 0.42], 32: [0.197, 0.35, 0.42, 0.50]}, probe_every=10**9)
        p.observe_dormant_time(8, 0.15, weight=1.0)
        p.observe_dormant_time(32, 0.197, weight=1.0)
        for _ in range(400):
            p.observe_dormant_time(8, online_ms)
        p.observe_draft_prefill_startup([(16, 0.516), (512, 1.012)])
        set_acceptance(p, [0.8, 0.8, 0.8])
        return p
    p = burst_after_batches_of_8(0.52)
    assert p.host_share_elsewhere(32) == pytest.approx(0.37, abs=1e-3)
    assert p.dormant_step_ms(32, untimed=0.0) == pytest.approx(0.567, abs=1e-3)
    assert p.prefill_share_ms(32, 128, 64) == pytest.approx(0.064, abs=1e-3)
    assert not p.admit("keeps its draft", 32, prompt_tokens=128, max_new_tokens=64)
    assert p.host_share_elsewhere(8) == 0.0  # (only a smaller batch's share is a lower bound)
    # Negative control: batches of 8 that ran online as fast as their replays lend no share: dormant.
    q = burst_after_batches_of_8(0.15)
    assert q.host_share_elsewhere(32) == pytest.approx(0.0, abs=1e-9)
    assert q.admit("dormant", 32, prompt_tokens=128, max_new_tokens=64)


def test_a_dormant_steps_first_online_timing_is_replaced_where_nothing_was_timed_at_start_up():
    """Where nothing was timed at start-up (a CPU), the dormant step's first online time is its warm-up (40
    ms): the second (12) replaces it, then the mean of the steps so far (12.25, then 12.0). Where the start-up
    timing exists, online steps move it by the moving average alone, clipped at OUTLIER_RATIO (0.1 ms, then
    0.5 online: 0.1 + 0.05 * (0.125 - 0.1))."""
    p = policy_with_costs({1: [10.0, 20.0, 25.0, 26.0]})
    for ms, expected in ((40.0, 40.0), (12.0, 12.0), (12.5, 12.25), (11.5, 12.0)):
        p.observe_dormant_time(1, ms)
        assert p.dormant_cost_ms[1] == pytest.approx(expected)
    p.observe_dormant_time(8, 0.1, weight=1.0)
    p.observe_dormant_time(8, 0.5)
    assert p.dormant_cost_ms[8] == pytest.approx(0.10125)


def test_a_dormant_step_timed_only_at_start_up_moves_with_depth_0s_online_cost():
    """The H200 case worked out (demo pair, greedy, batch 32, every batch holding a sentinel, so no dormant
    step runs online): graph replays put depth 0 at 0.22 ms and a dormant step at 0.2, but the host-bound
    online steps take 0.6 / 0.7 / 0.8 / 0.9 ms at depth 0..3. At a = 0.8 a chain of three yields 2.952
    tokens (3.28 a ms). Against the replay (5 a ms) drafting would never pay; the dormant step counts at
    0.2 * 0.6 / 0.22 = 0.545 ms (1.83 a ms), so the request keeps its draft. Its first online timing (0.55)
    moves that estimate, not the replay, by the moving average."""
    p = policy_with_costs({32: [0.22, 0.30, 0.38, 0.46]}, probe_every=10**9)
    p.observe_dormant_time(32, 0.2, weight=1.0)
    for _ in range(400):
        for shape, ms in zip(p.options, (0.6, 0.7, 0.8, 0.9)):
            p.observe_time(32, shape, ms)
    assert [p.cost_ms[(32, s)] for s in p.options] == pytest.approx([0.6, 0.7, 0.8, 0.9], abs=1e-3)
    set_acceptance(p, [0.8, 0.8, 0.8])
    assert p.dormant_step_ms(32, untimed=0.0) == pytest.approx(0.2 * 0.6 / 0.22, rel=1e-3)
    assert not p.admit("keeps its draft", 32)
    p.observe_dormant_time(32, 0.55)
    assert p.dormant_cost_ms[32] == pytest.approx(0.5454 + 0.05 * (0.55 - 0.5454), abs=1e-3)
    assert not p.admit("still keeps it", 32)


def test_a_dormant_step_counts_at_no_more_than_a_depth_0_step():
    """The CPU case (nothing timed at start-up, batch 1): depth 0..3 cost 6.0 / 11.6 / 13.9 / 15.3 ms online,
    and one slow run left the dormant step at 7.1 ms. At a = 0.7, 0.64, 0.66 the best drafting option is the
    chain of three, 2.4437 tokens in 15.3 ms (0.1597 a ms): more than a 7.1 ms dormant step's 0.1408, less
    than a depth-0 step's 0.1667. A dormant step does a subset of a depth-0 step's work, so it counts at 6.0
    ms: the request is admitted dormant."""
    p = DepthPolicy(D, tree=False, probe_every=10**9)
    for _ in range(3):  # (the first online timing is a warm-up, replaced by the second)
        for shape, ms in zip(p.options, (6.0, 11.6, 13.9, 15.3)):
            p.observe_time(1, shape, ms)
        p.observe_dormant_time(1, 7.1)
    assert p.dormant_cost_ms[1] == pytest.approx(7.1)
    set_acceptance(p, [0.7, 0.64, 0.66])
    assert p.dormant_step_ms(1, untimed=0.0) == pytest.approx(6.0)
    assert p.admit("dormant", 1)


def test_a_batch_job_is_judged_by_what_its_size_made_before():
    """Costs 8.56 / 13.1 / 16.9 / 18.5 ms at batch 4 (the demo pair's on a CPU), a dormant row 8.56, engine-wide
    acceptance 0.7 (settled). Eight finished requests of one prompt run alone made a_1 = 0.7 (14 of 20, none
    deeper: [1, 1.7, 1.7, 1.7]). Then a batch of four; its rows make a_1 = 0.7, 0.65, 0.6 and 0.4 (8 of 20).
    Among the twelve finished requests the 1/5 quantile (index 12 // 5 = 2) is 1.65 at a chain of one:
    1.65 / 13.1 = 0.126 per ms against the dormant row's 1 / 8.56 = 0.117, drafting kept. Where the four
    were admitted together as a batch job (a cohort), their slowest row made 1.4: 1.4 / 13.1 = 0.107, so the
    next request joining a batch job of four is admitted dormant; where they joined a batch that a queue
    refills (no cohort), the quantile decides. A request joining a batch of one is still judged at the
    median of the finished requests (1.7)."""

    def policy_after(batch_job: bool) -> DepthPolicy:
        p = policy_with_costs({1: [8.56, 13.1, 16.9, 18.5], 4: [8.56, 13.1, 16.9, 18.5]}, probe_every=10**9)
        p.observe_dormant_time(4, 8.56, weight=1.0)
        p.observe_dormant_time(1, 8.56, weight=1.0)

        def run(rid, hits):  # 20 verify steps at a chain of three: `hits` accept position 1, none deeper
            p.observe_step(DraftShape(3), [rid] * 20, [2] * hits + [1] * (20 - hits))
            set_acceptance(p, [0.7, 0.7, 0.7])

        for n in range(8):
            assert not p.admit(f"alone{n}", 1, finish_together=True)
            p.choose([f"alone{n}"], 1)
            run(f"alone{n}", 14)
            p.forget([f"alone{n}"])
        rows = {"r0": 14, "r1": 13, "r2": 12, "r3": 8}
        for rid in rows:
            assert not p.admit(rid, 4, finish_together=batch_job)
        p.choose(list(rows), 4)
        for rid, hits in rows.items():
            run(rid, hits)
        p.forget(["r0", "r1"])
        p.forget(["r3"])
        if batch_job:  # (r2 still runs: the cohort is not done, the quantile decides)
            assert p.slowest_row_expected(4, False) == pytest.approx([1.0, 1.7, 1.7, 1.7])
        p.forget(["r2"])
        return p

    job, refilled = policy_after(batch_job=True), policy_after(batch_job=False)
    assert job.slowest_row_expected(4, False) == pytest.approx([1.0, 1.4, 1.4, 1.4])
    assert refilled.slowest_row_expected(4, False) == pytest.approx([1.0, 1.65, 1.65, 1.65])
    assert job.admit("next batch job", 4, finish_together=True)
    assert not refilled.admit("next batch job", 4, finish_together=True)
    assert not job.admit("refilled batch", 4)  # (not a batch job: the engine's rates, 1.7 / 13.1 = 0.130)
    assert job.slowest_row_expected(1, False) == pytest.approx([1.0, 1.7, 1.7, 1.7])
    assert not job.admit("alone again", 1, finish_together=True)


def test_a_running_request_is_demoted_by_its_own_rates_once_it_has_them():
    """The demo pair alone on a fast-host H200, as bench/policy_clock.py models it: online costs 0.303 /
    0.427 / 0.497 / 0.566 ms at depth 0..3, a dormant step 0.223. The class's rates, 0.8 / 0.6 / 0.5, come
    mostly from the late, repetitive part of answers: at them a chain of two gives 2.28 / 0.497 = 4.59 tokens
    a ms against the dormant step's 4.48, so drafting looks worth keeping. The request's own 16 steps at a
    chain of two accepted position 1 six times and position 2 three times of six: about 1.56 tokens a step,
    3.1 a ms at best, and it is demoted. Control: a request whose own steps accepted position 1 fourteen
    times keeps its draft; and one with no steps of its own is judged at the class's rates, as before."""
    def policy_after(hits1: int, hits2: int) -> DepthPolicy:
        p = policy_with_costs({1: [0.303, 0.427, 0.497, 0.566]}, probe_every=10**9)
        p.observe_dormant_time(1, 0.223, weight=1.0)
        lens = [1] * (16 - hits1) + [2] * (hits1 - hits2) + [3] * hits2
        p.observe_step(DraftShape(2), ["r"] * 16, lens)
        set_acceptance(p, [0.8, 0.6, 0.5])
        return p

    assert policy_after(6, 3).demote(["r"], 1) == ["r"]
    assert policy_after(14, 10).demote(["r"], 1) == []
    assert policy_after(6, 3).demote(["fresh"], 1) == []


def test_where_depth_0_and_the_dormant_step_disagree_the_one_timed_last_is_believed():
    """The demo pair at batch 32 on an H200 (policy-trace-demo-h200-414a194.json): replays 0.2506 / 0.4592 /
    0.5191 / 0.6093 ms at depth 0..3, the dormant step's 0.2301. In a faster stretch of the host depth 0 ran
    online at 0.30 ms for 12 steps (within OUTLIER_RATIO of its replay: a cost of 0.279). Then a batch ran
    dormant at 0.86 ms a step (the host's work: it replaces the replay). Greedy acceptance 0.586 / 0.722 /
    0.826 (2.36 tokens at depth 3). With the dormant step capped at depth 0's older cost it saves 1 / 0.279 =
    3.58 tokens a ms against a chain of three's 2.36 / 0.86 = 2.74, and each new request was admitted dormant.
    Believing the newer timing, depth 0 counts at the dormant step's 0.86 as every option does, and the
    request drafts. Control: depth 0 run again after the dormant steps (another faster stretch) at 0.26 ms is
    believed in turn and caps the dormant step (1 / 0.267 = 3.75 a ms against 2.74): dormant."""
    d0 = DraftShape(0)
    p = policy_with_costs({32: [0.2506, 0.4592, 0.5191, 0.6093]}, probe_every=10**9)
    p.observe_dormant_time(32, 0.2301, weight=1.0)
    set_acceptance(p, [0.586, 0.722, 0.826])
    for _ in range(12):
        p._count_step(32, d0, 1)  # (depth-0 steps, as `choose` counts them)
        p.observe_time(32, d0, 0.30)
    assert p.cost_ms[(32, d0)] == pytest.approx(0.279, abs=1e-3)
    for _ in range(96):
        p.observe_dormant_time(32, 0.86)
    assert p.host_bound_ms(32) == pytest.approx(0.86)
    assert p.depth0_ms(32) == pytest.approx(0.86)
    assert p.dormant_step_ms(32, 0.0) == pytest.approx(0.86)
    assert not p.admit("new", 32)
    for _ in range(20):
        p._count_step(32, d0, 1)
        p.observe_time(32, d0, 0.26)
    assert p.depth0_ms(32) == pytest.approx(0.267, abs=1e-3)
    assert p.dormant_step_ms(32, 0.0) == pytest.approx(p.depth0_ms(32))
    assert p.admit("after", 32)


def test_online_steps_well_beyond_a_replay_replace_it_and_one_alone_is_a_stall():
    """The demo pair at batch 32 on an H200: depth 0 replays in 0.2506 ms, and every online step takes 0.86
    (launches, scheduling and the results' copy: the host's work, which a replay leaves out). Two such
    steps in a row (REPLAY_DISAGREEMENTS) replace the replay; clipped at OUTLIER_RATIO times the cost so far
    instead, the cost rose 1.25% a step (0.307 after 12 steps) and priced depth 0, and the dormant step
    capped at it, at a third of what they took. One step beyond it between steps that agree with the replay
    is a stall and is clipped (the cost stays within 1.25x of the replay), and a fall back to device time
    later is followed as any fall is. The dormant step's own replay is replaced the same way."""
    d0 = DraftShape(0)
    p = policy_with_costs({32: [0.2506, 0.4592, 0.5191, 0.6093]}, probe_every=10**9)
    p.observe_dormant_time(32, 0.2301, weight=1.0)
    p.observe_time(32, d0, 0.86)
    assert p.cost_ms[(32, d0)] < 0.26  # (one step: perhaps a stall)
    p.observe_time(32, d0, 0.86)
    assert p.cost_ms[(32, d0)] == pytest.approx(0.86)
    for _ in range(200):
        p.observe_time(32, d0, 0.25)
    assert p.cost_ms[(32, d0)] == pytest.approx(0.25, abs=1e-3)
    p.observe_dormant_time(32, 0.86)
    p.observe_dormant_time(32, 0.86)
    assert p.dormant_cost_ms[32] == pytest.approx(0.86)
    # Control: a stall between steps that agree with the replay is clipped, and the replay stands.
    q = policy_with_costs({32: [0.2506, 0.4592, 0.5191, 0.6093]}, probe_every=10**9)
    for ms in (0.26, 0.86, 0.26, 0.86, 0.26):
        q.observe_time(32, d0, ms)
    assert q.cost_ms[(32, d0)] < 0.2506 * 1.25


def test_a_first_burst_borrows_the_host_share_from_depth_0_or_from_a_dormant_step_gone_stale():
    """The demo pair on an H200 (policy-trace-demo-h200-414a194.json): batch 1's requests all drafted, so its
    dormant step never ran online, but depth 0 did, at 0.33 ms against its 0.2164 ms replay. The first burst
    of 8 then arrives: replays 0.2155 / 0.4179 / 0.5047 / 0.5402 ms, the dormant step's 0.2164; greedy
    acceptance 0.817 / 0.593 / 0.418 (2.503 tokens at depth 3); each request's draft prefill costs its batch
    0.0114 ms a step (8 rows x 128 tokens x 0.00107 ms over 96). At replays alone the dormant step saves
    1 / (0.2164 - 0.0114) = 4.88 tokens a ms against the chain of three's 2.503 / 0.5402 = 4.63: every request
    of the record's first batch of 8 went dormant, where fixed depth decoded 1.56x plain. With batch 1's share
    from depth 0 (0.114 ms) the dormant step counts 0.330, 1 / 0.319 = 3.1 a ms: the request drafts. The same
    holds for a share learned from dormant steps at batch 1 that went stale since (DORMANT_STALE_STEPS policy
    steps of drafting there: the dormant step's own cost falls back to its replay, its share elsewhere stays).
    Control: depth 0 at batch 1 online as fast as its replay lends no share, and the burst goes dormant."""
    from tandem.speculative.policy import DORMANT_STALE_STEPS

    def burst(depth0_online_ms=None, dormant_online_ms=None):
        p = policy_with_costs({1: [0.2164, 0.3886, 0.452, 0.5147], 8: [0.2155, 0.4179, 0.5047, 0.5402]},
                              probe_every=10**9)
        p.observe_dormant_time(1, 0.1987, weight=1.0)
        p.observe_dormant_time(8, 0.2164, weight=1.0)
        p.observe_draft_prefill_startup([(16, 0.5), (512, 0.5 + 496 * 0.0114 * 96 / 1024)])
        if depth0_online_ms is not None:
            for _ in range(400):
                p.observe_time(1, DraftShape(0), depth0_online_ms)
        if dormant_online_ms is not None:
            for _ in range(400):
                p.observe_dormant_time(1, dormant_online_ms)
            set_acceptance(p, [0.817, 0.593, 0.418])
            for _ in range(DORMANT_STALE_STEPS):
                p.choose(["a"], 1)
            assert p.host_bound_ms(1) == pytest.approx(0.1987)  # (stale at its own batch)
        set_acceptance(p, [0.817, 0.593, 0.418])
        assert p.prefill_share_ms(8, 128, 96) == pytest.approx(0.0114, abs=1e-4)
        return p

    p = burst(depth0_online_ms=0.33)
    assert p.host_share_elsewhere(8) == pytest.approx(0.114, abs=2e-3)
    assert p.dormant_step_ms(8, 0.0) == pytest.approx(0.330, abs=2e-3)
    assert not p.admit("drafts", 8, prompt_tokens=128, max_new_tokens=96)
    stale = burst(dormant_online_ms=0.33)
    assert stale.host_share_elsewhere(8) == pytest.approx(0.131, abs=2e-3)
    assert not stale.admit("drafts", 8, prompt_tokens=128, max_new_tokens=96)
    q = burst(depth0_online_ms=0.2164)
    assert q.host_share_elsewhere(8) == pytest.approx(0.0, abs=1e-6)
    assert q.admit("dormant", 8, prompt_tokens=128, max_new_tokens=96)


def test_a_drafting_cost_from_its_replay_is_floored_at_the_host_bound_step_until_it_runs_online():
    """Start-up timings at batch 32 (the demo pair's graph replays on an H200): 0.2145 / 0.4466 / 0.4997 /
    0.6001 ms at depth 0..3. Online, depth 0 and the dormant step take 0.6600 ms (the host's work, which a
    replay leaves out); the chains never ran online. Sampled requests accept a_1 = a_2 = a_3 = 0.2 (settled).
    No online step runs faster than the dormant step's host work, so each chain counts at 0.66 ms at least:
    a chain of one promises 1.2 / 0.66 = 1.82 tokens per ms against the dormant row's 1 / 0.66 = 1.52, and
    drafting is tried. Once the chains ran online at 0.85 / 0.90 / 0.98 ms (device and host work, and the
    draft's own host work besides), they give 1.2 / 0.85 = 1.41, 1.24 / 0.90 = 1.38 and 1.248 / 0.98 = 1.27,
    all under 1.52: admitted dormant, and a drafting batch chooses depth 0."""
    p = policy_with_costs({32: [0.2145, 0.4466, 0.4997, 0.6001]}, probe_every=10**9)
    p.cost_ms[(32, DraftShape(0))] = 0.66  # (as many online steps at 0.66 would leave it)
    p.observe_dormant_time(32, 0.2, weight=1.0)
    for _ in range(400):
        p.observe_dormant_time(32, 0.66)
    set_acceptance(p, [0.2, 0.2, 0.2], sampled=True)
    costs = p._floored_costs(32)
    assert [costs[s] for s in p.options] == pytest.approx([0.66, 0.66, 0.66, 0.66], abs=1e-4)
    assert not p.admit("tried", 32, sampled=True)
    for _ in range(400):
        for shape, ms in zip(p.options[1:], (0.85, 0.90, 0.98)):
            p.observe_time(32, shape, ms)
    assert p.admit("sampled", 32, sampled=True)
    rows = [f"r{i}" for i in range(32)]
    for rid in rows:
        p.sampled.add(rid)
    assert p.choose(rows, 32) == DraftShape(0)


def test_the_floor_is_the_longer_of_device_and_host_work_not_their_sum():
    """The demo pair on the H200, greedy, batch 32: a chain of three replays in 0.6071 ms, a dormant step in
    0.197 ms and online in 0.742 (0.545 ms of host work); the chain ran online, in a fixed-depth engine, in
    0.866 ms: device and host work overlap. Greedy requests accept a = 0.35, 0.5, 0.5 (1.6125 tokens at
    depth 3), and a new request's draft prefill costs its batch 0.1 ms a step (32 rows x 128 tokens x
    0.00234 ms over 96). Priced at replay plus host share (1.152 ms), the best chain gives 1.525 / 1.055 =
    1.445 tokens per ms against the dormant step's 1 / (0.742 - 0.1) = 1.558: dormant, where the chain at its
    real 0.866 ms (1.86 a ms) decodes faster. At the longer of the two (0.742 ms) it drafts, as at 0.866."""
    def engine(chain_online_ms=None):
        p = policy_with_costs({32: [0.2465, 0.437, 0.5103, 0.6071]}, probe_every=10**9)
        p.observe_dormant_time(32, 0.197, weight=1.0)
        for _ in range(400):
            p.observe_dormant_time(32, 0.742)
        p.observe_draft_prefill_startup([(16, 0.5375), (512, 1.7)])
        set_acceptance(p, [0.35, 0.5, 0.5])
        if chain_online_ms is not None:
            for _ in range(400):
                for shape in p.options[1:]:
                    p.observe_time(32, shape, chain_online_ms)
        return p
    p = engine()
    assert p.prefill_share_ms(32, 128, 96) == pytest.approx(0.1, abs=1e-3)
    assert p._floored_costs(32)[p.options[3]] == pytest.approx(0.742, abs=1e-3)
    assert not p.admit("drafts", 32, prompt_tokens=128, max_new_tokens=96)
    assert not engine(0.866).admit("drafts", 32, prompt_tokens=128, max_new_tokens=96)
    # Negative control: where the chains ran online at 1.2 ms (1.525 / 1.2 = 1.27 a ms at best), dormant.
    slow = engine(1.2)
    assert slow.admit("dormant", 32, prompt_tokens=128, max_new_tokens=96)


def test_each_sampling_mode_is_judged_at_its_own_cost_table():
    """Start-up timings at batch 32 in two sampling modes (the demo pair's steps cost more with the sampler's
    work on a host-bound H200): greedy steps 0.20 / 0.22 / 0.26 / 0.30 ms at depth 0..3 and 0.19 for a
    dormant step, sampled ones 0.50 / 0.62 / 0.70 / 0.78 and 0.45. Sampled requests accept a_1 = a_2 = a_3
    = 0.3 (settled): 1.3 / 1.39 / 1.417 expected tokens at depth 1..3. Stepping greedy, a chain of one gives
    1.3 / 0.22 = 5.91 tokens per ms against a dormant row's 1 / 0.19 = 5.26: drafting kept. Stepping
    sampled, the chains give 1.3 / 0.62 = 2.10, 1.39 / 0.70 = 1.99 and 1.417 / 0.78 = 1.82 against
    1 / 0.45 = 2.22: dormant. Weighed at the greedy table, the sampled requests would keep drafting. An
    online step in one mode leaves the other mode's table as it was."""
    p = DepthPolicy(D, tree=False, probe_every=10**9)
    for mode, row, dormant in (("greedy", [0.20, 0.22, 0.26, 0.30], 0.19), ("sampled", [0.50, 0.62, 0.70, 0.78], 0.45)):
        for shape, ms in zip(p.options, row):
            p.observe_time(32, shape, ms, weight=1.0, mode=mode)
        p.observe_dormant_time(32, dormant, weight=1.0, mode=mode)
    set_acceptance(p, [0.3, 0.3, 0.3], sampled=True)
    assert not p.admit("g", 32, sampled=True, mode="greedy")
    assert p.admit("s", 32, sampled=True, mode="sampled")
    rows = [f"r{i}" for i in range(32)]
    p.sampled.update(rows)
    assert p.demote(rows, 32, mode="greedy") == []
    assert p.demote(rows, 32, mode="sampled") == rows
    p.observe_time(32, DraftShape(1), 0.9, mode="sampled")
    assert p.cost_row(32)["chain1"] == pytest.approx(0.22)
    assert p.cost_row(32, "sampled")["chain1"] > 0.62

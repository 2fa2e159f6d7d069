"""Adaptive speculation end to end: whatever depth each step drafts, greedy output is plain greedy output
and seeded sampled output is plain seeded output. A stand-in policy cycles through every option (chains
of depth 0..num_steps, and the tree) so every shape runs, for every draft kind, chain and tree
configurations, overlap on and off, under the stream-order checker; then the real policy, which must
settle on the full depth when every draft is accepted (the target drafting for itself)."""

import pytest

from tandem import Engine, SamplingParams
from tandem.speculative.policy import DepthPolicy, cost_table
from tests.speculative.conftest import CHAIN, ENGINE, TREE
from tests.speculative.scripted_policy import ScriptedChoice
from tests.speculative.test_seeded_speculative import BATCH, params_mix, plain_seeded  # noqa: F401 (fixture)
from tests.speculative.test_spec_greedy import NEW_TOKENS, PROMPTS, reference  # noqa: F401 (fixture)


class CyclingPolicy(ScriptedChoice):
    """Every option in turn, whatever the costs: coverage, not speed."""

    def script(self, **engine_says):
        return self.options[self.turn % len(self.options)]


def engine(spec_models, kind, shape, **extra):
    alg = "STANDALONE" if kind == "SELF" else kind
    e = Engine(spec_models["target"], speculative_algorithm=alg, speculative_draft_model_path=spec_models[kind],
               **shape, **{**ENGINE, **extra})
    e.runner.spec.policy = CyclingPolicy(e.runner.spec.policy)
    return e


def greedy():
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3", "STANDALONE"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_every_depth_keeps_greedy_output(spec_models, reference, kind, shape, overlap, monkeypatch):
    from tests.speculative.test_streams import RecordingDeviceModule

    monkeypatch.setenv("TANDEM_STREAM_CHECK", "1")
    with engine(spec_models, kind, shape, disable_overlap_schedule=not overlap,
                _runner_hooks={"device_module": RecordingDeviceModule()}) as e:
        outs = e.generate(input_ids=PROMPTS[:12], sampling_params=greedy())
        for i, (out, want) in enumerate(zip(outs, reference)):
            assert out.token_ids == want, f"{kind}: prompt {i} differs"
        stats = e.runner.spec.stats
        steps_by_depth = stats.steps_by_depth
        assert len(steps_by_depth) == shape["speculative_num_steps"] + 1 and all(steps_by_depth), steps_by_depth
        assert stats.num_drafts == sum(len(o.spec_accept_lengths) for o in outs)
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total


def test_every_depth_keeps_seeded_output(spec_models, plain_seeded):
    with engine(spec_models, "EAGLE3", TREE) as e:
        outs = e.generate(input_ids=BATCH, sampling_params=params_mix())
    assert [o.token_ids for o in outs] == plain_seeded


def test_every_depth_through_emulated_graphs(spec_models, reference, monkeypatch):
    """A whole-iteration graph per sampling kind and draft shape: each shape's greedy graph replays."""
    from tests.speculative.test_cuda_graph_padding import record_padded_sizes

    monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")
    with engine(spec_models, "EAGLE3", TREE, cuda_graph_max_bs=16) as e:
        phases = e.runner.spec.phases
        sizes = {name: record_padded_sizes(g) for name, g in phases.graphs.items()}
        outs = e.generate(input_ids=PROMPTS[:12], sampling_params=greedy())
        assert [o.token_ids for o in outs] == reference[:12]
        options = e.runner.spec.policy.options
    for shape in options:
        assert sizes[f"iteration:greedy:{shape.name}"], f"{shape.name}: its graph never ran"
    assert sizes["catch_up"], "no step after a depth-0 step replayed the draft catch-up graph"


def test_real_policy_drafts_full_depth_when_every_draft_is_accepted(spec_models, reference, monkeypatch):
    """The target drafting for itself: every draft is accepted. Its drafts cost a whole target forward
    each on a CPU, so the measured costs would (rightly) make depth a toss-up; a GPU-like cost table
    (drafts cheap next to the verify) is installed and frozen, and the real acceptance observations
    must lead the policy to the full depth."""
    monkeypatch.setattr(DepthPolicy, "observe_time", lambda self, bs, shape, ms, weight=None, mode="greedy": None)
    with Engine(spec_models["target"], speculative_algorithm="STANDALONE", speculative_draft_model_path=spec_models["SELF"],
                speculative_adaptive=True, **CHAIN, **ENGINE) as e:
        policy = e.runner.spec.policy
        for bs in range(1, 5):
            for shape in policy.options:
                policy.cost_ms[(bs, shape)] = 1.0 + 0.1 * shape.depth
        outs = e.generate(input_ids=PROMPTS[:4], sampling_params=SamplingParams(
            max_new_tokens=60, temperature=0.0, ignore_eos=True))
        assert [o.token_ids[:NEW_TOKENS] for o in outs] == reference[:4]
        steps = e.runner.spec.stats.steps_by_depth
    # Every observation was an accept: the averages climb from the prior (0.6) towards 1.
    assert all(a > 0.7 for a in policy.acceptance), policy.acceptance
    # Full depth throughout, but for a last step or two where fewer tokens remain than a chain of 3 yields.
    assert steps[3] > 0 and not steps[0] and sum(steps[1:3]) <= 3, steps


@pytest.mark.parametrize("off", [False, "off"])
def test_adaptive_off_drafts_the_configured_depth_only(spec_models, off):
    with Engine(spec_models["target"], speculative_algorithm="EAGLE3", speculative_draft_model_path=spec_models["EAGLE3"],
                speculative_adaptive=off, **CHAIN, **ENGINE) as e:
        e.generate(input_ids=PROMPTS[:4], sampling_params=greedy())
        assert e.runner.spec.policy is None
        steps = e.runner.spec.stats.steps_by_depth
    assert steps[3] > 0 and not any(steps[:3])


@pytest.mark.parametrize("bad", ["maybe", 1, None])
def test_bad_adaptive_value_is_refused(spec_models, bad):
    with pytest.raises(ValueError, match="speculative_adaptive must be True or False"):
        Engine(spec_models["target"], speculative_algorithm="EAGLE3", speculative_draft_model_path=spec_models["EAGLE3"],
               speculative_adaptive=bad, **CHAIN, **ENGINE)


def test_each_steps_time_lands_in_its_sampling_modes_cost_table(spec_models, monkeypatch):
    """Greedy, temperature-1 and penalised requests step with different sampler work (on an H200's host-bound
    demo pair 0.5 to 1.3 ms for the same batch), so the worker hands the policy each step's time under the
    mode its requests' sampling parameters name (`step_mode`), and nothing else: a greedy batch's steps
    under "greedy", a temperature-1 batch's under "sampled", a batch with a repetition penalty under every
    sampling stage's, and a mixed batch under the dearest of its rows' while both run (one may finish
    first: the steps of the other alone are its own mode's)."""
    modes = []  # (padded batch, mode) of every timed step
    for method in ("observe_time", "observe_dormant_time"):  # (a step of dormant rows alone: the latter)
        real = getattr(DepthPolicy, method)
        monkeypatch.setattr(DepthPolicy, method, lambda self, bs, *a, mode="greedy", real=real, **k: (
            modes.append((bs, mode)), real(self, bs, *a, mode=mode, **k))[1])
    runs = {"greedy": [dict(temperature=0.0)] * 2, "sampled": [dict(temperature=1.0, seed=1)] * 2,
            "sampled+penalties+logprobs20": [dict(temperature=1.0, seed=2, repetition_penalty=1.2)] * 2,
            "mixed": [dict(temperature=0.0), dict(temperature=1.0, seed=3)]}
    with Engine(spec_models["target"], speculative_algorithm="EAGLE3", speculative_draft_model_path=spec_models["EAGLE3"],
                **CHAIN, **ENGINE) as e:
        policy = e.runner.spec.policy
        for name, kinds in runs.items():
            modes.clear()
            e.generate(input_ids=PROMPTS[:2], sampling_params=[SamplingParams(max_new_tokens=24, ignore_eos=True, **k)
                                                               for k in kinds])
            expected = "sampled" if name == "mixed" else name
            both = {mode for bs, mode in modes if bs == 2}  # (steps of both rows; no graphs: unpadded)
            assert both == {expected}, (name, set(modes))
            if name != "mixed":
                assert {mode for _, mode in modes} == {expected}, (name, set(modes))
            assert policy.cost_row(2, expected) or cost_table(2, expected) in policy.dormant_cost_ms, name
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total


def test_prefill_first_is_on_with_speculation_unless_told(spec_models):
    """auto: prompt-only admission steps with speculation (a decode row beside prompts costs the verify
    pass of its own), mixed steps without; on/off say so; anything else is refused."""
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=spec_models["EAGLE3"], **CHAIN, **ENGINE)
    with Engine(spec_models["target"], **spec) as e:
        assert e.scheduler.config.prefill_first
    with Engine(spec_models["target"], prefill_first="off", **spec) as e:
        assert not e.scheduler.config.prefill_first
    with Engine(spec_models["target"], **ENGINE) as e:
        assert not e.scheduler.config.prefill_first
    with Engine(spec_models["target"], prefill_first="on", **ENGINE) as e:
        assert e.scheduler.config.prefill_first
    with pytest.raises(ValueError, match="prefill_first must be auto, on or off"):
        Engine(spec_models["target"], prefill_first="sometimes", **ENGINE)


class DormantHalfPolicy(CyclingPolicy):
    """CyclingPolicy that admits every other request dormant (no draft state), whatever the costs."""

    def __init__(self, base: DepthPolicy):
        super().__init__(base)
        self.admits = 0

    def admit(self, request_id, padded_batch, *_, **__):
        self.dormant.discard(request_id)
        self.admits += 1
        if self.admits % 2:
            self.dormant.add(request_id)
        return self.admits % 2 == 1


@pytest.mark.parametrize("kind", ["EAGLE3", "STANDALONE"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_dormant_requests_keep_greedy_output_and_get_no_draft_work(spec_models, reference, kind, graphs,
                                                                    monkeypatch):
    """Half the requests dormant, every shape in turn: outputs stay plain greedy output; the draft's
    prefill and catch-ups never run on a dormant request's row (they keep no draft state)."""
    from tests.speculative.test_streams import RecordingDeviceModule

    monkeypatch.setenv("TANDEM_STREAM_CHECK", "1")
    if graphs:
        monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")
    extra = {"cuda_graph_max_bs": 16} if graphs else {"_runner_hooks": {"device_module": RecordingDeviceModule()}}
    with engine(spec_models, kind, CHAIN, **extra) as e:
        spec = e.runner.spec
        spec.policy = DormantHalfPolicy(spec.policy)
        pool, policy = spec.pool, spec.policy
        seen = {"prefill": 0, "catch_up": 0, "dormant": 0}
        real_prefill, real_catch_up = spec.drafter.prefill, spec.phases.catch_up

        def dormant_slots():
            seen["dormant"] = max(seen["dormant"], len(policy.dormant))
            return {pool.slot(rid) for rid in policy.dormant}

        def prefill(feeds, *args):
            seen["prefill"] += 1
            assert not {f.slot for f in feeds} & dormant_slots(), "a dormant request's prompt went to the draft"
            return real_prefill(feeds, *args)

        def catch_up(slots, *args):
            seen["catch_up"] += 1
            assert not set(slots.tolist()) & dormant_slots(), "a catch-up ran on a dormant request's row"
            return real_catch_up(slots, *args)

        monkeypatch.setattr(spec.drafter, "prefill", prefill)
        monkeypatch.setattr(spec.phases, "catch_up", catch_up)
        outs = e.generate(input_ids=PROMPTS[:12], sampling_params=greedy())
        for i, (out, want) in enumerate(zip(outs, reference)):
            assert out.token_ids == want, f"{kind}: prompt {i} differs"
        assert seen["dormant"] and seen["catch_up"] and seen["prefill"], seen
        assert spec.stats.steps_by_depth[0] and spec.stats.steps_by_depth[3]
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total


def test_real_policy_admits_requests_dormant_once_drafting_stops_paying(spec_models, monkeypatch):
    """Synthetic acceptance 0 (BENCHMARK ONLY coins: nothing is ever accepted) and a frozen GPU-like cost
    table (depth d costs 1 + 0.3 d ms): the first wave teaches the policy that drafts never pay (four
    requests leave depth 0 after two drafting steps: 8 observations of position 1, too few to rule out
    a_1 = 0.3, where a chain of one would pay). Then drafting is made dearer (1 + 0.8 d ms: it pays only
    at a_1 > 0.8, which those 8 rejections rule out); in the second wave, the real `admit` makes every
    request dormant but each eighth (a sentinel), and those never reach the draft's prefill."""
    from tandem.bench import synthetic
    from tandem.speculative import policy as policy_module

    SENTINEL_EVERY = 8  # (the engine's is 32: fewer prompts this way)
    monkeypatch.setattr(policy_module, "SENTINEL_EVERY", SENTINEL_EVERY)

    monkeypatch.setattr(DepthPolicy, "observe_time", lambda self, bs, shape, ms, weight=None, mode="greedy": None)
    with Engine(spec_models["target"], speculative_algorithm="EAGLE3", speculative_draft_model_path=spec_models["EAGLE3"],
                **CHAIN, **ENGINE) as e:
        spec = e.runner.spec
        policy = spec.policy
        for bs in range(1, 17):
            for shape in policy.options:
                policy.cost_ms[(bs, shape)] = 1.0 + 0.3 * shape.depth
        synthetic.install(e, 0.0)
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        e.generate(input_ids=PROMPTS[:4], sampling_params=params)
        assert policy.acceptance[0] < 0.1, policy.acceptance
        assert not policy.admit("too early to tell", 4)
        for bs in range(1, 17):
            for shape in policy.options:
                policy.cost_ms[(bs, shape)] = 1.0 + 0.8 * shape.depth
        admitted = []
        real_admit = policy.admit
        monkeypatch.setattr(policy, "admit", lambda rid, padded, *a, **k:
                            admitted.append(real_admit(rid, padded, *a, **k)) or admitted[-1])
        fed = []
        real_prefill = spec.drafter.prefill
        monkeypatch.setattr(spec.drafter, "prefill", lambda feeds, *a: fed.extend(feeds) or real_prefill(feeds, *a))
        outs = e.generate(input_ids=PROMPTS[:2 * SENTINEL_EVERY], sampling_params=params)
        assert all(len(o.token_ids) == 40 for o in outs)
        assert admitted.count(False) == 2 and len(admitted) == 2 * SENTINEL_EVERY, admitted
        assert len({f.slot for f in fed}) == 2  # only the sentinels' prompts went to the draft
        assert spec.stats.dormant_admitted == 2 * SENTINEL_EVERY - 2
        # What `tandem bench` reports per run: steps by depth, catch-ups, dormant admissions.
        from tandem.bench.measure import run_batch

        metrics, _ = run_batch(e, PROMPTS[:SENTINEL_EVERY], 40, trace=True)
        assert metrics.dormant_admitted == SENTINEL_EVERY - 1
        # Depth 0 but for probes; the one sentinel catches up once per 32 deferred steps (40 tokens: <= 2).
        assert metrics.steps_by_depth[0] >= metrics.decode_iterations and sum(metrics.steps_by_depth[1:]) <= 2
        assert 1 <= metrics.catch_ups <= 2
        # Its step trace: one entry per decode step, each naming the depth of the results it took.
        trace = metrics.step_trace
        assert len(trace) == metrics.decode_iterations and all(ms > 0 for ms, _, _ in trace)
        taken = [sum(depth == d for _, depth, _ in trace) for d in range(4)]
        assert all(t <= n for t, n in zip(taken, metrics.steps_by_depth)) and taken[0] >= metrics.decode_iterations - 3
        assert sum(c for _, _, c in trace) <= metrics.catch_ups
        # /metrics exports both counts from the core's stats snapshot.
        from types import SimpleNamespace

        from tandem.engine.core import EngineCore
        from tandem.server.metrics import ReplicaStatus, ServerMetrics

        snapshot = EngineCore.stats(SimpleNamespace(engine=e))
        text = ServerMetrics(lambda: [ReplicaStatus(0, True, snapshot, 0, 0)], speculative=True).render().decode()
        assert f'tandem:spec_decode_dormant_requests_total{{replica="0"}} {float(spec.stats.dormant_admitted)}' in text
        assert f'tandem:spec_decode_catch_ups_total{{replica="0"}} {float(spec.stats.catch_ups)}' in text
        assert spec.stats.catch_ups > 0
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total


def test_running_requests_drop_their_draft_state_once_drafting_cannot_pay(spec_models, reference, monkeypatch):
    """Synthetic acceptance 0 (BENCHMARK ONLY coins: nothing is accepted, so the tokens are the target's) and
    a frozen cost table where a chain of one costs 1.8x depth 0: eight requests are admitted with their
    drafts (nothing observed yet); the learning probe rejects all eight, and at the next demotion check
    (every DEMOTE_EVERY steps) all eight drop their draft state and the batch runs plain decoding's step.
    The tokens stay plain greedy decoding's; nothing is caught up for them after."""
    from tandem.bench import synthetic
    from tandem.speculative.worker import DEMOTE_EVERY

    monkeypatch.setattr(DepthPolicy, "observe_time", lambda self, bs, shape, ms, weight=None, mode="greedy": None)
    with Engine(spec_models["target"], speculative_algorithm="EAGLE3",
                speculative_draft_model_path=spec_models["EAGLE3"], **CHAIN, **ENGINE) as e:
        spec = e.runner.spec
        for bs in range(1, 17):
            for shape in spec.policy.options:
                spec.policy.cost_ms[(bs, shape)] = 1.0 + 0.8 * shape.depth
        synthetic.install(e, 0.0)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = e.generate(input_ids=PROMPTS[:8], sampling_params=params)
        assert [o.token_ids for o in outs] == reference[:8]
        assert spec.stats.dormant_admitted == 0 and spec.stats.dormant_demoted == 8
        assert spec.stats.dormant_steps >= NEW_TOKENS - 1 - DEMOTE_EVERY
        assert not spec.lag  # (no deferred extends are kept for them)
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total


def test_a_burst_of_requests_is_judged_at_the_batch_it_will_make(spec_models, monkeypatch):
    """A burst of 16 prompts is prefilled a chunk budget (64 tokens) at a time. Frozen costs where drafts
    pay up to batch 4 (depth d: 1 + 0.01 d ms) and lose from batch 5 (1 + d), synthetic acceptance 0.5
    (BENCHMARK ONLY coins): at 16 rows the best chain yields under 1.8 / 2 tokens per ms even with a_1 at
    the upper end of its interval, against depth 0's 1.0, so every request but the sentinels is admitted
    dormant, including those of the first chunks, which the running batch alone (1-4 rows then) would
    have kept drafting."""
    from tandem.bench import synthetic
    from tandem.speculative import policy as policy_module

    SENTINEL_EVERY = 8  # (the engine's is 32: fewer prompts this way)
    monkeypatch.setattr(policy_module, "SENTINEL_EVERY", SENTINEL_EVERY)

    monkeypatch.setattr(DepthPolicy, "observe_time", lambda self, bs, shape, ms, weight=None, mode="greedy": None)
    with Engine(spec_models["target"], speculative_algorithm="EAGLE3",
                speculative_draft_model_path=spec_models["EAGLE3"], **CHAIN, **ENGINE) as e:
        policy = e.runner.spec.policy
        for bs in range(1, 17):
            for shape in policy.options:
                policy.cost_ms[(bs, shape)] = 1.0 + (0.01 if bs <= 4 else 1.0) * shape.depth
        synthetic.install(e, 0.5)
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        e.generate(input_ids=PROMPTS[:4], sampling_params=params)
        assert 0.3 < policy.acceptance[0] < 0.7, policy.acceptance
        admitted = []
        real_admit = policy.admit
        monkeypatch.setattr(policy, "admit", lambda rid, padded, *a, **k:
                            admitted.append((real_admit(rid, padded, *a, **k), padded)) or admitted[-1][0])
        e.generate(input_ids=PROMPTS[4:4 + 2 * SENTINEL_EVERY], sampling_params=params)
        assert [padded for _, padded in admitted] == [2 * SENTINEL_EVERY] * (2 * SENTINEL_EVERY), admitted
        assert [dormant for dormant, _ in admitted].count(True) == 2 * SENTINEL_EVERY - 2, admitted
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total


def test_sampled_requests_are_judged_at_their_own_acceptance(spec_models, monkeypatch):
    """Greedy traffic teaches the policy that drafts never pay (synthetic acceptance 0, BENCHMARK ONLY
    coins; frozen costs 1 + 0.3 d ms, then 1 + 0.8 d as in the test above): a new greedy request is then
    admitted dormant, but a sampled one is not, because sampled requests keep an estimate of their own
    (speculative/policy.py `_ClassRates`) and it has no observations yet. The worker says which is which."""
    from tandem.bench import synthetic

    monkeypatch.setattr(DepthPolicy, "observe_time", lambda self, bs, shape, ms, weight=None, mode="greedy": None)
    with Engine(spec_models["target"], speculative_algorithm="EAGLE3",
                speculative_draft_model_path=spec_models["EAGLE3"], **CHAIN, **ENGINE) as e:
        policy = e.runner.spec.policy
        for d in (0.3, 0.8):
            for bs in range(1, 17):
                for shape in policy.options:
                    for mode in ("greedy", "sampled"):  # (each sampling mode's own table, the same costs)
                        policy.cost_ms[(cost_table(bs, mode), shape)] = 1.0 + d * shape.depth
            if d == 0.3:
                synthetic.install(e, 0.0)
                e.generate(input_ids=PROMPTS[:4], sampling_params=SamplingParams(
                    max_new_tokens=40, temperature=0.0, ignore_eos=True))
        assert policy.rates_by_class[False].acceptance[0] < 0.1 and policy.rates_by_class[True].seen[0] == 0
        admitted = {}
        real_admit = policy.admit
        monkeypatch.setattr(policy, "admit", lambda rid, padded, *a, **k: admitted.setdefault(
            rid, (k.get("sampled"), real_admit(rid, padded, *a, **k)))[1])
        params = [SamplingParams(max_new_tokens=40, temperature=t, seed=i, ignore_eos=True)
                  for i, t in enumerate([0.0, 1.0, 0.0, 1.0])]
        outs = e.generate(input_ids=PROMPTS[4:8], sampling_params=params)
        assert all(len(o.token_ids) == 40 for o in outs)
        # (sampled?, admitted dormant?) per request, in prompt order: greedy ones dormant, sampled ones drafting.
        assert [admitted[o.request_id] for o in outs] == [(False, True), (True, False), (False, True), (True, False)]
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_start_up_timing_of_the_draft_prefill_leaves_output_unchanged(spec_models, reference, kind):
    """The start-up timing of the draft's prefill (a GPU engine runs it once its graphs are captured) writes
    draft KV into the first pages: nobody's before the engine serves, and the requests after it decode as
    plain greedy decoding does. It leaves the policy a call's fixed part, from the line through two sizes."""
    alg = "STANDALONE" if kind == "SELF" else kind
    with Engine(spec_models["target"], speculative_algorithm=alg, speculative_draft_model_path=spec_models[kind],
                **CHAIN, **ENGINE) as e:
        e.runner.spec._time_draft_prefill(sizes=(8, 40), repeats=1)
        prefill_cost = e.runner.spec.policy._draft_prefill
        assert prefill_cost.fixed_ms is not None and prefill_cost.fixed_ms >= 0.0
        assert prefill_cost.ms_per_token() >= 0.0
        outs = e.generate(input_ids=PROMPTS, sampling_params=greedy())
    assert [o.token_ids for o in outs] == reference

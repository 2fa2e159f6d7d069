"""The CUDA-graph code path on a CPU (TANDEM_CUDA_GRAPH_EMULATE=1: "replay" is a call on the static,
padded inputs). It checks what graphs add besides the capture itself: fixed KV windows, padded rows
pointed at the sink page and pad state row, re-padding when a batch shrinks, and the eager fallback
for batches larger than the largest graph. Output must equal plain eager greedy decoding."""

import pytest

from tandem import Engine, SamplingParams
from tandem.layers.sampler import GENERAL, GREEDY
from tests.speculative.conftest import CHAIN, ENGINE, TREE
from tests.speculative.test_spec_greedy import NEW_TOKENS, PROMPTS, reference  # noqa: F401 (fixture)

LENGTHS = (5, 10, 15, NEW_TOKENS)  # requests finish at different steps, so the batch shrinks


@pytest.fixture(autouse=True)
def emulate_graphs(monkeypatch):
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")


def record_padded_sizes(graphed) -> list[int]:
    """Wraps a GraphedFunction's fn to log the (padded) batch size of every replay."""
    sizes, fn = [], graphed.fn

    def recording(*static):
        sizes.append(static[0].shape[0])
        return fn(*static)

    graphed.fn = recording
    return sizes


def run(engine, n, logprobs=None):
    """n requests, then n more once the first have finished: the late ones get freed pages and
    state rows, where a stale padded row would write."""
    rids, done = [], {}

    def add(first):
        for i in range(first, first + n):
            params = SamplingParams(max_new_tokens=LENGTHS[i % len(LENGTHS)], temperature=0.0, ignore_eos=True,
                                    logprobs=logprobs)
            rids.append(engine.add_request(PROMPTS[i], params))

    add(0)
    while engine.has_unfinished():
        for out in engine.step().finished:
            done[out.request_id] = out
        if len(rids) == n and len(done) >= n // 2:
            add(n)
    assert engine.scheduler.allocator.num_used == 0  # every page is free or cached
    return [done[r] for r in rids]


def check(outs, reference):
    for i, out in enumerate(outs):
        want = reference[i][: LENGTHS[i % len(LENGTHS)]]
        assert out.token_ids == want, f"prompt {i} differs"


@pytest.mark.parametrize("max_bs", [16, 4], ids=["padded", "eager-fallback"])
def test_plain_decode_graph(spec_models, reference, max_bs):
    with Engine(spec_models["target"], cuda_graph_max_bs=max_bs, **{**ENGINE, "max_running_requests": 12}) as engine:
        sizes = record_padded_sizes(engine.runner.decode_graphs[GREEDY])
        check(run(engine, 10), reference)
        general = record_padded_sizes(engine.runner.decode_graphs[GENERAL])
        with_logprobs = run(engine, 10, logprobs=2)  # the graph with every stage on (logprobs, penalties)
        check(with_logprobs, reference)
    assert sizes, "the graph path never ran"
    assert general, "the logprob steps never replayed the GENERAL graph"
    with Engine(spec_models["target"], cuda_graph_max_bs=0, **{**ENGINE, "max_running_requests": 12}) as eager:
        assert_logprobs_close(logprob_lists(with_logprobs), logprob_lists(run(eager, 10, logprobs=2)))
    if max_bs == 16:
        # Graphs up to max_running_requests (12): batches of 10 and 9 are padded to 12.
        assert 12 in sizes and set(sizes) <= set(range(1, 9)) | {12}
    else:
        assert set(sizes) <= {1, 2, 3, 4}  # larger batches ran eagerly


def logprob_lists(outs):
    return [[(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs] for o in outs]


def assert_logprobs_close(got, want, atol=2e-4):
    """The same tokens and alternatives, values within atol (a padded batch's kernels round differently)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w), f"request {i}: {len(g)} logprobs, want {len(w)}"
        for j, ((tok, lp, top), (wtok, wlp, wtop)) in enumerate(zip(g, w)):
            assert tok == wtok and abs(lp - wlp) <= atol, f"request {i}, token {j}: {tok} {lp} vs {wtok} {wlp}"
            assert [t for t, _ in top] == [t for t, _ in wtop], f"request {i}, token {j}: alternatives differ"
            assert all(abs(v - wv) <= atol for (_, v), (_, wv) in zip(top, wtop))


@pytest.mark.parametrize("kind", ["EAGLE3", "EAGLE"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_speculative_graphs(spec_models, reference, kind, shape):
    engine_args = dict(speculative_algorithm=kind, speculative_draft_model_path=spec_models[kind],
                       speculative_adaptive="off", **shape, **{**ENGINE, "max_running_requests": 12})
    with Engine(spec_models["target"], cuda_graph_max_bs=0, **engine_args) as eager:
        eager_logprobs = logprob_lists(run(eager, 10, logprobs=2))
    # A fixed shape (adaptive off), so every greedy step takes the one whole-iteration graph checked below.
    with Engine(spec_models["target"], cuda_graph_max_bs=16, **engine_args) as engine:
        phases = engine.runner.spec.phases
        sizes = {name: record_padded_sizes(g) for name, g in phases.graphs.items()}
        check(run(engine, 10), reference)  # greedy: the whole-iteration graph
        iteration = f"iteration:greedy:{phases.configured.name}"
        assert 12 in sizes[iteration] and not sizes["verify"]  # 10 requests padded to 12
        # Logprobs: the whole-iteration graph with every stage (GENERAL), the same values as eager steps.
        general = f"iteration:{GENERAL.name}:{phases.configured.name}"
        outs = run(engine, 10, logprobs=2)
        check(outs, reference)
        assert 12 in sizes[general] and not sizes["verify"]
        assert_logprobs_close(logprob_lists(outs), eager_logprobs)
        # Without that graph (what a constrained step with logprobs does): the three phase graphs.
        del phases.graphs[general]
        outs = run(engine, 10, logprobs=2)
        check(outs, reference)
        assert_logprobs_close(logprob_lists(outs), eager_logprobs)
    for name in ("draft_tree", "verify", "extend"):
        assert 12 in sizes[name], f"{name}: no padded replay"


def test_self_draft_accepts_everything_with_graphs(spec_models, reference):
    """The target drafting for itself accepts every draft: wrong state written by a padded row or
    a wrong window would show as a shorter accept length."""
    with Engine(spec_models["target"], speculative_algorithm="STANDALONE", speculative_draft_model_path=spec_models["SELF"],
                cuda_graph_max_bs=16, speculative_adaptive="off", **CHAIN,
                **{**ENGINE, "max_running_requests": 12}) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=PROMPTS[:10], sampling_params=params)  # 10 rows padded to 12
    for out, want in zip(outs, reference):
        assert out.token_ids == want
        assert all(a == 4 for a in out.spec_accept_lengths[:-1]), out.spec_accept_lengths


@pytest.mark.parametrize("kind", ["EAGLE3", "SELF"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_every_graph_runs_on_its_pad_inputs(spec_models, kind, shape):
    """A real capture first runs each graph's function once on its padded static inputs (every row a pad
    row); emulation skips that run, so it is made here for every graph of every kind, constrained
    halves included. A function that indexes out of range on pad values fails this on a CPU instead of
    as a device-side assert at a GPU's start-up (the constrained verify half once did, for chains
    drafted by a tree drafter: padded depths were all 0)."""
    import torch

    alg = "STANDALONE" if kind == "SELF" else kind
    with Engine(spec_models["target"], speculative_algorithm=alg, speculative_draft_model_path=spec_models[kind],
                cuda_graph_max_bs=4, **shape, **ENGINE) as engine:
        graphs = engine.runner.spec.phases.graphs
        assert any(name.startswith("verify_commit:") for name in graphs)
        for name, graphed in graphs.items():
            static = [torch.full((3, *spec.tail_shape), spec.pad, dtype=spec.dtype) for spec in graphed.inputs]
            graphed.fn(*static)  # raises on an out-of-range index


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_start_up_timing_seeds_every_sampling_modes_cost_table(spec_models, shape, monkeypatch):
    """On a GPU the adaptive policy's cost tables are seeded at start-up by replaying the captured graphs.
    Each sampling mode steps through graphs of its own (greedy, sampled, top-k, every sampling stage) at
    its own cost, so each mode's table must hold every option and a dormant step at every captured batch
    size, and a constrained batch's depth 0 too. Replays are faked here (a CPU has no CUDA graphs): each
    graph answers a time of its own, which must land under that graph's mode and option."""
    import tandem.speculative.worker as worker
    from tandem.layers.sampler import GRAPHED_CONSTRAINED, GRAPHED_GENERAL, GRAPHED_SAMPLING
    from tandem.speculative.policy import DraftShape, cost_table

    with Engine(spec_models["target"], speculative_algorithm="EAGLE3", speculative_draft_model_path=spec_models["EAGLE3"],
                cuda_graph_max_bs=4, **shape, **ENGINE) as engine:
        spec = engine.runner.spec
        answers = {}  # the replayed graph -> its fake time
        for key, graphed in spec.phases.graphs.items():
            for bs in graphed.graphs:
                graphed.graphs[bs] = (key, bs)  # (emulation stores None: a token to recognise the replay by)
                answers[(key, bs)] = 0.1 * (1 + len(answers))
        monkeypatch.setattr(worker, "_replay_ms", lambda graph, replays: answers[graph])
        monkeypatch.setattr(worker.torch.cuda, "synchronize", lambda device=None: None)
        spec.time_graphed_iterations()
        policy = spec.policy
        for features in GRAPHED_SAMPLING + GRAPHED_GENERAL:
            for bs in (1, 2, 3, 4):
                table = cost_table(bs, features.name)
                for option in policy.options:
                    key = f"iteration:{features.name}:{option.name}"
                    assert policy.cost_ms[(table, option)] == pytest.approx(answers[(key, bs)]), (key, bs)
                assert policy.dormant_cost_ms[table] == pytest.approx(answers[(f"dormant:{features.name}", bs)])
        for features in GRAPHED_CONSTRAINED:
            key = f"iteration:{features.name}:{DraftShape(0).name}"
            assert policy.cost_ms[(cost_table(4, features.name), DraftShape(0))] == pytest.approx(answers[(key, 4)])

"""Seeded sampled requests give the same tokens with speculation on or off.

The token at position t is always the target's own draw with the noise keyed by (seed, t), and the
draft tree only decides how many such draws one verify step yields. So plain decoding of the same
seeded requests is the reference: every draft kind, chain and tree, overlap and plan stream on or off,
the CUDA-graph code path, batch companions and preemption must reproduce it token for token. A mix
of filters (top-p, top-k, min-p), penalties and a greedy row rides along in every batch.
"""

import pytest

from tandem import Engine, SamplingParams
from tandem.layers.sampler import GENERAL, GENERAL_TOP_K
from tests.engine.helpers import instrument_preemptions
from tests.speculative.conftest import CHAIN, ENGINE, TREE
from tests.speculative.test_spec_greedy import PROMPTS

NEW = 16
BATCH = PROMPTS[:12]


def params_mix() -> list[SamplingParams]:
    """Twelve requests: temperature 1 with top-p, top-k + temperature 0.7, min-p, penalties, greedy."""
    kinds = [
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        dict(temperature=1.0),
        dict(temperature=0.0),
    ]
    return [SamplingParams(max_new_tokens=NEW, ignore_eos=True, seed=100 + i, **kinds[i % len(kinds)])
            for i in range(len(BATCH))]


@pytest.fixture(scope="module")
def plain_seeded(spec_models):
    with Engine(spec_models["target"], **ENGINE) as engine:
        return [o.token_ids for o in engine.generate(input_ids=BATCH, sampling_params=params_mix())]


def spec_engine(spec_models, kind, shape, **extra):
    return Engine(spec_models["target"], speculative_algorithm="STANDALONE" if kind == "SELF" else kind,
                  speculative_draft_model_path=spec_models[kind], **shape, **{**ENGINE, **extra})


def check(outs, want, what: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, want)):
        assert out.token_ids == ref, f"{what}: request {i} ({params_mix()[i]}) differs"


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3", "STANDALONE", "SELF"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_seeded_speculative_equals_plain(spec_models, plain_seeded, kind, shape):
    with spec_engine(spec_models, kind, shape) as engine:
        outs = engine.generate(input_ids=BATCH, sampling_params=params_mix())
        check(outs, plain_seeded, f"{kind}")
        if kind == "SELF":  # the target drafting for itself: sampled drafts are accepted too
            assert engine.runner.spec.stats.num_accepted_tokens > 0
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


@pytest.mark.parametrize("overlap,plan", [(False, True), (True, False)], ids=["no-overlap", "no-plan-stream"])
def test_seeded_equal_without_overlap_or_plan_stream(spec_models, plain_seeded, overlap, plan):
    with spec_engine(spec_models, "EAGLE3", TREE, disable_overlap_schedule=not overlap,
                     disable_plan_stream=not plan) as engine:
        check(engine.generate(input_ids=BATCH, sampling_params=params_mix()), plain_seeded, "overlap/plan")


def test_seeded_equal_through_emulated_cuda_graphs(spec_models, plain_seeded, monkeypatch):
    """The whole-iteration graphs (greedy, sampled, sampled with top-k, every stage for penalties) on
    the CPU: the mixed batch takes the graph with every stage, the single-kind batches their own."""
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")
    params = params_mix()
    from tests.speculative.test_cuda_graph_padding import record_padded_sizes

    with spec_engine(spec_models, "EAGLE3", CHAIN, cuda_graph_max_bs=16, speculative_adaptive="off") as engine:
        sizes = {name: record_padded_sizes(g) for name, g in engine.runner.spec.phases.graphs.items()}
        check(engine.generate(input_ids=BATCH, sampling_params=params), plain_seeded, "graphs, mixed")
        for kind in range(6):  # batches of one kind each: greedy, sampled and filtered whole-iteration graphs
            rows = list(range(kind, len(BATCH), 6))
            outs = engine.generate(input_ids=[BATCH[i] for i in rows], sampling_params=[params[i] for i in rows])
            check(outs, [plain_seeded[i] for i in rows], f"graphs, kind {kind}")
    general = [f"iteration:{f.name}:chain3" for f in (GENERAL, GENERAL_TOP_K)]  # penalties alone; the mixed batch
    for name in ("iteration:greedy:chain3", "iteration:sampled:chain3", "iteration:sampled+top_k:chain3", *general):
        assert sizes[name], f"the {name} graph never ran"
    assert not sizes["verify"], "a step ran the phases eagerly"


def test_seeded_equal_with_companions_and_preemption(spec_models, plain_seeded):
    """Each seeded request alone, then all of them in a pool so small that requests are retracted and
    recomputed: a recompute redraws the same tokens (the noise key is the position)."""
    params = params_mix()
    with spec_engine(spec_models, "EAGLE3", CHAIN) as engine:
        for i in (0, 3, 7):
            check(engine.generate(input_ids=[BATCH[i]], sampling_params=[params[i]]), [plain_seeded[i]], "alone")
    with spec_engine(spec_models, "EAGLE3", CHAIN, max_total_tokens=160, chunked_prefill_size=16) as small:
        preempted = instrument_preemptions(small)
        check(small.generate(input_ids=BATCH, sampling_params=params), plain_seeded, "preempted")
        assert preempted, "no preemption happened"
        assert small.scheduler.allocator.num_used == 0  # every page is free or cached


def test_seeded_plain_equals_itself_under_preemption(spec_models, plain_seeded):
    """The same for plain decoding (its recompute path is the runner's own)."""
    with Engine(spec_models["target"], **{**ENGINE, "max_total_tokens": 120, "chunked_prefill_size": 16}) as small:
        preempted = instrument_preemptions(small)
        check(small.generate(input_ids=BATCH, sampling_params=params_mix()), plain_seeded, "plain preempted")
        assert preempted, "no preemption happened"

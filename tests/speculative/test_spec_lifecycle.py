"""Speculative requests: stops inside an accepted run, aborts, preemption, page accounting."""

import pytest

from tandem import Engine, SamplingParams
from tests.engine.helpers import instrument_preemptions
from tests.models.tiny_checkpoints import prompts
from tests.speculative.conftest import CHAIN, ENGINE, TREE


def _engine(spec_models, alg="STANDALONE", draft="SELF", shape=CHAIN, **kw):
    return Engine(spec_models["target"], speculative_algorithm=alg, speculative_draft_model_path=spec_models[draft],
                  **shape, **{**ENGINE, **kw})


@pytest.fixture(scope="module")
def plain(spec_models):
    with Engine(spec_models["target"], **ENGINE) as engine:
        yield engine


def test_stop_token_inside_accepted_run(spec_models, plain):
    """With full acceptance every step yields 4 tokens; a stop token in the middle of a run must
    end the output exactly there, as plain decoding does."""
    ids = prompts(4, seed=11)
    free = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    reference = plain.generate(input_ids=ids, sampling_params=free)
    with _engine(spec_models) as engine:
        for p, ref in zip(ids, reference):
            stop_at = 6  # not a multiple of the run length 4, so the stop falls inside a run
            stop_tok = ref.token_ids[stop_at]
            first = ref.token_ids.index(stop_tok)
            params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[stop_tok], ignore_eos=True)
            out = engine.generate(input_ids=[p], sampling_params=params)[0]
            assert out.token_ids == ref.token_ids[: first + 1]
            assert out.finish_reason == "stop"
            for n in (1, 5, 7):  # max_new_tokens inside a run
                out = engine.generate(input_ids=[p], sampling_params=SamplingParams(
                    max_new_tokens=n, temperature=0.0, ignore_eos=True))[0]
                assert out.token_ids == ref.token_ids[:n] and out.finish_reason == "length"
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_preemption_with_speculation(spec_models, plain, shape):
    """A KV pool too small for all requests forces retraction mid-speculation; output is unchanged."""
    ids = prompts(10, seed=12)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    reference = [o.token_ids for o in plain.generate(input_ids=ids, sampling_params=params)]
    with _engine(spec_models, "EAGLE3", "EAGLE3", shape, max_total_tokens=140) as engine:
        preempted = instrument_preemptions(engine)
        outs = engine.generate(input_ids=ids, sampling_params=params)
        assert preempted, "the pool was meant to force preemption"
        assert [o.token_ids for o in outs] == reference
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


def test_abort_mid_speculation_frees_pages(spec_models):
    with _engine(spec_models, "EAGLE", "EAGLE", TREE) as engine:
        total = engine.scheduler.allocator.num_total
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        rids = [engine.add_request(p, params) for p in prompts(6, seed=13)]
        for _ in range(4):
            engine.step()
        assert engine.scheduler.allocator.num_free < total
        for rid in rids[::2]:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        engine.step()  # lets the runner drop the state of the finished requests
        assert engine.scheduler.allocator.num_free + engine.scheduler.allocator.num_cached == total
        assert not engine.runner.spec.pool.slot_of  # every request's device state released
        assert not engine.runner.spec.ready


def test_spec_stats_count_what_requests_saw(spec_models):
    with _engine(spec_models, speculative_adaptive="off") as engine:  # every step drafts 3
        outs = engine.generate(input_ids=prompts(3, seed=14),
                               sampling_params=SamplingParams(max_new_tokens=17, temperature=0.0, ignore_eos=True))
        stats = engine.runner.spec.stats
        lens = [k for o in outs for k in o.spec_accept_lengths]
        assert stats.num_drafts == len(lens)
        assert stats.num_accepted_tokens == sum(k - 1 for k in lens)
        assert stats.num_draft_tokens == 3 * len(lens)
        assert stats.accepted_per_position == [len(lens)] * 3  # self-draft: every position accepted
        assert stats.mean_accept_length == 4.0

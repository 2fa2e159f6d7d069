"""Plain decoding under the overlap scheduler: step N+1 is launched before step N's tokens reach the
host, its input tokens read from the device ("future" chunks). Greedy output must equal
transformers' generate, and seeded sampling and logprobs must not depend on the overlap."""

import pytest

from tandem import SamplingParams
from tests.engine.helpers import checkpoint_dir, cpu_engine, hf_greedy
from tests.models.tiny_checkpoints import prompts

PROMPTS = prompts(8, seed=11)
LENGTHS = (6, 12, 18, 24)  # requests finish at different steps


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama3")


def count_future_chunks(engine) -> list[int]:
    """Wraps runner.launch to count the chunks scheduled ahead of their input token."""
    counts, launch = [], engine.runner.launch

    def counting(sched):
        counts.append(sum(c.is_future for c in sched.chunks))
        return launch(sched)

    engine.runner.launch = counting
    return counts


def run_staggered(engine, params_for):
    """Half the prompts first, the rest once a request has finished (their pages are reused)."""
    rids, done = [], {}
    half = len(PROMPTS) // 2

    def add(first, last):
        for i in range(first, last):
            rids.append(engine.add_request(PROMPTS[i], params_for(i)))

    add(0, half)
    while engine.has_unfinished():
        for out in engine.step().finished:
            done[out.request_id] = out
        if len(rids) == half and done:
            add(half, len(PROMPTS))
    assert engine.scheduler.allocator.num_used == 0  # every page is free or cached
    return [done[r] for r in rids]


def test_greedy_with_overlap_equals_transformers(ckpt):
    engine = cpu_engine(ckpt[0], max_total_tokens=2048)
    assert engine.overlap
    futures = count_future_chunks(engine)
    outs = run_staggered(engine, lambda i: SamplingParams(max_new_tokens=LENGTHS[i % 4], temperature=0.0,
                                                          ignore_eos=True))
    assert sum(futures) > 0, "no decode was scheduled ahead"
    for i, out in enumerate(outs):
        assert out.token_ids == hf_greedy(ckpt[1], PROMPTS[i], LENGTHS[i % 4]), f"prompt {i}"


@pytest.mark.parametrize("kind", ["seeded", "logprobs"])
def test_overlap_does_not_change_sampling(ckpt, kind):
    def params(i):
        if kind == "seeded":
            return SamplingParams(max_new_tokens=LENGTHS[i % 4], temperature=0.9, top_p=0.95, seed=100 + i,
                                  ignore_eos=True)
        return SamplingParams(max_new_tokens=LENGTHS[i % 4], temperature=0.0, logprobs=2, ignore_eos=True)

    runs = []
    for disable in (False, True):
        engine = cpu_engine(ckpt[0], max_total_tokens=2048, disable_overlap_schedule=disable)
        runs.append(run_staggered(engine, params))
    with_overlap, without = runs
    for a, b in zip(with_overlap, without):
        assert a.token_ids == b.token_ids
        if kind == "logprobs":
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-5
                assert len(x.top) == 2 and [t for t, _ in x.top] == [t for t, _ in y.top]


def test_small_pool_with_overlap_finishes(ckpt):
    """A pool barely larger than one request: scheduling ahead must wait for pages rather than
    retract the request it is for (which looped forever once)."""
    engine = cpu_engine(ckpt[0], max_total_tokens=64, chunked_prefill_size=8)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))
    finished = []
    for _ in range(300):  # bounded: the bug this guards against never finishes
        finished += engine.step().finished
        if not engine.has_unfinished():
            break
    assert len(finished) == 1, "the request did not finish"
    out = finished[0]
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(ckpt[1], PROMPTS[0], len(out.token_ids))


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_penalised_request_advances_every_step(ckpt, disable_overlap):
    """Penalties need the real history on the host, so such a request is never scheduled ahead; the
    engine then processes the step in flight before scheduling, instead of leaving it a step behind."""
    engine = cpu_engine(ckpt[0], max_total_tokens=2048, disable_overlap_schedule=disable_overlap)
    n = 12
    penalised = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=n, temperature=0.0,
                                                              repetition_penalty=1.3, ignore_eos=True))
    engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    steps, done = 0, {}
    while engine.has_unfinished():
        steps += 1
        for out in engine.step().finished:
            done[out.request_id] = (steps, out)
    finished_at, out = done[penalised]
    assert finished_at <= n + 2, f"{n} tokens took {finished_at} steps"
    assert out.token_ids == hf_greedy(ckpt[1], PROMPTS[1], n, repetition_penalty=1.3)


def test_decode_graph_path_equals_transformers(ckpt, monkeypatch):
    """Plain decoding through its (emulated) decode graph: the staging rows the host fills each step
    (token, position, state row, future flag, page ids) must drive the same greedy output."""
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")
    engine = cpu_engine(ckpt[0], max_total_tokens=2048, cuda_graph_max_bs=8)
    graphed, real = [], engine.runner._decode_graphed
    monkeypatch.setattr(engine.runner, "_decode_graphed", lambda *a, **k: graphed.append(1) or real(*a, **k))
    outs = run_staggered(engine, lambda i: SamplingParams(max_new_tokens=LENGTHS[i % 4], temperature=0.0,
                                                          ignore_eos=True))
    assert graphed, "no step replayed the decode graph"
    for i, out in enumerate(outs):
        assert out.token_ids == hf_greedy(ckpt[1], PROMPTS[i], LENGTHS[i % 4]), f"prompt {i}"

"""The scheduler with prefix caching, driven by a paged fake model (no torch): hits, partial hits, the
speculation boundary, eviction, preemption, aborts, flush and page accounting, by hand-made cases."""

import random

import pytest
from scheduler_utils import PagedFakeModel, check_pages, create_request, create_scheduler, reference_outputs

from tandem.scheduler import NO_DRAFT_KV

PS = 4


def cached_scheduler(**kw):
    kw = {"page_size": PS, "prefix_caching": True, **kw}
    return create_scheduler(**kw)


def run_alone(model: PagedFakeModel, req):
    model.sched.add_request(req)
    model.run()
    assert req.output_token_ids == reference_outputs(req.prompt_token_ids, req.sampling_params.max_new_tokens)
    return req


def first_chunk(model: PagedFakeModel, rid: str):
    return next(c for c in model.first_chunks if c.request_id == rid)


def assert_pool_whole(sched):
    alloc = sched.allocator
    assert not sched.has_unfinished()
    assert alloc.num_free + alloc.num_cached == alloc.num_total
    assert sched.flush_cache()
    assert alloc.num_free == alloc.num_total


def test_a_follow_up_turn_starts_from_the_previous_turn_s_pages():
    """Turn 1: 10 prompt tokens and 3 outputs, of which 12 have KV (the last is never fed): pages 0-2.
    Turn 2 re-sends all 13 and 2 more: it starts at token 12 and gets the reference's tokens."""
    sched = cached_scheduler()
    model = PagedFakeModel(sched)
    a = run_alone(model, create_request("a", prompt_len=10, max_new_tokens=3))
    assert sched.allocator.num_cached == 3
    b = run_alone(model, create_request("b", prompt=a.all_token_ids + [5, 6], max_new_tokens=4))
    c = first_chunk(model, "b")
    assert (c.start_pos, c.cached_len, c.token_ids) == (12, 12, (a.output_token_ids[-1], 5, 6))
    assert b.num_cached_tokens == 12 and a.num_cached_tokens == 0
    assert (sched.prefix_stats.queries, sched.prefix_stats.hits) == (10 + 15, 12)
    assert_pool_whole(sched)


def test_partial_hit_and_a_prompt_that_is_a_prefix_of_a_cached_one():
    sched = cached_scheduler()
    model = PagedFakeModel(sched)
    a = run_alone(model, create_request("a", prompt_len=12, max_new_tokens=2))
    prompt = a.prompt_token_ids
    cases = {  # prompt -> where the hit ends: at least one token is computed, so a whole page is redone
        "shares-6": (prompt[:6] + [1, 2, 3, 4], 4),
        "prefix-10": (prompt[:10], 8),  # its last page is partial
        "prefix-9": (prompt[:9], 8),  # one token left to compute
        "prefix-8": (prompt[:8], 4),  # page-aligned: the last page is recomputed
        "prefix-3": (prompt[:3], 0),
    }
    for rid, (p, start) in cases.items():
        req = run_alone(model, create_request(rid, prompt=p, max_new_tokens=3))
        assert first_chunk(model, rid).start_pos == start == req.num_cached_tokens, rid
    assert_pool_whole(sched)


@pytest.mark.parametrize("draft_model", [True, False])
def test_with_a_draft_a_page_is_reused_only_before_the_token_its_draft_entry_was_made_with(draft_model):
    """The draft entry at a page's last position pairs it with the next token. Turn 2 shares turn 1's first
    three pages but not the token after them: with draft_model page 2 is recomputed and no draft entry is
    ever read wrong; the negative control (a draft model the scheduler is not told about) reuses page 2
    and reads a wrong entry. A turn that continues turn 1 exactly reuses all three pages either way."""
    sched = cached_scheduler(draft_model=draft_model)
    model = PagedFakeModel(sched, draft=True)
    a = run_alone(model, create_request("a", prompt_len=10, max_new_tokens=3))
    other = (a.output_token_ids[2] + 1) % 1000
    b = run_alone(model, create_request("b", prompt=a.all_token_ids[:12] + [other, 9], max_new_tokens=3))
    c = run_alone(model, create_request("c", prompt=a.all_token_ids + [9], max_new_tokens=3))
    assert b.num_cached_tokens == (8 if draft_model else 12)
    assert c.num_cached_tokens == 12
    if draft_model:
        assert model.draft_errors == {"a": 0, "b": 0, "c": 0}
    else:
        assert model.draft_errors["b"] > 0 and model.draft_errors["a"] == model.draft_errors["c"] == 0


def test_with_a_draft_pages_of_different_requests_are_not_chained_across_a_different_next_token():
    """X computes pages 0-2 of P; Y shares P's first two pages, then differs: its page 1 has X's tokens
    but another next token, so it is indexed as content of its own (recomputing only page 1 and reusing
    X's page 1 by its tokens alone would let Z, who continues Y, draft from X's entry at position 7)."""
    sched = cached_scheduler(draft_model=True)
    model = PagedFakeModel(sched, draft=True)
    x = run_alone(model, create_request("x", prompt_len=12, max_new_tokens=2))
    y_prompt = x.prompt_token_ids[:8] + [(x.prompt_token_ids[8] + 1) % 1000, 3, 4, 5, 6]
    y = run_alone(model, create_request("y", prompt=y_prompt, max_new_tokens=3))
    z = run_alone(model, create_request("z", prompt=y.all_token_ids + [7], max_new_tokens=2))
    assert y.num_cached_tokens == 4 and z.num_cached_tokens == 12
    assert model.draft_errors == {"x": 0, "y": 0, "z": 0}


@pytest.mark.parametrize("draftless_hits", [False, True])
def test_pages_without_draft_kv_serve_the_target_alone(draftless_hits):
    """A request that keeps no draft KV (dormant) leaves pages for the target alone. A later request may
    start from them only if it can run without draft state too (draftless_hits), and then it does; else it
    recomputes them, drafting. One page short of the longest hit is recomputed rather than give up the
    draft."""
    sched = cached_scheduler(draft_model=True, draftless_hits=draftless_hits)
    model = PagedFakeModel(sched, draft=True, dormant={"a"})
    a = run_alone(model, create_request("a", prompt_len=16, max_new_tokens=3))
    assert model.draft_behind["a"] == NO_DRAFT_KV and sched.allocator.num_cached == 4
    b = run_alone(model, create_request("b", prompt=a.all_token_ids, max_new_tokens=3))
    c = first_chunk(model, "b")
    assert (b.num_cached_tokens, c.draftless) == ((16, True) if draftless_hits else (0, False))
    assert ("b" in model.dormant) == draftless_hits and model.draft_errors.get("b", 0) == 0
    # b drafted (draftless_hits off): its own pages hold draft KV, so a follow-up drafts from them.
    d = run_alone(model, create_request("d", prompt=b.all_token_ids + [3], max_new_tokens=2))
    assert first_chunk(model, "d").draftless == draftless_hits
    assert d.num_cached_tokens == 20 and model.draft_errors.get("d", 0) == 0


def test_a_page_without_draft_kv_one_short_of_the_hit_is_recomputed():
    sched = cached_scheduler(draft_model=True, draftless_hits=True)
    model = PagedFakeModel(sched, draft=True)
    a = run_alone(model, create_request("a", prompt_len=12, max_new_tokens=1))  # pages 0, 1 with draft KV
    other = (a.prompt_token_ids[8] + 1) % 1000  # parts from a right after page 1
    b = run_alone(model, create_request("b", prompt=a.prompt_token_ids[:8] + [other, 5, 6], max_new_tokens=2))
    assert b.num_cached_tokens == 4 and not first_chunk(model, "b").draftless
    assert model.draft_errors == {"a": 0, "b": 0}


def test_a_chunk_boundary_holds_a_page_back_until_the_draft_has_its_last_entry():
    """A prefill chunk's draft KV ends one position short (its last entry needs the next chunk's first
    token): after the chunk [0, 8) only page 0 is cached with a draft, both pages without."""
    for draft_model, cached in ((True, 1), (False, 2)):
        sched = cached_scheduler(draft_model=draft_model, max_num_batched_tokens=8)
        model = PagedFakeModel(sched, draft=draft_model)
        sched.add_request(create_request("a", prompt_len=20, max_new_tokens=2))
        model.step()
        assert sched.allocator.num_indexed == cached


def test_requests_sharing_pages_hold_a_reference_each():
    sched = cached_scheduler()
    model = PagedFakeModel(sched)
    a = run_alone(model, create_request("a", prompt_len=9, max_new_tokens=1))
    pages, _ = sched.allocator.match(sched._keys(a, 2), a.all_token_ids, PS)
    reqs = [create_request(r, prompt=a.prompt_token_ids + [r_i], max_new_tokens=3) for r_i, r in enumerate("bc")]
    for r in reqs:
        sched.add_request(r)
    model.step()
    assert [sched.allocator.refs(p) for p in pages] == [2, 2]
    assert all(r.page_ids[:2] == pages for r in reqs)
    model.run()
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 3)
    assert [sched.allocator.refs(p) for p in pages] == [0, 0]
    assert_pool_whole(sched)


def test_the_least_recently_used_prefix_is_evicted_first():
    """A pool of 8 pages: prompts A and B (two full pages each) are cached, then A is used again; a big
    request needs 6 pages, so 2 cached pages go: B's (released earlier), not A's."""
    sched = cached_scheduler(num_pages=8)
    model = PagedFakeModel(sched)
    a = run_alone(model, create_request("a", prompt_len=8, max_new_tokens=2))  # 9 tokens with KV: 2 pages
    b = run_alone(model, create_request("b", prompt_len=8, max_new_tokens=2, prompt=[500 + i for i in range(8)]))
    a2 = run_alone(model, create_request("a2", prompt=a.prompt_token_ids + [1], max_new_tokens=2))
    assert a2.num_cached_tokens == 8
    assert sched.allocator.num_cached == 4  # a's two (a2's are the same) and b's two, a's used last
    run_alone(model, create_request("big", prompt_len=21, max_new_tokens=2, prompt=[700 + i for i in range(21)]))
    a3 = run_alone(model, create_request("a3", prompt=a.prompt_token_ids + [2], max_new_tokens=1))
    b2 = run_alone(model, create_request("b2", prompt=b.prompt_token_ids + [2], max_new_tokens=1))
    assert (a3.num_cached_tokens, b2.num_cached_tokens) == (8, 0)
    assert_pool_whole(sched)


def test_kv_pressure_preempts_instead_of_evicting_a_held_page():
    """Two requests share a cached prefix and grow until the pool is short: the newer one is retracted
    (its pages go back to the cache), the shared pages are never taken from the older one, and both end
    with the reference's tokens."""
    sched = cached_scheduler(num_pages=7)  # 2 shared pages + 3 of its own each would be 8
    model = PagedFakeModel(sched)
    a = run_alone(model, create_request("a", prompt_len=8, max_new_tokens=1))
    reqs = [create_request(r, prompt=a.prompt_token_ids + [i], max_new_tokens=12) for i, r in enumerate("bc")]
    for r in reqs:
        sched.add_request(r)
    preempted = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out, _ = model.step()
        preempted += out.preempted_ids
        if out.preempted_ids:
            assert sched.allocator.num_cached > 0  # the retracted request's full pages, kept
    assert preempted == ["c"]
    c = first_chunk(model, "c")
    recompute = [ch for ch in model.first_chunks if ch.request_id == "c"][-1]
    assert c.cached_len == 8 and recompute.cached_len > 8  # it recomputes from its own cached pages
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 12)
    assert_pool_whole(sched)


def test_only_processed_chunks_are_cached_and_an_abort_mid_prefill_caches_nothing_unprocessed():
    """Overlap mode schedules a chunk before the previous one's results are processed: a chunk's pages are
    indexed only by the update of its own step, and an abort leaves the unprocessed ones out."""
    sched = cached_scheduler(max_num_batched_tokens=8)
    sched.add_request(create_request("a", prompt_len=30, max_new_tokens=2))
    first = sched.schedule()  # [0, 8)
    second = sched.schedule()  # [8, 16), scheduled before the first step is processed
    assert [c.start_pos for c in first.chunks + second.chunks] == [0, 8]
    assert sched.allocator.num_indexed == 0
    sched.update({}, first.iteration)
    assert sched.allocator.num_indexed == 2
    sched.abort("a")
    sched.update({}, second.iteration)  # the aborted request's step, processed late: nothing indexed
    check_pages(sched)
    assert (sched.allocator.num_cached, sched.allocator.num_indexed) == (2, 2)
    assert_pool_whole(sched)


def test_overlap_indexes_a_prompt_s_pages_only_when_its_step_is_processed():
    """async_decode: the decode after a prompt is scheduled (a future chunk) before the prompt's step is
    processed; the prompt's pages are indexed by that step's update, not when the decode is scheduled."""
    sched = cached_scheduler(async_decode=True, num_lookahead_tokens=1)
    sched.add_request(create_request("a", prompt_len=8, max_new_tokens=5))
    prompt_step = sched.schedule()
    decode_step = sched.schedule()
    assert decode_step.chunks[0].is_future and sched.allocator.num_indexed == 0
    sched.update({"a": [11]}, prompt_step.iteration)
    assert sched.allocator.num_indexed == 2
    sched.update({"a": [12]}, decode_step.iteration)
    assert sched.get_request("a").num_computed_tokens == 9 and sched.allocator.num_indexed == 2
    sched.abort("a")
    check_pages(sched)
    assert sched.allocator.num_cached == 2
    assert_pool_whole(sched)


def test_flush_while_requests_hold_pages():
    sched = cached_scheduler()
    model = PagedFakeModel(sched)
    run_alone(model, create_request("old", prompt_len=12, max_new_tokens=1))
    sched.add_request(create_request("running", prompt_len=9, max_new_tokens=5))
    model.step()
    assert not sched.flush_cache()  # "running" holds pages
    assert sched.allocator.num_cached == 0
    assert sched.allocator.num_free + sched.allocator.num_used == sched.allocator.num_total
    model.run()
    assert_pool_whole(sched)


def test_prompt_logprobs_requests_get_no_hit():
    sched = cached_scheduler()
    model = PagedFakeModel(sched)
    a = run_alone(model, create_request("a", prompt_len=12, max_new_tokens=1))
    b = run_alone(model, create_request("b", prompt=a.prompt_token_ids, max_new_tokens=2, prompt_logprobs=0))
    assert b.num_cached_tokens == 0 and first_chunk(model, "b").start_pos == 0
    assert sched.prefix_stats.hits == 0 and sched.prefix_stats.queries == 24


def test_penalised_requests_get_the_cached_tokens_on_their_first_chunk():
    sched = cached_scheduler()
    model = PagedFakeModel(sched)
    a = run_alone(model, create_request("a", prompt_len=12, max_new_tokens=1))
    run_alone(model, create_request("plain", prompt=a.prompt_token_ids, max_new_tokens=1))
    run_alone(model, create_request("pen", prompt=a.prompt_token_ids, max_new_tokens=1, repetition_penalty=1.2))
    assert first_chunk(model, "plain").cached_token_ids == ()
    pen = first_chunk(model, "pen")
    assert pen.cached_len == 8 and pen.cached_token_ids == tuple(a.prompt_token_ids[:8])
    assert pen.first_chunk and not pen.suppress_ids


@pytest.mark.parametrize("seed,draft,dormant", [(1, False, False), (2, True, False), (3, True, False),
                                                (3, True, True)])
def test_random_shared_prefixes_under_kv_pressure(seed, draft, dormant):
    """Follow-ups of finished conversations and new ones on a few shared system prompts arrive at random,
    some are aborted, the pool runs short (eviction and retraction), speculative runs of 1-4 tokens, and
    with `dormant` a third of the requests keep no draft KV (others may start from their pages and run
    dormant too): every finished request has the reference's tokens, no draft entry is read wrong, and
    the pool is whole at the end."""
    rng = random.Random(seed)
    sched = cached_scheduler(num_pages=20, max_num_batched_tokens=24, max_num_seqs=8, draft_model=draft,
                             num_lookahead_tokens=3, draftless_hits=dormant)
    model = PagedFakeModel(sched, draft=draft, run_length=lambda: rng.randint(1, 4))
    systems = [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 20))] for _ in range(3)]
    history: list[list[int]] = []
    unchecked, aborted, preemptions, added = [], set(), 0, 0
    for _ in range(10_000):
        if added < 40 and rng.random() < 0.7:
            base = rng.choice(history) if history and rng.random() < 0.5 else rng.choice(systems)
            prompt = (base + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 8))])[-60:]
            unchecked.append(create_request(added, prompt=prompt, max_new_tokens=rng.randint(1, 10)))
            if dormant and rng.random() < 0.3:
                model.dormant.add(str(added))
            sched.add_request(unchecked[-1])
            added += 1
        if sched.running and rng.random() < 0.03:
            victim = rng.choice(sched.running)
            sched.abort(victim.request_id)
            aborted.add(victim.request_id)
        if sched.has_unfinished():
            out, _ = model.step()
            preemptions += len(out.preempted_ids)
        for r in [r for r in unchecked if r.is_finished]:
            unchecked.remove(r)
            if r.request_id not in aborted:
                assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_new_tokens)
                history.append(r.all_token_ids)
        if added == 40 and not sched.has_unfinished():
            break
    assert not unchecked
    assert sched.prefix_stats.hits > 0 and preemptions > 0
    assert all(n == 0 for n in model.draft_errors.values())
    if dormant:
        assert any(c.draftless for c in model.first_chunks)
    assert_pool_whole(sched)


@pytest.mark.parametrize("prefill_first", [False, True])
def test_requests_arriving_together_with_one_prompt_share_its_prefill(prefill_first):
    """Four samples of one 18-token prompt added at once: the first computes the prompt, the others wait
    until its pages are indexed and start at token 16 (four full pages; one token is always computed).
    Chunked (12 tokens a step) so that the first one's prompt spans two steps, with a request of
    another prompt behind them: no step is empty while the samples wait."""
    sched = cached_scheduler(max_num_batched_tokens=12, prefill_first=prefill_first)
    model = PagedFakeModel(sched)
    prompt = [3 + 5 * i for i in range(18)]
    samples = [create_request(f"s{i}", prompt=prompt, max_new_tokens=3) for i in range(4)]
    other = create_request("other", prompt_len=6, max_new_tokens=3)
    for r in samples + [other]:
        sched.add_request(r)
    fed_prompt = 0
    while sched.has_unfinished():
        out, _ = model.step()
        assert out.chunks, "a step with nothing scheduled"
        fed_prompt += sum(len(c.token_ids) for c in out.chunks if c.request_id.startswith("s")
                          and c.start_pos < len(prompt))
    for r in samples:
        assert r.output_token_ids == reference_outputs(prompt, 3)
    assert [r.num_cached_tokens for r in samples] == [0, 16, 16, 16]
    assert fed_prompt == 18 + 3 * 2  # computed once, and the last two tokens for each other sample
    assert other.output_token_ids == reference_outputs(other.prompt_token_ids, 3)
    assert_pool_whole(sched)


def test_in_step_sharing_is_off_without_the_cache_and_for_prompt_logprobs():
    prompt = list(range(1, 18))
    for kw, rid_kw in (({"prefix_caching": False}, {}), ({}, {"prompt_logprobs": 1})):
        sched = create_scheduler(page_size=PS, **kw)
        model = PagedFakeModel(sched)
        reqs = [create_request(f"r{i}", prompt=prompt, max_new_tokens=2, **rid_kw) for i in range(3)]
        for r in reqs:
            sched.add_request(r)
        out, _ = model.step()
        assert len(out.chunks) == 3 and all(c.start_pos == 0 for c in out.chunks)
        model.run()
        assert all(r.num_cached_tokens == 0 for r in reqs)

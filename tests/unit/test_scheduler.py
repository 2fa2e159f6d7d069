import random
import subprocess
import sys
from pathlib import Path

import pytest
from scheduler_utils import (FakeModel, check_invariants, create_request, create_scheduler, reference_outputs,
                             run_steps)

from tandem.request import FinishReason, RequestStatus
from tandem.scheduler import ScheduledChunk, SchedulerOutput


def assert_all_pages_free(sched):
    assert sched.allocator.num_free == sched.allocator.num_total
    assert not sched.has_unfinished() and sched.num_running == 0 and sched.num_waiting == 0


def step(sched, model):
    out = sched.schedule()
    check_invariants(sched, out)
    return out, sched.update(model(out))


# ---- intake ------------------------------------------------------------------------------------

def test_add_request_validation():
    sched = create_scheduler(max_model_len=16, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(create_request("a", prompt=[]))
    with pytest.raises(ValueError, match=r"16 tokens.*max_model_len is 16"):
        sched.add_request(create_request("a", prompt_len=16))
    sched.add_request(create_request("a", prompt_len=15))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(create_request("a", prompt_len=3))
    assert sched.num_waiting == 1 and sched.get_request("a") is not None


def test_request_that_cannot_fit_the_pool_alone_is_refused():
    # 3 pages of 4 tokens hold 12 tokens; prompt 8 + 5 outputs needs KV for 12 (the last is never fed).
    sched = create_scheduler(page_size=4, num_pages=3)
    sched.add_request(create_request("fits", prompt_len=8, max_new_tokens=5))
    with pytest.raises(ValueError, match="4 KV pages"):
        sched.add_request(create_request("too-long", prompt_len=8, max_new_tokens=6))
    # Lookahead slots count too.
    sched = create_scheduler(page_size=4, num_pages=3, num_lookahead_tokens=1)
    with pytest.raises(ValueError, match="KV pages"):
        sched.add_request(create_request("x", prompt_len=8, max_new_tokens=5))


def test_output_properties():
    chunk = ScheduledChunk("a", (1, 2, 3), 0, (0,), 3, create_request("a").sampling_params, True)
    assert chunk.num_tokens == 3 and chunk.end_pos == 3
    assert SchedulerOutput(chunks=(chunk, chunk)).num_tokens == 6
    assert SchedulerOutput(chunks=()).is_empty
    assert not SchedulerOutput(chunks=(), finished_ids=("a",)).is_empty
    assert create_scheduler().schedule().is_empty


# ---- budget, chunked prefill, decode batching ----------------------------------------------------

def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks():
    sched = create_scheduler(max_num_batched_tokens=16, page_size=4)
    req = create_request("a", prompt_len=40, max_new_tokens=3)
    sched.add_request(req)
    model = FakeModel(page_size=4)
    outs, _ = run_steps(sched, model)
    got = [(c.start_pos, c.token_ids, c.sample) for o in outs for c in o.chunks]
    prompt = tuple(req.prompt_token_ids)
    assert got[:3] == [(0, prompt[:16], False), (16, prompt[16:32], False), (32, prompt[32:], True)]
    # Then one token per decode step: the previous output, at the next position.
    assert [(s, len(t), smp) for s, t, smp in got[3:]] == [(40, 1, True), (41, 1, True)]
    assert got[3][1] == (req.output_token_ids[0],)
    assert req.output_token_ids == reference_outputs(req.prompt_token_ids, 3)
    assert req.finish_reason is FinishReason.LENGTH
    assert_all_pages_free(sched)


def test_decodes_and_a_prefill_chunk_share_the_budget():
    sched = create_scheduler(max_num_batched_tokens=10, page_size=4)
    a, b, c = (create_request(i, prompt_len=4, max_new_tokens=20) for i in "abc")
    sched.add_request(a)
    sched.add_request(b)
    model = FakeModel(page_size=4)
    out, _ = step(sched, model)  # both prompts: 8 tokens
    assert [(ch.request_id, ch.num_tokens) for ch in out.chunks] == [("a", 4), ("b", 4)]
    long = create_request("long", prompt_len=30, max_new_tokens=2)
    sched.add_request(long)
    sched.add_request(c)
    out, _ = step(sched, model)  # 2 decodes + 8 of the long prompt; "c" waits behind it (FCFS)
    assert [(ch.request_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        ("a", 4, 1), ("b", 4, 1), ("long", 0, 8)]
    out, _ = step(sched, model)  # running requests first, in admission order
    assert [(ch.request_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        ("a", 5, 1), ("b", 5, 1), ("long", 8, 8)]
    outs, _ = run_steps(sched, model)
    for r in (a, b, c, long):
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_new_tokens)
    assert_all_pages_free(sched)


def test_token_budget_caps_decode_batch():
    sched = create_scheduler(max_num_batched_tokens=3, page_size=4)
    reqs = [create_request(i, prompt_len=1, max_new_tokens=6) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    outs, _ = run_steps(sched, FakeModel(page_size=4))
    assert all(o.num_tokens <= 3 for o in outs)
    assert max(o.num_tokens for o in outs) == 3
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 6)
    assert_all_pages_free(sched)


def test_decode_batching_runs_every_request_each_step():
    sched = create_scheduler(max_num_batched_tokens=64, page_size=4)
    reqs = [create_request(i, prompt_len=3 + i, max_new_tokens=5) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    outs, _ = run_steps(sched, FakeModel(page_size=4))
    assert len(outs) == 5  # one prefill step (samples the first token), then 4 decode steps
    assert [c.num_tokens for c in outs[0].chunks] == [3, 4, 5, 6]
    for i, o in enumerate(outs[1:]):
        assert [(c.request_id, c.num_tokens, c.sample) for c in o.chunks] == [(str(j), 1, True) for j in range(4)]
        assert [c.start_pos for c in o.chunks] == [3 + j + i for j in range(4)]
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 5)
    assert_all_pages_free(sched)


def test_max_num_seqs_caps_running_and_admission_is_fcfs():
    sched = create_scheduler(max_num_seqs=2, page_size=4)
    reqs = [create_request(i, prompt_len=2, max_new_tokens=2 + i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    admitted = []
    outs, _ = run_steps(sched, FakeModel(page_size=4))
    for o in outs:
        assert len(o.chunks) <= 2
        admitted += [c.request_id for c in o.chunks if c.start_pos == 0]
    assert admitted == ["0", "1", "2", "3", "4"]
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_new_tokens)
    assert_all_pages_free(sched)


def test_batch_ahead_counts_the_queued_requests_with_room_to_join():
    """Six 8-token prompts, a budget of 16 tokens a step (two prompts), room for four: the first step runs
    two prompts and says four rows are ahead (two running, two queued with room); once four run, the
    two beyond the cap do not count."""
    sched = create_scheduler(max_num_seqs=4, page_size=4, max_num_batched_tokens=16)
    for i in range(6):
        sched.add_request(create_request(i, prompt_len=8, max_new_tokens=4))
    model = FakeModel(page_size=4)
    out, _ = step(sched, model)
    assert [c.request_id for c in out.chunks] == ["0", "1"] and out.batch_ahead == 4
    out, _ = step(sched, model)
    assert sched.num_running == 4 and out.batch_ahead == 4


def test_prefill_first_admits_a_burst_before_anyone_decodes():
    """Six 8-token prompts, two per step (16-token budget): with prefill_first the first three steps
    carry prompts only, the requests admitted first waiting for the rest; then all six decode
    together. Outputs are the reference's and every page comes back."""
    sched = create_scheduler(max_num_batched_tokens=16, page_size=4, prefill_first=True)
    reqs = [create_request(i, prompt_len=8, max_new_tokens=3) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    outs, _ = run_steps(sched, FakeModel(page_size=4))
    for o in outs[:3]:
        assert all(c.start_pos == 0 and len(c.token_ids) == 8 for c in o.chunks), o.chunks
    assert sorted(c.request_id for c in outs[3].chunks) == [str(i) for i in range(6)]
    assert all(len(c.token_ids) == 1 for c in outs[3].chunks)
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_new_tokens)
    assert_all_pages_free(sched)


def test_prefill_first_decodes_while_the_head_cannot_join():
    """Room for two running requests, three submitted: while the third cannot join (no room), the two
    decode every step; it is admitted, in a prompt-only step, once one of them has finished."""
    sched = create_scheduler(max_num_seqs=2, page_size=4, prefill_first=True)
    reqs = [create_request(0, max_new_tokens=3), create_request(1, max_new_tokens=5), create_request(2)]
    for r in reqs:
        sched.add_request(r)
    outs, _ = run_steps(sched, FakeModel(page_size=4))
    ids = [sorted(c.request_id for c in o.chunks) for o in outs]
    assert ids[:3] == [["0", "1"], ["0", "1"], ["0", "1"]], ids
    joined = next(i for i, step in enumerate(ids) if "2" in step)
    assert ids[joined] == ["2"] and all("0" not in step for step in ids[joined:]), ids
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_new_tokens)
    assert_all_pages_free(sched)


def test_prefill_first_with_arrivals_pages_short_and_long_prompts_matches_the_reference():
    """Random arrivals, prompts longer than the budget (chunked), a pool that runs short (retraction):
    every request still gets the reference's tokens, and the loop never stalls (run_steps bounds it)."""
    rng = random.Random(7)
    sched = create_scheduler(max_num_batched_tokens=24, max_num_seqs=5, page_size=4, num_pages=40,
                             prefill_first=True)
    reqs = [create_request(i, prompt_len=rng.randint(1, 60), max_new_tokens=rng.randint(1, 12)) for i in range(20)]
    arrivals = {rng.randint(0, 40): [] for _ in range(10)}
    for r in reqs:
        rng.choice(list(arrivals.values())).append(r)

    model, last_arrival = FakeModel(page_size=4), max(arrivals)
    for step in range(2000):
        for r in arrivals.get(step, []):
            sched.add_request(r)
        if step > last_arrival and not sched.has_unfinished():
            break
        out = sched.schedule()
        check_invariants(sched, out)
        assert out.chunks or not sched.has_unfinished() or sched.num_running == 0, "a step with work left ran nothing"
        sched.update(model(out))
    else:
        raise AssertionError("not finished after 2000 steps")
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_new_tokens)
    assert_all_pages_free(sched)


def test_head_of_queue_that_does_not_fit_blocks_later_requests():
    sched = create_scheduler(page_size=4, num_pages=6)
    sched.add_request(create_request("big0", prompt_len=16, max_new_tokens=8))  # 4 pages, then 5
    sched.add_request(create_request("big1", prompt_len=12, max_new_tokens=1))  # 3 pages: does not fit
    sched.add_request(create_request("small", prompt_len=2, max_new_tokens=1))  # would fit, must not overtake
    model = FakeModel(page_size=4)
    out, _ = step(sched, model)
    assert [c.request_id for c in out.chunks] == ["big0"]
    assert sched.num_waiting == 2 and sched.allocator.num_free == 2  # big1 needs 3, small only 1
    outs, _ = run_steps(sched, model)
    admitted = [c.request_id for o in outs for c in o.chunks if c.start_pos == 0]
    assert admitted == ["big1", "small"]
    assert_all_pages_free(sched)


# ---- preemption ----------------------------------------------------------------------------------

def test_preemption_retracts_the_newest_request_and_recomputes_it():
    # 6 pages of 4 tokens: two requests of prompt 8 fill 4 pages, and they run out while decoding.
    sched = create_scheduler(page_size=4, num_pages=6)
    a = create_request("a", prompt_len=8, max_new_tokens=12)
    b = create_request("b", prompt_len=8, max_new_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    model = FakeModel(page_size=4)
    outs, _ = run_steps(sched, model)
    preempt_steps = [i for i, o in enumerate(outs) if o.preempted_ids]
    assert preempt_steps and all(outs[i].preempted_ids == ("b",) for i in preempt_steps)
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    # The first recompute of "b" feeds its prompt and the outputs it had, from position 0.
    first = preempt_steps[0]
    b_outputs_then = len([c for o in outs[:first] for c in o.chunks if c.request_id == "b" and c.sample])
    recompute = next(c for o in outs[first + 1:] for c in o.chunks if c.request_id == "b")
    assert recompute.start_pos == 0
    assert list(recompute.token_ids) == (b.prompt_token_ids + b.output_token_ids)[:8 + b_outputs_then]
    assert recompute.num_prompt_tokens == 8
    # Outputs are those of each request run alone.
    assert a.output_token_ids == reference_outputs(a.prompt_token_ids, 12)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 6)
    assert_all_pages_free(sched)


def test_a_request_that_needs_a_page_retracts_itself_when_it_is_the_newest():
    sched = create_scheduler(page_size=4, num_pages=4)
    a = create_request("a", prompt_len=6, max_new_tokens=3)  # 2 pages cover it to the end
    b = create_request("b", prompt_len=8, max_new_tokens=2)  # needs a 3rd page for its first decode
    sched.add_request(a)
    sched.add_request(b)
    model = FakeModel(page_size=4)
    step(sched, model)
    assert sched.allocator.num_free == 0
    out, _ = step(sched, model)
    assert out.preempted_ids == ("b",)
    assert [c.request_id for c in out.chunks] == ["a"]
    assert sched.waiting[0] is b and b.status is RequestStatus.WAITING and b.page_ids == []
    assert b.num_computed_tokens == 0 and b.output_token_ids == [reference_outputs(b.prompt_token_ids, 1)[0]]
    run_steps(sched, model)
    assert a.output_token_ids == reference_outputs(a.prompt_token_ids, 3)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 2)
    assert_all_pages_free(sched)


def test_no_admission_in_a_step_that_preempted():
    sched = create_scheduler(page_size=4, num_pages=5)
    a = create_request("a", prompt_len=8, max_new_tokens=8)
    b = create_request("b", prompt_len=8, max_new_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    model = FakeModel(page_size=4)
    step(sched, model)  # 4 of 5 pages used
    c = create_request("c", prompt_len=1, max_new_tokens=1)
    sched.add_request(c)
    out, _ = step(sched, model)  # a takes the last page; b retracts itself and frees 2 pages
    assert out.preempted_ids == ("b",) and [ch.request_id for ch in out.chunks] == ["a"]
    assert sched.allocator.num_free == 2  # c would fit, but pages are short: it is not admitted
    assert list(sched.waiting) == [b, c]
    run_steps(sched, model)
    for r in (a, b, c):
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_new_tokens)
    assert_all_pages_free(sched)


# ---- abort and finish ------------------------------------------------------------------------

def test_abort_waiting_and_running_requests():
    sched = create_scheduler(max_num_seqs=1, page_size=4)
    run, wait = create_request("run", prompt_len=5), create_request("wait", prompt_len=5)
    sched.add_request(run)
    sched.add_request(wait)
    model = FakeModel(page_size=4)
    step(sched, model)
    assert run.status is RequestStatus.RUNNING and wait.status is RequestStatus.WAITING
    assert sched.abort("wait") is wait
    assert sched.abort("run") is run
    for r in (run, wait):
        assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.ABORT and r.page_ids == []
    assert sched.abort("run") is None and sched.abort("nope") is None  # idempotent
    assert sched.get_request("run") is None
    assert_all_pages_free(sched)
    out = sched.schedule()
    assert out.finished_ids == ("wait", "run") and not out.chunks
    assert sched.schedule().is_empty  # reported once


def test_abort_between_schedule_and_update_drops_the_tokens():
    sched = create_scheduler(page_size=4)
    a, b = create_request("a", max_new_tokens=3), create_request("b", max_new_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    model = FakeModel(page_size=4)
    out = sched.schedule()
    sampled = model(out)
    sched.abort("a")
    upd = sched.update(sampled)
    assert list(upd.new_token_ids) == ["b"] and a.output_token_ids == []
    run_steps(sched, model)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 3)
    assert_all_pages_free(sched)


def test_finish_request_for_a_stop_string():
    sched = create_scheduler(page_size=4)
    req = create_request("a", max_new_tokens=10)
    sched.add_request(req)
    model = FakeModel(page_size=4)
    step(sched, model)
    step(sched, model)
    assert sched.finish_request("a", FinishReason.STOP) is req
    assert req.finish_reason is FinishReason.STOP and len(req.output_token_ids) == 2
    assert sched.finish_request("a", FinishReason.ABORT) is None and req.finish_reason is FinishReason.STOP
    assert sched.schedule().finished_ids == ("a",)
    assert_all_pages_free(sched)


# ---- stop conditions -----------------------------------------------------------------------------

def scripted(runs, **kwargs):
    """One request whose samples come from `runs`; returns (scheduler, request, model)."""
    lookahead = max(len(r) for r in runs) - 1
    sched = create_scheduler(page_size=4, num_lookahead_tokens=lookahead,
                             max_model_len=kwargs.pop("max_model_len", 256))
    req = create_request("a", **kwargs)
    sched.add_request(req)
    return sched, req, FakeModel(page_size=4, num_lookahead_tokens=lookahead, script={"a": list(runs)})


def test_eos_stops_and_is_kept_in_the_output():
    sched, req, model = scripted([[5], [6], [2], [7]], eos=(2,), max_new_tokens=10)
    _, updates = run_steps(sched, model)
    assert req.output_token_ids == [5, 6, 2] and req.finish_reason is FinishReason.STOP
    assert updates[-1].finished == [req] and updates[-1].new_token_ids == {"a": [2]}
    assert_all_pages_free(sched)


def test_ignore_eos_keeps_going_until_length():
    sched, req, model = scripted([[2], [2], [2]], eos=(2,), max_new_tokens=3, ignore_eos=True)
    run_steps(sched, model)
    assert req.output_token_ids == [2, 2, 2] and req.finish_reason is FinishReason.LENGTH
    assert_all_pages_free(sched)


def test_stop_token_ids_stop_even_with_ignore_eos():
    sched, req, model = scripted([[5], [9], [7]], stop_token_ids=[9], ignore_eos=True, max_new_tokens=10)
    run_steps(sched, model)
    assert req.output_token_ids == [5, 9] and req.finish_reason is FinishReason.STOP
    assert_all_pages_free(sched)


def test_max_new_tokens_gives_length():
    sched, req, model = scripted([[1], [1], [1], [1]], max_new_tokens=2)
    outs, _ = run_steps(sched, model)
    assert req.output_token_ids == [1, 1] and req.finish_reason is FinishReason.LENGTH and len(outs) == 2
    assert_all_pages_free(sched)


def test_max_model_len_gives_length():
    sched, req, model = scripted([[1]] * 10, prompt_len=6, max_new_tokens=100, max_model_len=9)
    run_steps(sched, model)
    assert req.output_token_ids == [1, 1, 1] and req.num_tokens == 9 and req.finish_reason is FinishReason.LENGTH
    assert_all_pages_free(sched)


def test_multi_token_update_is_truncated_at_eos():
    sched, req, model = scripted([[4, 5], [6, 2, 8, 9]], eos=(2,), max_new_tokens=10)
    _, updates = run_steps(sched, model)
    assert req.output_token_ids == [4, 5, 6, 2] and req.finish_reason is FinishReason.STOP
    assert updates[-1].new_token_ids == {"a": [6, 2]}
    assert_all_pages_free(sched)


def test_multi_token_update_is_truncated_at_max_new_tokens_and_max_model_len():
    sched, req, model = scripted([[1, 2, 3, 4]], max_new_tokens=2)
    run_steps(sched, model)
    assert req.output_token_ids == [1, 2] and req.finish_reason is FinishReason.LENGTH
    sched, req, model = scripted([[1], [2, 3, 4, 5]], prompt_len=8, max_model_len=11)
    run_steps(sched, model)
    assert req.output_token_ids == [1, 2, 3] and req.finish_reason is FinishReason.LENGTH
    assert_all_pages_free(sched)


def test_multi_token_update_counts_accepted_drafts_as_computed():
    sched, req, model = scripted([[4, 5, 6], [7], [8, 9]], prompt_len=8, max_new_tokens=6)
    outs, _ = run_steps(sched, model)
    # After a run of k tokens only the last one is new to the model: the next chunk feeds it alone.
    assert [(c.start_pos, c.token_ids) for o in outs for c in o.chunks][1:] == [(10, (6,)), (11, (7,))]
    assert req.output_token_ids == [4, 5, 6, 7, 8, 9]


# ---- lookahead -----------------------------------------------------------------------------------

def test_lookahead_pages_are_reserved_only_for_sampling_chunks():
    sched = create_scheduler(max_num_batched_tokens=6, page_size=4, num_lookahead_tokens=3)
    req = create_request("a", prompt_len=8, max_new_tokens=4)
    sched.add_request(req)
    out = sched.schedule()  # chunk 0..6, no sample: 2 pages
    assert not out.chunks[0].sample and len(req.page_ids) == 2
    sched.update({})
    out = sched.schedule()  # chunk 6..8 samples: room for 8 + 3 tokens = 3 pages
    assert out.chunks[0].sample and len(req.page_ids) == 3
    sched.update({"a": [1, 2]})  # 10 tokens, 9 computed; decode needs 10 + 3 -> 4 pages
    sched.schedule()
    assert len(req.page_ids) == 4


def test_speculative_runs_with_preemption_match_the_plain_outputs():
    rng = random.Random(1)
    lookahead = 3
    sched = create_scheduler(max_num_batched_tokens=12, page_size=4, num_pages=12, num_lookahead_tokens=lookahead)
    reqs = [create_request(i, prompt_len=rng.randint(1, 20), max_new_tokens=rng.randint(1, 20)) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    model = FakeModel(page_size=4, num_lookahead_tokens=lookahead, run_length=lambda: rng.randint(1, 1 + lookahead))
    outs, _ = run_steps(sched, model)
    assert any(o.preempted_ids for o in outs)
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_new_tokens)
    assert_all_pages_free(sched)


# ---- update() contract ---------------------------------------------------------------------------

def test_update_rejects_bad_results_and_changes_nothing():
    sched = create_scheduler(max_num_batched_tokens=4, page_size=4, num_lookahead_tokens=1)
    a, b = create_request("a", prompt_len=2), create_request("b", prompt_len=6)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()  # a: whole prompt (samples); b: 2 of 6 tokens (does not sample)
    assert [c.sample for c in out.chunks] == [True, False]
    with pytest.raises(ValueError, match="did not sample"):
        sched.update({"a": [1], "b": [1]})
    with pytest.raises(ValueError, match="no tokens"):
        sched.update({})
    with pytest.raises(ValueError, match="3 tokens"):
        sched.update({"a": [1, 2, 3]})
    with pytest.raises(ValueError, match="0 tokens"):
        sched.update({"a": []})
    assert a.output_token_ids == [] and b.output_token_ids == []
    sched.update({"a": [1, 2]})
    assert a.output_token_ids == [1, 2]


# ---- randomized stress ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_random_stress(seed):
    rng = random.Random(seed)
    page_size, lookahead = 4, rng.choice([0, 2])
    sched = create_scheduler(max_num_batched_tokens=rng.choice([8, 16, 32]), max_num_seqs=rng.choice([3, 8]),
                             max_model_len=48, page_size=page_size, num_pages=16, num_lookahead_tokens=lookahead)
    model = FakeModel(page_size, lookahead, run_length=lambda: rng.randint(1, 1 + lookahead))
    expected, aborted, pending = {}, set(), []
    for i in range(80):
        prompt_len = rng.randint(1, 30)
        req = create_request(i, prompt_len=prompt_len, max_new_tokens=rng.randint(1, 48 - prompt_len))
        ref = reference_outputs(req.prompt_token_ids, req.sampling_params.max_new_tokens)
        if rng.random() < 0.3:  # make an EOS appear somewhere in its output
            req.eos_token_ids = frozenset({rng.choice(ref)})
        expected[req.request_id] = reference_outputs(req.prompt_token_ids, req.sampling_params.max_new_tokens,
                                                     tuple(req.eos_token_ids))
        pending.append(req)
    reqs = list(pending)
    preemptions = 0
    for _ in range(5000):
        while pending and rng.random() < 0.5:  # requests arrive over time
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        for r in list(sched.running) + list(sched.waiting):
            if rng.random() < 0.01:
                sched.abort(r.request_id)
                aborted.add(r.request_id)
        out = sched.schedule()
        check_invariants(sched, out)
        preemptions += len(out.preempted_ids)
        sampled = model(out)
        if sampled and rng.random() < 0.05:  # abort while the step is "on the GPU"
            rid = rng.choice(sorted(sampled))
            sched.abort(rid)
            aborted.add(rid)
        sched.update(sampled)
    else:
        raise AssertionError("stress run did not finish")
    assert preemptions > 0
    for r in reqs:
        assert r.status is RequestStatus.FINISHED
        if r.request_id in aborted:
            assert r.finish_reason is FinishReason.ABORT
            assert r.output_token_ids == expected[r.request_id][:len(r.output_token_ids)]
        else:
            assert r.output_token_ids == expected[r.request_id]
    assert_all_pages_free(sched)


# ---- no torch ------------------------------------------------------------------------------------

def test_scheduler_does_not_import_torch():
    src = Path(__file__).resolve().parents[2] / "src"
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('the CPU scheduler must not import torch')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import tandem.scheduler, tandem.request, tandem.config\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(src)}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

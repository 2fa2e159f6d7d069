"""Prefix caching end to end on the bundled demo pair (float32, CPU): outputs with the cache equal outputs
without it, token for token, in every scheduling mode; acceptance after a hit equals acceptance cold; no
page leaks under KV pressure; the flag, flush and counters."""

import pytest
import torch

import tandem
from tandem import Engine, SamplingParams
from tandem.cli import build_parser
from tandem.engine_flags import engine_kwargs
from tests.engine.helpers import instrument_preemptions

TARGET, DRAFT = tandem.demo_model_paths()
PAGE = 8
NEW = 12
BASE = dict(device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=4096, max_running_requests=8)
SPEC = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=DRAFT, speculative_adaptive="off")
CHAIN = dict(SPEC, speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
TREE = dict(SPEC, speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
CONFIGS = {
    "plain": dict(speculative_algorithm=None),
    "plain-no-overlap": dict(speculative_algorithm=None, disable_overlap_schedule=True),
    "chain": CHAIN,
    "chain-no-overlap": dict(CHAIN, disable_overlap_schedule=True),
    "tree": TREE,
    "adaptive": dict(CHAIN, speculative_adaptive="on"),
}

GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
PENALISED = SamplingParams(max_new_tokens=NEW, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.2, ignore_eos=True)
SYSTEM = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Entry point of the command.\"\"\"\n"


def tokens(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def conversation(engine):
    """The calls of a workload in order, each a (list of prompts, params): later calls reuse earlier
    prompts' pages (a shared system prompt, a follow-up turn, a prompt that is a prefix of a cached one,
    several samples of one prompt together); answers of earlier calls feed later prompts, so each is a
    function of the outputs so far."""
    sys_ids = tokens(engine, SYSTEM)
    q1, q2, q3 = (tokens(engine, t) for t in ("    parser = ", "    for name in ", "\n    return "))
    return [
        lambda out: ([sys_ids + q1], GREEDY),
        lambda out: ([sys_ids + q2, sys_ids + q1 + q2], GREEDY),  # shared system prompt, two at once
        lambda out: ([sys_ids + q1 + out[0][0] + q3], GREEDY),  # turn 2: turn 1's prompt and answer, and more
        lambda out: ([(sys_ids + q1)[:len(sys_ids) - 3]], GREEDY),  # a prefix of a cached prompt, last page partial
        lambda out: ([sys_ids + q2], SEEDED),
        lambda out: ([sys_ids + q1 + out[0][0] + q3], PENALISED),
        lambda out: ([sys_ids + q3] * 3, [SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=s, ignore_eos=True)
                                          for s in (1, 2, 3)]),  # n = 3 samples of one prompt
        lambda out: ([sys_ids + q1], GREEDY),  # turn 1 again: all of its prompt but its last token is cached
    ]


def run_conversation(engine) -> list[list]:
    outputs = []
    for call in conversation(engine):
        prompts, params = call([[o.token_ids for o in outs] for outs in outputs])
        outputs.append(engine.generate(input_ids=prompts, sampling_params=params))
    return outputs


def assert_pool_whole(engine):
    alloc = engine.scheduler.allocator
    assert not engine.has_unfinished()
    assert alloc.num_free + alloc.num_cached == alloc.num_total
    assert engine.flush_cache()
    assert alloc.num_free == alloc.num_total


@pytest.fixture(scope="module")
def reference():
    """The workload without a prefix cache, plain decoding, no overlap: every mode must give its tokens."""
    engine = Engine(TARGET, **BASE, speculative_algorithm=None, disable_overlap_schedule=True,
                    disable_prefix_caching=True)
    outputs = run_conversation(engine)
    assert engine.prefix_cache_stats().hits == 0
    return [[o.token_ids for o in outs] for outs in outputs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_with_the_cache_equal_outputs_without_it(name, reference):
    engine = Engine(TARGET, **BASE, **CONFIGS[name])
    outputs = run_conversation(engine)
    assert [[o.token_ids for o in outs] for outs in outputs] == reference
    cached = [[o.num_cached_tokens for o in outs] for outs in outputs]
    assert cached[0] == [0] and all(n > 0 for outs in cached[1:] for n in outs), cached
    assert all(n % PAGE == 0 for outs in cached for n in outs)
    first, again = outputs[0][0], outputs[-1][0]
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // PAGE * PAGE
    if CONFIGS[name].get("speculative_adaptive") == "off":
        # The draft KV at the cached pages is reused too: acceptance after the hit is acceptance cold.
        assert again.spec_accept_lengths == first.spec_accept_lengths and len(first.spec_accept_lengths) > 1
    stats = engine.prefix_cache_stats()
    assert stats.queries == sum(len(o.prompt_token_ids) for outs in outputs for o in outs)
    assert stats.hits == sum(n for outs in cached for n in outs) and stats.cached_pages > 0
    assert_pool_whole(engine)


@pytest.mark.parametrize("name", ["plain", "chain"])
def test_shared_prefixes_under_kv_pressure_leave_no_page_behind(name):
    """Twelve prompts on one system prompt at once in a pool that holds a few of them: requests are
    retracted and cached pages evicted, outputs still equal an engine without the cache, and every page
    comes back."""
    kw = dict(BASE, max_total_tokens=200, **CONFIGS[name])
    cold = Engine(TARGET, **dict(kw, disable_prefix_caching=True))
    sys_ids = tokens(cold, SYSTEM)
    prompts = [sys_ids + tokens(cold, f"    x{i} = {i} * ") for i in range(12)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in cold.generate(input_ids=prompts, sampling_params=params)]
    engine = Engine(TARGET, **kw)
    engine.generate(input_ids=prompts[:1], sampling_params=params)  # the system prompt is cached
    preempted = instrument_preemptions(engine)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == want
    assert preempted and sum(o.num_cached_tokens > 0 for o in got) >= 6
    assert_pool_whole(engine)


def page_tables(engine) -> dict[str, tuple[int, ...]]:
    """Records each request's page ids as the scheduler hands them out."""
    tables: dict[str, tuple[int, ...]] = {}
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        tables.update({c.request_id: c.page_ids for c in out.chunks})
        return out

    engine.scheduler.schedule = recording
    return tables


def kv_at(cache, pages: tuple[int, ...], num_positions: int) -> torch.Tensor:
    """[layers, 2, positions, kv heads, head dim]: a request's KV read through its page table."""
    slots = torch.tensor([pages[t // PAGE] * PAGE + t % PAGE for t in range(num_positions)])
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in zip(cache.k, cache.v)])


@pytest.mark.parametrize("name,diverge", [("chain", False), ("tree", False), ("chain", True)])
def test_a_hit_gives_the_kv_a_cold_prefill_computes_in_both_caches(name, diverge):
    """Turn 2 starts from turn 1's pages (its prompt and answer, computed by a prefill and by decode steps):
    the target's and the draft's KV at every prompt position, read through turn 2's page table, is what a
    cold engine's prefill of the same prompt computes (up to float32 rounding between the two paths). With
    `diverge`, turn 2 leaves turn 1 right after a page, whose last draft entry was made with turn 1's next
    token: it must not be reused. A draft entry made with another next token, or a boundary entry written
    with a missing feature, is off by far more than rounding."""
    kw = dict(BASE, **CONFIGS[name], disable_overlap_schedule=True)
    hot, cold = Engine(TARGET, **kw), Engine(TARGET, **kw, disable_prefix_caching=True)
    sys_ids = tokens(hot, SYSTEM)
    turn1 = hot.generate(input_ids=[sys_ids], sampling_params=GREEDY)[0]
    seq = sys_ids + turn1.token_ids
    if diverge:
        cut = (len(seq) // PAGE - 1) * PAGE
        prompt = seq[:cut] + [(seq[cut] + 1) % hot.arch.vocab_size] + tokens(hot, "\n    return ")
    else:
        prompt = seq + tokens(hot, "\n    return ")
    n = len(prompt)
    found = []
    for engine in (hot, cold):
        tables = page_tables(engine)
        out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))[0]
        pages = tables[out.request_id]
        found.append((out, kv_at(engine.runner.kv_cache, pages, n),
                      kv_at(engine.runner.spec.drafter.kv_cache, pages, n)))
    (hit, target_hot, draft_hot), (miss, target_cold, draft_cold) = found
    assert hit.token_ids == miss.token_ids
    torch.testing.assert_close(target_hot, target_cold, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(draft_hot, draft_cold, rtol=1e-4, atol=1e-4)
    assert hit.num_cached_tokens == (cut - PAGE if diverge else (n - 1) // PAGE * PAGE) > 0
    assert miss.num_cached_tokens == 0


def test_pages_of_a_dormant_request_serve_the_target_and_the_request_that_hits_them_runs_dormant(reference):
    """The adaptive policy admits the first request dormant (no draft KV in its pages). Its follow-up turn
    starts from those pages without asking the policy and runs dormant too (its draft would have had no
    KV to attend to); tokens stay those of an engine without the cache."""
    from tests.speculative.test_dormant_decode import DormantEvery

    engine = Engine(TARGET, **BASE, **dict(CHAIN, speculative_adaptive="on"))
    engine.runner.spec.policy = DormantEvery(engine.runner.spec.policy, every=2)  # 1st, 3rd, ... dormant
    outputs = run_conversation(engine)
    assert [[o.token_ids for o in outs] for outs in outputs] == reference
    turn2 = outputs[2][0]
    assert turn2.num_cached_tokens > 2 * PAGE and set(turn2.spec_accept_lengths) == {1}  # it never drafted
    asked = engine.runner.spec.policy.admissions
    by_policy = asked - asked // 2  # (every odd admission)
    assert engine.runner.spec.stats.dormant_admitted > by_policy  # the others were the cache's hits
    assert_pool_whole(engine)


def test_flush_while_a_request_holds_pages():
    engine = Engine(TARGET, **BASE, speculative_algorithm=None)
    prompt = tokens(engine, SYSTEM)
    engine.generate(input_ids=[prompt], sampling_params=GREEDY)
    assert engine.prefix_cache_stats().cached_pages > 0
    rid = engine.add_request(prompt + [5], SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    assert not engine.flush_cache()  # the running request holds the pages it hit
    assert engine.scheduler.allocator.num_cached == 0
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert_pool_whole(engine)


def test_prompt_logprobs_requests_run_their_whole_prompt():
    engine = Engine(TARGET, **BASE, speculative_algorithm=None)
    prompt = tokens(engine, SYSTEM)
    params = SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=1)
    cold, again = (engine.generate(input_ids=[prompt], sampling_params=params)[0] for _ in range(2))
    assert again.num_cached_tokens == 0
    assert [(lp.token_id, lp.logprob) for lp in again.prompt_logprobs[1:]] == [
        (lp.token_id, lp.logprob) for lp in cold.prompt_logprobs[1:]]


def test_disable_prefix_caching_flag_and_its_alias():
    for flag in ("--disable-prefix-caching", "--disable-radix-cache"):
        ns = build_parser().parse_args(["generate", flag])
        assert engine_kwargs(ns)["disable_prefix_caching"] is True
    assert engine_kwargs(build_parser().parse_args(["generate"]))["disable_prefix_caching"] is False
    engine = Engine(TARGET, **BASE, speculative_algorithm=None, disable_prefix_caching=True)
    prompt = tokens(engine, SYSTEM)
    outs = [engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    alloc = engine.scheduler.allocator
    assert alloc.num_cached == 0 and alloc.num_free == alloc.num_total


@pytest.mark.parametrize("name", ["plain", "chain", "tree"])
def test_samples_of_one_new_prompt_share_its_prefill(name):
    """Three seeded samples of a prompt nobody sent before, added together (what `n` = 3 sends): the first
    computes the prompt, the others start from its pages, and each sample's tokens equal its tokens from an
    engine without the cache."""
    prompt_text = SYSTEM + "    parser = argparse.ArgumentParser(description=__doc__)\n"
    params = [SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=s, ignore_eos=True) for s in (4, 5, 6)]
    outs = {}
    for cache in (True, False):
        engine = Engine(TARGET, **BASE, **CONFIGS[name], disable_prefix_caching=not cache)
        prompt = tokens(engine, prompt_text)
        outs[cache] = engine.generate(input_ids=[prompt] * 3, sampling_params=params)
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    full = (len(prompt) - 1) // PAGE * PAGE
    assert [o.num_cached_tokens for o in outs[True]] == [0, full, full]

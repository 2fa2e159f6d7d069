"""Fuzzing `SamplingParams` and `Engine.add_request` directly, speculation on: extreme floats and
integers, NaN and infinities, huge and empty lists, every sampling feature and grammar field together.
Each request either raises ValueError at once or runs (until it ends, or is aborted after a few steps);
afterwards every KV page is free and a normal request gives the output it gave before. A sweep sets
every field to every edge value in turn; its negative control finds the value that once killed the
engine core (temperature 1e39, which the float32 temperature table cannot hold) when the range check
is taken out."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tandem.request
from tandem import Engine, SamplingParams

EXAMPLES = 150  # about 15 s on a CPU
MAX_STEPS = 12  # a request still running then is aborted (the fuzz is about admission, not length)
PROMPT = [1] + list(range(20, 59))  # 40 tokens: two full pages, which later requests find in the prefix cache
REFERENCE = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

# Values at and past the edges of what float32 / int32 / int64 hold, besides ordinary ones.
EDGE_FLOATS = [0.0, -0.0, 1e-46, 1e-7, 0.5, 1.0, 2.0, 100.0, 1e9, 3.4028234e38, 3.5e38, 1e39, 1e308,
               -1.0, -1e39, float("inf"), float("-inf"), float("nan")]
EDGE_INTS = [-(2**63) - 1, -(2**63), -2, -1, 0, 1, 2, 5, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**12, 10**30]
FLOATS = st.sampled_from(EDGE_FLOATS) | st.floats(allow_nan=True, allow_infinity=True)
INTS = st.sampled_from(EDGE_INTS) | st.integers(-3, 400)
WRONG_TYPE = st.sampled_from([None, True, "1", [1], {"a": 1}, 1.5])
ANY = WRONG_TYPE | FLOATS | INTS
SMALL_COUNTS = st.sampled_from([1, 2, 4]) | INTS  # max_new_tokens: mostly short


# Typical values of every field (each present or not), so that most requests are valid but for the
# one or two fields a draw then replaces with an extreme value or a wrong type.
TYPICAL = {
    "max_new_tokens": st.sampled_from([1, 2, 4]),
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.9, 1.0]), "min_p": st.sampled_from([0.0, 0.1]), "top_k": st.sampled_from([-1, 0, 5]),
    "seed": st.none() | st.integers(0, 1000),
    "repetition_penalty": st.sampled_from([1.0, 1.2]), "frequency_penalty": st.sampled_from([0.0, 0.5]),
    "presence_penalty": st.sampled_from([0.0, -0.5]),
    "stop": st.none() | st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.none() | st.lists(st.integers(0, 300), max_size=3),
    "ignore_eos": st.booleans(), "min_tokens": st.sampled_from([0, 1]),
    "logit_bias": st.none() | st.dictionaries(st.integers(0, 300), st.floats(-100, 100), max_size=3),
    "logprobs": st.none() | st.integers(0, 3), "prompt_logprobs": st.none() | st.integers(0, 2),
    "skip_special_tokens": st.booleans(),
    "json_schema": st.none() | st.just({"type": "object"}), "regex": st.none() | st.just("[ab]{1,3}"),
}
EXTREME = {
    "max_new_tokens": INTS | WRONG_TYPE, "temperature": FLOATS | WRONG_TYPE, "top_p": FLOATS, "min_p": FLOATS, "top_k": INTS,
    "seed": INTS | WRONG_TYPE, "repetition_penalty": FLOATS, "frequency_penalty": FLOATS, "presence_penalty": FLOATS,
    "stop": ANY | st.just(["x"] * 300) | st.just([""]) | st.just([]),
    "stop_token_ids": st.lists(INTS, max_size=3) | st.just(list(range(5000))) | ANY,
    "ignore_eos": ANY, "min_tokens": INTS | WRONG_TYPE,
    "logit_bias": st.dictionaries(INTS, FLOATS, max_size=3) | st.just({i: 1.0 for i in range(301)}) | ANY,
    "logprobs": INTS | WRONG_TYPE, "prompt_logprobs": INTS | WRONG_TYPE, "skip_special_tokens": ANY,
    "json_schema": st.sampled_from([{"type": "nope"}, "{not json", 5, {"type": "object"}]),
    "regex": st.sampled_from(["(unclosed", "", 7]),
}


@st.composite
def fields(draw) -> dict:
    """Keyword arguments of SamplingParams: typical values, one or two of them made extreme."""
    kwargs = draw(st.fixed_dictionaries({}, optional=TYPICAL))
    if "json_schema" in kwargs and "regex" in kwargs:
        del kwargs["regex"]  # mostly one constraint (two is one of the extremes below)
    for name in draw(st.lists(st.sampled_from(sorted(EXTREME)), min_size=1, max_size=2, unique=True)):
        kwargs[name] = draw(EXTREME[name])
    return kwargs


def run_one(engine: Engine, kwargs: dict) -> str:
    """'refused' (ValueError, nothing queued) or 'ran'. Any other exception fails the fuzz."""
    alloc = engine.scheduler.allocator
    try:
        params = SamplingParams(**kwargs)
        rid = engine.add_request(PROMPT, params)
    except ValueError:
        assert not engine.has_unfinished() and alloc.num_used == 0
        return "refused"
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        engine.step()
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert alloc.num_used == 0, "a fuzzed request left KV pages in use"
    return "ran"


def fuzz(engine: Engine, examples: int) -> dict[str, int]:
    seen = {"refused": 0, "ran": 0}

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fields())
    def case(kwargs):
        seen[run_one(engine, kwargs)] += 1

    case()
    return seen


def every_field_at_every_edge():
    """A plain request with one field set to each edge value and wrong type in turn (the fuzz above
    draws combinations; this sweep leaves no single value to chance)."""
    lists = {"stop": [["x"] * 300, [""], [], "ab"], "stop_token_ids": [[10**12], [-1], list(range(5000)), [True]],
             "logit_bias": [{10**12: 1.0}, {5: 1e39}, {i: 1.0 for i in range(301)}, {True: 1.0}, {}],
             "json_schema": [{"type": "nope"}, "{not json", 5], "regex": ["(unclosed", "", 7]}
    base = {"max_new_tokens": 2, "temperature": 0.7, "seed": 3}
    for name in sorted(TYPICAL):
        for value in EDGE_FLOATS + EDGE_INTS + list(WRONG_TYPE.elements) + lists.get(name, []):
            yield {**base, name: value}


def sweep(engine: Engine) -> dict[str, int]:
    seen = {"refused": 0, "ran": 0}
    for kwargs in every_field_at_every_edge():
        seen[run_one(engine, kwargs)] += 1
    return seen


@pytest.fixture(scope="module")
def engine():
    with Engine(device="cpu", dtype="float32") as e:  # the demo pair with its EAGLE-3 head
        yield e


def test_fuzzed_requests_are_refused_or_run_and_the_engine_stays_whole(engine):
    before = engine.generate(input_ids=[PROMPT], sampling_params=REFERENCE)[0].token_ids
    seen = fuzz(engine, EXAMPLES)
    assert seen["refused"] > 10 and seen["ran"] > 10, seen  # the fuzz reaches both sides
    alloc = engine.scheduler.allocator
    assert not engine.has_unfinished() and alloc.num_used == 0
    assert engine.prefix_cache_stats().hits > 0  # the fuzzed requests shared the prompt's cached pages
    assert engine.flush_cache() and alloc.num_free == alloc.num_total
    assert engine.generate(input_ids=[PROMPT], sampling_params=REFERENCE)[0].token_ids == before


def test_every_field_at_every_edge_is_refused_or_runs(engine):
    before = engine.generate(input_ids=[PROMPT], sampling_params=REFERENCE)[0].token_ids
    seen = sweep(engine)
    assert seen["ran"] > 50 and seen["refused"] > 300, seen
    assert engine.generate(input_ids=[PROMPT], sampling_params=REFERENCE)[0].token_ids == before


def test_the_sweep_finds_a_temperature_float32_cannot_hold_without_the_range_check(monkeypatch):
    # The check as it was: any finite number passes, so 1e39 reaches the float32 table in a step.
    import math

    monkeypatch.setattr(tandem.request, "_float32",
                        lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))
    with Engine(device="cpu", dtype="float32") as fresh:
        with pytest.raises(RuntimeError, match="overflow"):
            sweep(fresh)

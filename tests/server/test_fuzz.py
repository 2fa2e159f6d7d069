"""Schema-driven fuzzing of both POST endpoints against the live server (loopback, seeded, bounded):
bodies drawn from the request models' own JSON schemas, then mutated (a field replaced by arbitrary
JSON, unknown fields, lone surrogates, deep nesting, truncated bytes). Whatever arrives, the answer is
never a 5xx, errors keep OpenAI's shape, streams end with [DONE] or an error event, and afterwards
the server answers, nothing is left queued and every KV page is free again."""

from __future__ import annotations

import collections
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.conftest import API_KEY, MODEL_NAME
from tests.server.test_server import wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES = 100  # per endpoint: about 25 s each on a CPU
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


def bounded_schema(model) -> dict:
    """The model's schema with the costly knobs kept small (the fuzz is about parsing and validation,
    not long generations): few tokens, few samples."""
    schema = json.loads(json.dumps(model.model_json_schema()))
    props = schema["properties"]
    if "best_of" in props:
        props["best_of"]["anyOf"][0].update(maximum=3)
    for name in ("max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"):
        if name in props and "anyOf" in props[name]:
            props[name]["anyOf"][0].update(minimum=-2, maximum=6)
    props["n"].update(maximum=2)
    # Sampling values mostly in range, so that the schema's branch is mostly valid (mutations break it).
    for name, lo, hi in (("temperature", 0, 2), ("top_p", 0.05, 1), ("min_p", 0, 1), ("top_k", -1, 50),
                         ("frequency_penalty", -2, 2), ("presence_penalty", -2, 2), ("repetition_penalty", 0.5, 2),
                         ("seed", 0, 1000), ("prompt_logprobs", 0, 3), ("min_tokens", 0, 2)):
        if name in props:
            target = props[name]["anyOf"][0] if "anyOf" in props[name] else props[name]
            target.update(minimum=lo, maximum=hi)
    # Token ids mostly inside the vocabulary (past it is a 400, which the mutations reach anyway).
    if "stop_token_ids" in props:
        props["stop_token_ids"]["anyOf"][0]["items"].update(minimum=0, maximum=300)
    # Grammars: a few valid and invalid ones (random text is almost never a valid grammar), in two of
    # the fields that carry one (each optional field is present half the time: more would mostly
    # collide, one constraint per request); each compiles or is refused by name, never a 5xx.
    for name in ("reasoning_effort", "modalities"):  # accepted and ignored: nothing behind them to reach
        props.pop(name, None)
    for name in ("ebnf", "grammar", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
                 "structured_outputs"):
        props.pop(name, None)
    props["regex"] = {"enum": ["[ab]{1,3}", "x|y", "(unclosed"]}
    props["json_schema"] = {"enum": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "nope"}]}
    props["model"] = {"enum": [MODEL_NAME, MODEL_NAME, "another-model"]}  # mostly the served one (else a 404)
    props["response_format"] = {"enum": [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                                         {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]}
    return schema


def from_schema(schema: dict, defs: dict | None = None) -> st.SearchStrategy:
    """Values that a (pydantic-made) JSON schema admits: objects with their properties (each present
    or left out), anyOf, $ref, and the scalar types with their bounds."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: from_schema(v, defs) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v, defs) for k, v in props.items() if k not in required})
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(max_size=12)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


def bodies(model) -> st.SearchStrategy[bytes]:
    valid = from_schema(bounded_schema(model))
    fields = sorted(model.model_fields)

    @st.composite
    def mutated(draw):
        body = dict(draw(valid))
        kind = draw(st.sampled_from(["replace", "unknown", "surrogate", "deep", "none"]))
        if kind == "replace":
            body[draw(st.sampled_from(fields))] = draw(JSON)
        elif kind == "unknown":
            body[draw(st.text(min_size=1, max_size=8))] = draw(JSON)
        elif kind == "surrogate":
            field = draw(st.sampled_from(["stop", "model", "user"]))
            body[field] = "a" + draw(SURROGATE) + "b"
        elif kind == "deep":
            depth = draw(st.integers(60, 3000))
            return json.dumps(body)[:-1].encode() + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
        raw = json.dumps(body).encode()
        if draw(st.integers(0, 9)) == 0:
            raw = raw[: draw(st.integers(0, len(raw)))]  # truncated
        return raw

    return st.one_of(valid.map(lambda b: json.dumps(b).encode()), mutated())


def check_answer(http: httpx.Client, path: str, raw: bytes) -> int:
    streaming = b'"stream": true' in raw
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, (r.status_code, raw[:300], text[:500])
    if r.status_code >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
    elif streaming and r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events and (events[-1] == "[DONE]" or "error" in json.loads(events[-1])), events[-3:]
    return r.status_code


@pytest.mark.parametrize("path,model", [("/v1/completions", CompletionRequest),
                                        ("/v1/chat/completions", ChatCompletionRequest)], ids=["completions", "chat"])
def test_fuzzed_bodies_never_give_a_5xx(server, path, model):
    start = wait_idle(server)
    statuses = collections.Counter()
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(bodies(model))
        def fuzz(raw):
            statuses[check_answer(http, path, raw)] += 1

        fuzz()
        # The bodies reached both sides of validation: some generated, some were refused.
        assert statuses[200] >= 5 and statuses[400] >= 20, statuses
        assert http.get("/health").json()["queued_requests"] == 0
        r = http.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
        assert r.status_code == 200, r.text
    wait_idle(server, start['tandem:kv_pages_used{replica="0"}'])

"""Structured output through `tandem serve` (a live server, speculative: the target drafting for itself,
so drafts are accepted and every tree node's mask matters), and the request dialects that ask for it.

Every constrained output is checked by an independent validator (jsonschema, Python's re); bad
grammars are 400s naming their field, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tandem.bench.json_schemas import schemas

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(structured_server):
    return openai.OpenAI(base_url=structured_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_json_schema_with_the_openai_client(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Who?"}], max_tokens=200,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert out.usage.mean_accept_length > 1  # the self-draft is accepted under the grammar


def test_completions_json_object_and_streaming(client):
    out = client.completions.create(model=client.models.list().data[0].id, prompt="{", max_tokens=200, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=200,
                                       temperature=0.8, seed=4, stream=True, extra_body={"json_schema": SCHEMA})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("body,check", [
    ({"regex": r"[a-c]{2}-\d{3}"}, lambda t: re.fullmatch(r"[a-c]{2}-\d{3}", t)),
    ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"ebnf": 'root ::= "<" [xyz]+ ">"'}, lambda t: re.fullmatch(r"<[xyz]+>", t)),
    ({"guided_choice": ["red", "green", "blue (dark)"]}, lambda t: t in ("red", "green", "blue (dark)")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_json": json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 3})},
     lambda t: isinstance(json.loads(t), list)),
])
def test_sglang_and_vllm_dialects(structured_server, body, check):
    import httpx

    r = httpx.post(structured_server.url + "/v1/completions", timeout=60,
                   json={"prompt": "go", "max_tokens": 64, "temperature": 1.0, "seed": 1, **body})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert check(text), text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"regex": "(ab"}, "regex"),
    ({"ebnf": "root ::= nothing_here"}, "ebnf"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"regex": "a", "json_schema": {"type": "object"}}, "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_bad_grammars_are_400s_naming_the_field(structured_server, body, param):
    import httpx

    r = httpx.post(structured_server.url + "/v1/completions", json={"prompt": "go", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(structured_server.url + "/v1/completions", json={"prompt": "go", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_many_random_schemas_concurrently(client):
    """Twelve random schemas at once: constrained rows share batches with each other."""
    import concurrent.futures

    model = client.models.list().data[0].id
    batch = schemas(12, seed=21)

    def run(i):
        out = client.completions.create(model=model, prompt=f"doc {i}:", max_tokens=400, temperature=1.0, seed=i,
                                        extra_body={"json_schema": batch[i]})
        return out.choices[0]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        for i, choice in enumerate(pool.map(run, range(12))):
            assert choice.finish_reason == "stop", (i, choice.text)
            jsonschema.validate(json.loads(choice.text), batch[i])

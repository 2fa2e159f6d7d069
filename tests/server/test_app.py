"""The FastAPI app against a stand-in engine client (no engine process): fast checks of request
handling that need no model."""

from __future__ import annotations

import json
import warnings

import pytest

with warnings.catch_warnings():  # starlette suggests a different httpx package; this one works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from tandem.demo import byte_level_tokenizer
from tandem.server.app import build_app
from tandem.server.replicas import ReplicaSet
from tests.server.echo_client import EchoEngineClient


@pytest.fixture
def app_client():
    tok = byte_level_tokenizer()  # no chat template
    engine = EchoEngineClient()
    with TestClient(build_app(ReplicaSet([engine]), tok, "echo")) as http:
        http.engine = engine
        yield http


def test_chat_without_template_is_a_clear_400(app_client):
    r = app_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "no_chat_template" and err["param"] == "messages"
    assert "chat template" in err["message"] and "/v1/completions" in err["message"]


def test_completion_through_the_app(app_client):
    r = app_client.post("/v1/completions", json={"prompt": "abc中", "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "abc中" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert "mean_accept_length" not in body["usage"]  # not a speculative engine


def test_cached_tokens_in_usage_per_prompt_and_streamed(app_client):
    app_client.engine.cached_tokens = 4
    r = app_client.post("/v1/completions", json={"prompt": ["abcdef", "ghijkl"], "max_tokens": 3, "n": 2,
                                                 "temperature": 1.0})
    # Counted once per prompt, as prompt_tokens are (not once per sample).
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    with app_client.stream("POST", "/v1/completions", json={
            "prompt": "abcdef", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_flush_cache_and_its_alias(app_client):
    for path in ("/flush_cache", "/reset_prefix_cache"):
        r = app_client.post(path)
        assert r.status_code == 200 and r.json() == {"flushed": True}
    app_client.engine.holding_pages = 3
    r = app_client.post("/flush_cache")
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "cache_in_use" and "replica 0: 3 running requests" in err["message"]


def test_stop_string_found_by_the_front_end_aborts_the_request(app_client):
    # The echo engine knows nothing of stop strings: the front end cuts the text and aborts.
    r = app_client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 11, "stop": "o w"})
    choice = r.json()["choices"][0]
    assert choice["text"] == "hell" and choice["finish_reason"] == "stop"
    assert len(app_client.engine.aborted) == 1


# ---- hardening: inputs that parse but break later stages, auth on every page ----------------------


def test_lone_surrogates_and_deep_nesting_are_400s_naming_the_field(app_client):
    cases = [
        (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        (b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 2}', "prompt[1]"),
        (b'{"prompt": "hi", "max_tokens": 1, "stop": "\\udfff"}', "stop"),
        (b'{"prompt": "hi", "max_tokens": 1, "stop": ["x", "\\ud800"]}', "stop[1]"),
        (b'{"prompt": "hi", "\\ud800": 1}', "'\\ud800'"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # past the recursion limit
        (b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}", "prompt" + "[0]" * 63),  # past MAX_DEPTH
    ]
    for body, param in cases:
        r = app_client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body[:60], r.text)
        err = r.json()["error"]
        assert err["param"] == param, (body[:60], err)
        assert "surrogate" in err["message"] or "nested too deeply" in err["message"], err
    r = app_client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                        headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    assert app_client.engine.added == []  # nothing reached the engine
    assert app_client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2}).status_code == 200


def test_strict_types_and_stream_options_without_stream(app_client):
    for field, value in (("stream", "yes"), ("seed", "5"), ("seed", True), ("max_tokens", 2.0), ("logprobs", True),
                         ("temperature", "0.5"), ("ignore_eos", 1)):
        r = app_client.post("/v1/completions", json={"prompt": "x", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
    r = app_client.post("/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    r = app_client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role", r.text
    r = app_client.post("/v1/completions", json={"prompt": "x", "repetition_penalty": 1e-300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    assert app_client.engine.added == []


class SlowTokenizer:
    """The byte-level tokenizer, but every encode takes `delay` seconds (a long prompt's cost)."""

    def __init__(self, delay: float):
        self._tok = byte_level_tokenizer()
        self.delay = delay
        self.encodes = 0

    def encode(self, text, *a, **kw):
        import time

        self.encodes += 1
        time.sleep(self.delay)
        return self._tok.encode(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_tokenising_runs_off_the_event_loop_and_hopeless_texts_are_refused_first():
    import threading
    import time

    tok = SlowTokenizer(delay=1.5)
    with TestClient(build_app(ReplicaSet([EchoEngineClient()]), tok, "echo")) as http:
        slow = threading.Thread(target=lambda: http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}))
        slow.start()
        time.sleep(0.3)  # the slow request is tokenising now
        start = time.monotonic()
        assert http.get("/health").status_code == 200
        assert time.monotonic() - start < 0.5, "the event loop waited for the tokenizer"
        slow.join()
        # The echo engine's context is 64 tokens and no vocabulary entry is longer than a few characters:
        # a 100k-character prompt cannot fit, so it is refused without being tokenised.
        before = tok.encodes
        r = http.post("/v1/completions", json={"prompt": "y" * 100_000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert tok.encodes == before


def test_api_key_guards_docs_and_health_details():
    engine = EchoEngineClient(pid=4242)
    with TestClient(build_app(ReplicaSet([engine]), byte_level_tokenizer(), "echo", api_key="k")) as http:
        for path in ("/openapi.json", "/docs", "/redoc", "/metrics", "/v1/models"):
            r = http.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert http.get(path, headers={"Authorization": "Bearer k"}).status_code == 200, path
        assert http.get("/health").json() == {"status": "ok", "replicas": [{"replica": 0, "state": "serving"}]}
        full = http.get("/health", headers={"Authorization": "Bearer k"}).json()
        assert full["engine_pid"] == 4242 and "queued_requests" in full
        assert "/v1/completions" in http.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()["paths"]
    with TestClient(build_app(ReplicaSet([EchoEngineClient()]), byte_level_tokenizer(), "echo")) as http:
        assert http.get("/openapi.json").status_code == 200  # no key: open, as before


def test_default_queue_limit_follows_what_the_engines_can_run():
    from types import SimpleNamespace

    from tandem.engine import ipc
    from tandem.server.launch import ServerArgs
    from tandem.server.serving import default_queue_limit

    def replica(max_running, pages, page_size=16, context=4096):
        return SimpleNamespace(info=ipc.CoreReady(pid=1, model_path="/m", max_model_len=context, vocab_size=10,
                                                  page_size=page_size, num_pages=pages, speculative_algorithm=None,
                                                  max_running_requests=max_running))

    # 64 running at most, but the pool holds 1024 * 16 / 2048 = 8 requests of 2048 tokens: 2 x 8 = 16.
    assert default_queue_limit(SimpleNamespace(replicas=[replica(64, 1024)])) == 16
    # A big pool: --max-running-requests decides; two replicas add up.
    assert default_queue_limit(SimpleNamespace(replicas=[replica(32, 100_000)] * 2)) == 2 * (32 + 32)
    # Short contexts count as what they are.
    assert default_queue_limit(SimpleNamespace(replicas=[replica(256, 1024, context=128)])) == 2 * 128
    assert ServerArgs(max_queued_requests=0).max_queued_requests == 0  # unlimited
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServerArgs(max_queued_requests=-1)


def chat_app_client(tok=None):
    from tests.server.helpers import CHAT_TEMPLATE

    tok = tok or byte_level_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return TestClient(build_app(ReplicaSet([EchoEngineClient()]), tok, "echo"))


def test_client_fields_vllm_and_sglang_accept(app_client):
    # Usage in every chunk (serving benchmarks send it); harmless metadata; response_format text.
    r = app_client.post("/v1/completions", json={
        "prompt": "abcd", "max_tokens": 4, "stream": True, "metadata": {"k": "v"}, "store": False,
        "service_tier": "auto", "user": "u", "response_format": {"type": "text"}, "reasoning_effort": "low",
        "modalities": ["text"], "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    with_text = [c for c in chunks if c["choices"]]
    assert with_text and all(c["usage"]["prompt_tokens"] == 4 for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in with_text] == sorted(c["usage"]["completion_tokens"] for c in with_text)
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    # include_stop_str_in_output keeps the stop string; without it the text ends before it.
    body = {"prompt": "hello world", "max_tokens": 11, "stop": "o w"}
    assert app_client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "hell"
    kept = app_client.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == "hello w"


def test_chat_template_options():
    tok = byte_level_tokenizer()
    with chat_app_client() as http:
        base = {"messages": [{"role": "user", "content": "h"}, {"role": "assistant", "content": "H"}], "max_tokens": 1}
        assert http.post("/v1/chat/completions", json={**base, "tool_choice": "none"}).status_code == 200
        # What the template was asked for shows in the prompt's length: continuing the assistant's
        # message ends the prompt right after it; a new turn adds the generation prompt.
        cont = http.post("/v1/chat/completions", json={**base, "continue_final_message": True,
                                                       "add_generation_prompt": False}).json()
        assert cont["usage"]["prompt_tokens"] == len(tok.encode("<|user|>h\n<|assistant|>H")), cont
        new = http.post("/v1/chat/completions", json=base).json()
        assert new["usage"]["prompt_tokens"] == len(tok.encode("<|user|>h\n<|assistant|>H\n<|assistant|>")), new
        r = http.post("/v1/chat/completions", json={**base, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        r = http.post("/v1/chat/completions", json={**base, "chat_template_kwargs": {"add_generation_prompt": 1}})
        assert r.status_code in (200, 400)  # passed to the template; never a 500


def test_tokenize_detokenize_version_and_schema():
    with chat_app_client() as http:
        tok = byte_level_tokenizer()
        r = http.post("/tokenize", json={"prompt": "héllo"}).json()
        assert r["tokens"] == tok.encode("héllo") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 64
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert tok.decode(chat["tokens"]) == "<|user|>hi\n<|assistant|>"
        assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo"}
        bad = http.post("/detokenize", json={"tokens": [1, 10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert http.post("/tokenize", json={}).status_code == 400
        assert http.get("/version").json()["version"]
        schema = http.get("/openapi.json").json()
        body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        completion = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
        assert completion["properties"]["n"]["maximum"] == 128  # value ranges included
        assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_responses_match_the_schema_models():
    """The response models the OpenAPI schema names are what the endpoints really return."""
    from tandem.server import protocol as p

    with chat_app_client() as http:
        checks = [
            (http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}), p.CompletionResponse),
            (http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "h"}], "max_tokens": 2}),
             p.ChatCompletionResponse),
            (http.get("/v1/models"), p.ModelList), (http.get("/v1/models/echo"), p.ModelCard),
            (http.post("/tokenize", json={"prompt": "x"}), p.TokenizeResponse),
            (http.post("/detokenize", json={"tokens": [65]}), p.DetokenizeResponse),
            (http.get("/version"), p.VersionResponse),
            (http.post("/v1/completions", json={"prompt": 5}), p.ErrorResponse),
        ]
        for r, model in checks:
            model.model_validate(r.json(), strict=False)
        schema = http.get("/openapi.json").json()
        ok = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["application/json"]
        assert ok["schema"]["$ref"].endswith("/ChatCompletionResponse")
        assert "ErrorResponse" in schema["components"]["schemas"]


class ExplodingTokenizer:
    """Fails on one prompt the way a library bug would (not a validation error)."""

    def __init__(self):
        self._tok = byte_level_tokenizer()

    def encode(self, text, *a, **kw):
        if text == "boom":
            raise TypeError("tokenizer exploded")
        return self._tok.encode(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_an_unexpected_error_is_a_500_and_the_connection_stays_usable():
    """Over a real socket (uvicorn): the keep-alive connection that got the 500 serves the next request."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    app = build_app(ReplicaSet([EchoEngineClient()]), ExplodingTokenizer(), "echo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert any(time.sleep(0.1) or server.started for _ in range(100)), "uvicorn did not start"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            r = http.post("/v1/completions", json={"prompt": "boom", "max_tokens": 2})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert r.headers.get("connection") != "close"
            r = http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})  # same connection
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fi"
    finally:
        server.should_exit = True
        thread.join(10)


def test_requests_a_schema_fuzzer_found():
    """Two requests schemathesis found: /tokenize with an empty message list was a 500, and a request
    of more engine requests than the queue can ever hold was a 503 telling the client to retry."""
    with chat_app_client() as http:
        r = http.post("/tokenize", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    tok = byte_level_tokenizer()
    with TestClient(build_app(ReplicaSet([EchoEngineClient()]), tok, "echo", max_queued_requests=8)) as http:
        r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = http.post("/v1/completions", json={"prompt": ["a"] * 9, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert http.post("/v1/completions", json={"prompt": ["a"] * 8, "max_tokens": 1}).status_code == 200
        # The schema says what the server checks: token ids are >= 0, best_of at most 128, streams are SSE.
        schema = http.get("/openapi.json").json()
        detok = schema["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
        assert detok["minimum"] == 0
        best_of = schema["components"]["schemas"]["CompletionRequest"]["properties"]["best_of"]["anyOf"][0]
        assert best_of["maximum"] == 128 and best_of["minimum"] == 1
        assert "text/event-stream" in schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
        r = http.post("/detokenize", json={"tokens": [-1]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens")


def test_n_samples_of_the_largest_seed_stay_in_range(app_client):
    # Sample i is seeded seed + i, masked to int64 as the engine masks every seed (no 5xx past 2**63 - 1).
    r = app_client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 2, "n": 3, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3

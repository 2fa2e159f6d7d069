"""The FastAPI app against a stand-in engine client (no engine process): fast checks of request
handling that need no model."""

from __future__ import annotations

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
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    assert "mean_accept_length" not in body["usage"]  # not a speculative engine


def test_stop_string_found_by_the_front_end_aborts_the_request(app_client):
    # The echo engine knows nothing of stop strings: the front end cuts the text and aborts.
    r = app_client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 11, "stop": "o w"})
    choice = r.json()["choices"][0]
    assert choice["text"] == "hell" and choice["finish_reason"] == "stop"
    assert len(app_client.engine.aborted) == 1

"""The HTTP front end over two stand-in replicas (no engine process): routing of whole requests,
`/health` and `/metrics` per replica, and a dead replica. Fast checks; tests/dp/test_dp_server.py
runs the same with real engine cores."""

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
from tests.server.helpers import parse_metrics


@pytest.fixture
def app():
    replicas = [EchoEngineClient(f"replica {r} engine core", pid=100 + r) for r in range(2)]
    with TestClient(build_app(ReplicaSet(replicas), byte_level_tokenizer(), "echo")) as http:
        http.replicas = replicas
        yield http


def scrape(http) -> dict[str, float]:
    return parse_metrics(http.get("/metrics").text)


def complete(http, **body):
    return http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, **body})


def test_requests_alternate_and_a_request_keeps_its_choices_together(app):
    for _ in range(4):
        assert complete(app).json()["choices"][0]["text"] == "abc"
    assert [len(r.added) for r in app.replicas] == [2, 2]
    # two prompts x n=3: six engine requests, all on one replica
    body = complete(app, prompt=["abc", "xyz"], n=3).json()
    assert [c["text"] for c in body["choices"]] == ["abc"] * 3 + ["xyz"] * 3
    assert sorted(len(r.added) for r in app.replicas) == [2, 8]
    m = scrape(app)
    assert (m['tandem:replica_requests_routed_total{replica="0"}']
            + m['tandem:replica_requests_routed_total{replica="1"}']) == 10
    assert {m[f'tandem:replica_requests_routed_total{{replica="{r}"}}'] for r in "01"} == {2.0, 8.0}
    # front-end counters count each request once, with no replica label
    assert m["tandem:prompt_tokens_total"] == 4 * 3 + 2 * 3 * 3
    assert m['tandem:requests_finished_total{finished_reason="length"}'] == 10


def test_health_and_metrics_name_every_replica(app):
    h = app.get("/health")
    assert h.status_code == 200 and h.json()["engine_pids"] == [100, 101] and h.json()["engine_pid"] == 100
    m = scrape(app)
    for r in "01":
        assert m[f'tandem:engine_core_up{{replica="{r}"}}'] == 1
        assert m[f'tandem:kv_pages_total{{replica="{r}"}}'] == 16
        assert m[f'tandem:replica_requests_in_flight{{replica="{r}"}}'] == 0
    assert "tandem:engine_core_up" not in m  # no unlabelled duplicate to double-count


def test_health_stays_up_while_one_replica_serves(app):
    dead, live = app.replicas[1], app.replicas[0]
    dead.alive, dead.dead_reason = False, "replica 1 engine core process exited (exit code -9)"
    # A load balancer must keep a server that still answers: 200, "degraded", each replica's state.
    h = app.get("/health")
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "degraded"
    assert [(s["replica"], s["state"]) for s in body["replicas"]] == [(0, "serving"), (1, "dead")]
    assert "replica 1" in body["replicas"][1]["reason"] and "-9" in body["replicas"][1]["reason"]
    before = len(live.added)
    for _ in range(3):
        assert complete(app).status_code == 200
    assert len(live.added) == before + 3 and not dead.added
    assert scrape(app)['tandem:engine_core_up{replica="1"}'] == 0

    live.alive, live.dead_reason = False, "replica 0 engine core failed: RuntimeError: boom"
    r = complete(app)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "engine_unavailable" and "replica 0" in err["message"] and "replica 1" in err["message"]
    assert complete(app, stream=True).status_code == 503  # refused before the stream starts
    # No replica left: /health is a 503 naming both.
    h = app.get("/health")
    assert h.status_code == 503
    err = h.json()["error"]
    assert err["code"] == "engine_unavailable" and "replica 0" in err["message"] and "replica 1" in err["message"]

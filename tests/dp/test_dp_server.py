"""`tandem serve --dp-size 2` end to end on CPU: requests spread over both replicas (seen in the
engines' own per-replica metrics), greedy outputs equal a single in-process `Engine`, streaming,
aborts reach the replica that owns the request, and a killed replica fails only its own requests
(503) while /health reports it dead (200, "degraded") and the other replica keeps serving."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tandem import SamplingParams
from tests.dp.conftest import MAX_MODEL_LEN
from tests.server.helpers import pid_alive, scrape, wait_for

PROMPTS = ["Hello, world", "def fib(n):", "tandem", "The quick brown fox", "import os\n", "1, 2, 3,"]
C = "/v1/completions"


def replica_key(name: str, r: int) -> str:
    return f'tandem:{name}{{replica="{r}"}}'


def per_replica(m: dict, name: str) -> list[float]:
    return [m[replica_key(name, r)] for r in range(2)]


def greedy_texts(engine, prompts, max_new_tokens):
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return [o.text for o in outs]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


class Stream:
    """A long streaming completion read on a thread: its SSE lines, and how it ended."""

    def __init__(self, server, max_tokens: int = MAX_MODEL_LEN - 16):
        self.lines: list[str] = []
        self.ended_at: float | None = None
        self._http = httpx.Client(base_url=server.url, timeout=30)
        body = {"prompt": "tick tock", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._resp = self._http.send(self._http.build_request("POST", C, json=body), stream=True)
        assert self._resp.status_code == 200
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self._resp.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line[6:])
        except httpx.HTTPError:
            pass  # closed by close()
        self.ended_at = time.monotonic()

    @property
    def error(self) -> dict | None:
        last = self.lines[-1] if self.lines else ""
        return json.loads(last)["error"] if last.startswith('{"error"') else None

    def close(self) -> None:
        self._resp.close()  # the client goes away mid-stream
        self._http.close()
        self._thread.join(5)


def wait_running(server, counts: list[int]) -> dict:
    m = wait_for(lambda: (m := scrape(server.url)) and per_replica(m, "num_requests_running") == counts and m,
                 timeout=15)
    assert m, f"expected running {counts}: {per_replica(scrape(server.url), 'num_requests_running')}"
    return m


def test_health_lists_two_live_engine_cores(dp_server):
    h = httpx.get(dp_server.url + "/health").json()
    pids = h["engine_pids"]
    assert len(set(pids)) == 2 and dp_server.proc.pid not in pids
    assert all(pid_alive(p) for p in pids)
    m = scrape(dp_server.url)
    assert per_replica(m, "engine_core_up") == [1, 1]
    assert min(per_replica(m, "kv_pages_total")) > 0


def test_concurrent_greedy_requests_spread_and_equal_engine(dp_server, dp_ref_engine):
    oai = client(dp_server)
    ref = greedy_texts(dp_ref_engine, PROMPTS, 24)
    before = scrape(dp_server.url)

    def complete(p):
        return oai.completions.create(model=None, prompt=p, max_tokens=24, temperature=0).choices[0].text

    def stream(p):
        chunks = oai.completions.create(model=None, prompt=p, max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(complete, PROMPTS)) == ref
        assert list(pool.map(stream, PROMPTS)) == ref
    after = scrape(dp_server.url)
    routed = [a - b for a, b in zip(per_replica(after, "replica_requests_routed_total"),
                                    per_replica(before, "replica_requests_routed_total"))]
    assert sum(routed) == 2 * len(PROMPTS) and min(routed) >= 2, routed
    assert per_replica(after, "replica_requests_in_flight") == [0, 0]


def test_one_request_keeps_its_choices_on_one_replica(dp_server, dp_ref_engine):
    before = scrape(dp_server.url)
    r = client(dp_server).completions.create(model=None, prompt=PROMPTS[:2], n=3, max_tokens=12, temperature=0)
    ref = greedy_texts(dp_ref_engine, PROMPTS[:2], 12)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [ref[0]] * 3 + [ref[1]] * 3
    after = scrape(dp_server.url)
    routed = sorted(a - b for a, b in zip(per_replica(after, "replica_requests_routed_total"),
                                          per_replica(before, "replica_requests_routed_total")))
    assert routed == [0, 6]


def test_both_replicas_run_at_once_and_aborts_reach_the_owner(dp_server):
    start = wait_running(dp_server, [0, 0])
    key = 'tandem:requests_finished_total{finished_reason="abort"}'
    streams = [Stream(dp_server), Stream(dp_server)]
    try:
        # The engines' own snapshots (not the router's bookkeeping): one request on each replica.
        busy = wait_running(dp_server, [1, 1])
        assert all(u > s for u, s in zip(per_replica(busy, "kv_pages_used"), per_replica(start, "kv_pages_used")))
        assert all(s.error is None and s.ended_at is None for s in streams)
    finally:
        for s in streams:
            s.close()
    # Each abort went to the replica that holds the request: both free their pages.
    idle = wait_for(lambda: (m := scrape(dp_server.url)) and per_replica(m, "num_requests_running") == [0, 0]
                    and per_replica(m, "kv_pages_used") == per_replica(start, "kv_pages_used") and m, timeout=15)
    assert idle, scrape(dp_server.url)
    assert idle[key] - start[key] == 2
    assert per_replica(idle, "replica_requests_in_flight") == [0, 0]


def test_a_killed_replica_fails_only_its_requests(dp_kill_server, dp_ref_engine):
    srv = dp_kill_server
    url = srv.url
    pids = srv.health()["engine_pids"]
    start = wait_running(srv, [0, 0])
    first = Stream(srv)
    m = wait_for(lambda: (m := scrape(url)) and sum(per_replica(m, "num_requests_running")) == 1 and m, timeout=15)
    survivor = per_replica(m, "num_requests_running").index(1)
    victim = 1 - survivor
    second = Stream(srv)
    wait_running(srv, [1, 1])
    streams = {survivor: first, victim: second}
    try:
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        # The victim's stream ends with a 503-shaped error naming the replica, promptly.
        assert wait_for(lambda: streams[victim].ended_at is not None, timeout=5)
        err = streams[victim].error
        assert err and err["code"] == "engine_unavailable" and f"replica {victim}" in err["message"], err
        assert streams[victim].ended_at - killed_at < 5
        # The survivor's stream keeps going.
        n = len(streams[survivor].lines)
        assert wait_for(lambda: len(streams[survivor].lines) > n + 10, timeout=10)
        assert streams[survivor].ended_at is None and streams[survivor].error is None
        # /health stays 200 (a replica serves) and names the dead one; metrics show which one is down.
        h = httpx.get(url + "/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded", h.text
        states = {s["replica"]: s["state"] for s in h.json()["replicas"]}
        assert states == {survivor: "serving", victim: "dead"}
        up = [0, 0]
        up[survivor] = 1
        assert per_replica(scrape(url), "engine_core_up") == up
        # New requests go to the survivor and are still right.
        ref = greedy_texts(dp_ref_engine, PROMPTS[:2], 16)
        oai = client(srv)
        for p, text in zip(PROMPTS[:2], ref):
            assert oai.completions.create(model=None, prompt=p, max_tokens=16, temperature=0).choices[0].text == text
    finally:
        for s in streams.values():
            s.close()
    idle = wait_for(lambda: (m := scrape(url))[replica_key("num_requests_running", survivor)] == 0
                    and m[replica_key("kv_pages_used", survivor)] == start[replica_key("kv_pages_used", survivor)],
                    timeout=15)
    assert idle, "the survivor did not free the aborted request's pages"

    # With no replica left, every request is a prompt 503 (one racing the death fails on its replica;
    # once it is noticed, the error names both).
    os.kill(pids[survivor], signal.SIGKILL)
    post = lambda: httpx.post(url + C, json={"prompt": "x", "max_tokens": 2}, timeout=5)
    assert wait_for(lambda: post().status_code == 503, timeout=5)
    err = post().json()["error"]
    assert err["code"] == "engine_unavailable" and "replica 0" in err["message"] and "replica 1" in err["message"]
    srv.sigterm_and_check(timeout=15)
    assert not any(pid_alive(p) for p in pids)

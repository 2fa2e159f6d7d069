"""A short soak: 64 concurrent clients for about 30 s against one server, streaming and not, a third of
the streams cut off by their client after a few chunks. Every request that is not cut off answers 200
with well-formed output, a greedy request gives the same text under load as alone, and afterwards
nothing is running or queued and every KV page is free again. Every prompt starts with one shared text
of several KV pages, so requests also start from each other's cached pages (the prefix cache is on)."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx

from tests.server.helpers import ServerProcess, parse_metrics, wait_for

CLIENTS = 64
SOAK_S = 30
SHARED = ("You are a helpful assistant. Answer briefly and precisely, and say so when you do not know. " * 3)
GREEDY = {"prompt": SHARED + "the same words", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def client_loop(url: str, seed: int, stop: threading.Event, results: list, greedy_texts: list) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            kind = rng.choice(["plain", "stream", "cut", "chat", "greedy"])
            body = {"prompt": SHARED + f"client {seed} says", "max_tokens": rng.randint(1, 24), "ignore_eos": True,
                    "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 99)}
            try:
                if kind == "greedy":
                    r = http.post("/v1/completions", json=GREEDY)
                    results.append(("greedy", r.status_code))
                    greedy_texts.append(r.json()["choices"][0]["text"])
                elif kind == "plain":
                    results.append((kind, http.post("/v1/completions", json=body).status_code))
                elif kind == "chat":
                    r = http.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": SHARED},
                                                                             {"role": "user", "content": "hi"}],
                                                                "max_tokens": body["max_tokens"]})
                    results.append((kind, r.status_code))
                else:
                    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        events = []
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                            if kind == "cut" and len(events) >= 2:
                                break  # the client goes away mid-stream
                        ok = r.status_code == 200 and (kind == "cut" or events[-1] == "[DONE]")
                        results.append((kind, r.status_code if ok else f"bad stream {events[-2:]}"))
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                results.append((kind, repr(e)))


def test_soak_64_clients_with_disconnects(chat_ckpt, tmp_path):
    srv = ServerProcess(["--model-path", chat_ckpt, "--device", "cpu", "--dtype", "float32",
                         "--max-running-requests", "16", "--max-queued-requests", "0"], tmp_path / "server.log")
    srv.start()
    try:
        srv.wait_ready()
        alone = httpx.post(srv.url + "/v1/completions", json=GREEDY, timeout=30).json()["choices"][0]["text"]
        pages_idle = parse_metrics(httpx.get(srv.url + "/metrics").text)['tandem:kv_pages_used{replica="0"}']
        stop, results, greedy_texts = threading.Event(), [], []
        threads = [threading.Thread(target=client_loop, args=(srv.url, i, stop, results, greedy_texts), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(SOAK_S)
        stop.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung"
        bad = [r for r in results if r[1] != 200]
        assert not bad, bad[:10]
        assert len(results) >= CLIENTS and greedy_texts
        assert set(greedy_texts) == {alone}, "load changed a greedy output"

        def idle():
            m = parse_metrics(httpx.get(srv.url + "/metrics").text)
            return (m['tandem:num_requests_running{replica="0"}'] == 0 and m['tandem:num_requests_waiting{replica="0"}'] == 0
                    and m['tandem:kv_pages_used{replica="0"}'] == pages_idle)
        assert wait_for(idle, timeout=20), "KV pages or requests left behind"
        assert parse_metrics(httpx.get(srv.url + "/metrics").text)['tandem:prefix_cache_hits_total{replica="0"}'] > 0
        assert srv.health()["queued_requests"] == 0
        assert "Traceback" not in srv.log()
    finally:
        srv.terminate()

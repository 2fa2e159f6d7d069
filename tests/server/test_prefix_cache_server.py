"""Prefix caching as a client sees it, against a live `tandem serve` with the official openai client:
`usage.prompt_tokens_details.cached_tokens` growing over a conversation (streamed usage too), the
Prometheus counters, and POST /flush_cache (alias /reset_prefix_cache)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME
from tests.server.helpers import scrape, wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PAGE = 16  # the server's default page size
QUERIES, HITS = 'tandem:prefix_cache_queries_total{replica="0"}', 'tandem:prefix_cache_hits_total{replica="0"}'
CACHED = 'tandem:kv_pages_cached{replica="0"}'


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def flush(server) -> httpx.Response:
    return httpx.post(server.url + "/flush_cache", headers=AUTH, timeout=30)


def test_cached_tokens_grow_over_a_conversation(server, oai):
    assert flush(server).status_code == 200
    before = scrape(server.url, API_KEY)
    messages = [{"role": "system", "content": "You answer in one short line, in plain words." * 2},
                {"role": "user", "content": "What is a prefix cache?"}]
    cached, prompts = [], []
    for turn in range(3):
        r = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompts.append(r.usage.prompt_tokens)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"And turn {turn + 2}?"}]
    assert cached[0] == 0 and 0 < cached[1] < cached[2], cached
    assert all(c % PAGE == 0 and c < p for c, p in zip(cached, prompts))
    # The next turn streamed, usage in its last chunk, as the openai client reads it.
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens > cached[2]
    after = scrape(server.url, API_KEY)
    assert after[QUERIES] - before[QUERIES] == sum(prompts) + last.usage.prompt_tokens
    assert after[HITS] - before[HITS] == sum(cached) + last.usage.prompt_tokens_details.cached_tokens
    assert after[CACHED] > 0


def test_completions_usage_and_flush(server, oai):
    prompt = "def prefix_cache(pages):\n    " * 4
    first, again = (oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
                    for _ in range(2))
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // PAGE * PAGE
    assert again.choices[0].text == first.choices[0].text
    r = httpx.post(server.url + "/reset_prefix_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json() == {"flushed": True}
    assert wait_for(lambda: scrape(server.url, API_KEY)[CACHED] == 0, timeout=10)
    cold = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0 and cold.choices[0].text == first.choices[0].text
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 401  # an admin route: key needed


def test_flush_while_a_request_holds_pages_is_a_503(server):
    body = {"model": MODEL_NAME, "prompt": "a long one", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            r = flush(server)
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["code"] == "cache_in_use" and "replica 0: 1 running requests" in err["message"]
    # Once the client is gone its request is aborted and a flush empties the pool.
    assert wait_for(lambda: flush(server).status_code == 200, timeout=15)

"""`tandem serve` end to end: a live server (engine core in its own process) and the official
`openai` client as the peer. Greedy outputs are checked against an in-process `Engine`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tandem import SamplingParams
from tests.server.conftest import API_KEY, MAX_MODEL_LEN, MAX_QUEUED, MAX_REQUEST_BYTES, MAX_RUNNING, MODEL_NAME
from tests.server.helpers import pid_alive, scrape, wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["Hello, world", "def fib(n):", "tandem"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def greedy(engine, max_new_tokens, prompt=None, input_ids=None, **kw):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)
    if input_ids is not None:
        return engine.generate(input_ids=[input_ids], sampling_params=params)[0]
    return engine.generate([prompt], params)[0]


def chat_ids(engine, messages):
    return list(engine.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))


def metrics(server) -> dict[str, float]:
    return scrape(server.url, API_KEY)


def wait_idle(server, pages_used: float = 0.0) -> dict[str, float]:
    """Waits until the engine runs nothing and its KV pages in use are back to `pages_used`."""
    def idle():
        m = metrics(server)
        ok = (m['tandem:num_requests_running{replica="0"}'] == 0
              and m['tandem:num_requests_waiting{replica="0"}'] == 0
              and m['tandem:kv_pages_used{replica="0"}'] == pages_used)
        return m if ok else None

    m = wait_for(idle, timeout=15)
    assert m, f"engine not idle: {metrics(server)}"
    return m


# ---- basics ----------------------------------------------------------------------------------------


def test_health_models_and_api_key(server, oai):
    health = httpx.get(server.url + "/health")  # no key needed, but then only the status
    assert health.status_code == 200 and health.json() == {"status": "ok", "replicas": [{"replica": 0, "state": "serving"}]}
    health = httpx.get(server.url + "/health", headers=AUTH)
    assert health.status_code == 200 and health.json()["engine_pid"] == server.engine_pid
    assert [m.id for m in oai.models.list().data] == [MODEL_NAME]
    for path in ("/v1/models", "/metrics"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_completions_greedy_equal_engine(server, oai, ref_engine):
    for prompt in PROMPTS:
        ref = greedy(ref_engine, 24, prompt)
        r = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))

        chunks = list(oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)

    # a batch of prompts: one choice per prompt, in order
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [greedy(ref_engine, 8, p).text for p in PROMPTS]
    # token ids as the prompt
    ids = ref_engine.tokenizer.encode(PROMPTS[0])
    r = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy(ref_engine, 8, input_ids=ids).text


def test_chat_greedy_equal_engine(server, oai, ref_engine):
    ref = greedy(ref_engine, 32, input_ids=chat_ids(ref_engine, MESSAGES))
    r = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=32, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)

    chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=32, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # content given as text parts renders the same prompt
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == ref.text


def test_stop_strings(server, oai, ref_engine):
    ref = greedy(ref_engine, 40, PROMPTS[1], ignore_eos=True)
    text = ref.text
    # a stop string taken from the middle of the greedy text (whole characters only)
    k = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[k:k + 2]
    expected = text[: text.find(stop)]
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    r = oai.completions.create(stop=[stop, "never-appears"], **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(oai.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n(server, oai):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16, temperature=1.0, n=3)
    a = oai.completions.create(seed=1234, **kw)
    b = oai.completions.create(seed=1234, **kw)
    c = oai.completions.create(seed=99, **kw)
    assert sorted(x.index for x in a.choices) == [0, 1, 2]
    texts = [x.text for x in a.choices]
    assert texts == [x.text for x in b.choices]
    assert texts != [x.text for x in c.choices]
    assert len(set(texts)) > 1  # n independent samples

    chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, n=2, seed=5,
                                              temperature=0.8, top_p=0.9, stream=True,
                                              extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert set(finished) == {0, 1}


def test_logprobs(server, oai):
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        # greedy picks the most likely (tokens with the same text share one key of `top`)
        assert chosen >= max(top.values()) - 1e-5

    r = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 2
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-5)
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
    chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                              logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)


# ---- bad input and load -----------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (path, body, status, param, code, words in the message)
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature", None, ["[0, "]),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None, ["number"]),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None, ["(0, 1]"]),
    (C, {"prompt": "x", "top_k": -5}, 400, "top_k", None, []),
    (C, {"prompt": "x", "min_p": 2}, 400, "min_p", None, []),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None, ["[1, "]),
    (C, {"prompt": "x", "n": 0}, 400, "n", None, []),
    (C, {"prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty", None, ["[-2, 2]"]),
    (C, {"prompt": "x", "presence_penalty": -3}, 400, "presence_penalty", None, []),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None, []),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop", None, []),
    (C, {"prompt": "x", "logprobs": 50}, 400, "logprobs", None, []),
    (C, {"prompt": "x", "seed": "abc"}, 400, "seed", None, []),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed", None, []),
    (C, {"prompt": "x", "top_k": 2**64}, 400, "top_k", None, []),
    # Values a float32 / int32 table cannot hold, and token ids past the vocabulary, are 400s before
    # they reach the engine core (1e308 once killed it: every request got 503 until a restart).
    (C, {"prompt": "Hello", "max_tokens": 2, "temperature": 1e308}, 400, "temperature", None, ["float32"]),
    (CHAT, {"messages": USER, "max_tokens": 2, "temperature": 1e39}, 400, "temperature", None, ["float32"]),
    (C, {"prompt": "x", "top_k": 2**40}, 400, "top_k", None, [str(2**31 - 1)]),
    (C, {"prompt": "x", "stop_token_ids": [10**12]}, 400, "stop_token_ids", None, ["[0, "]),
    (C, {"prompt": "x", "logit_bias": {"100000": 5}}, 400, "logit_bias", None, ["token ids"]),
    (C, {"prompt": "x", "min_tokens": 2**40}, 400, "min_tokens", None, []),
    (CHAT, {"messages": USER, "modalities": ["audio"]}, 400, "modalities[0]", None, []),
    (C, {"prompt": "x", "bogus_field": 1}, 400, "bogus_field", None, ["unknown"]),
    (C, {"max_tokens": 3}, 400, "prompt", None, ["required"]),
    (C, {"prompt": ""}, 400, "prompt", None, ["empty"]),
    (C, {"prompt": [5, 100000]}, 400, "prompt", None, ["out of range"]),
    (C, {"prompt": "x" * 5000}, 400, "prompt", "context_length_exceeded", ["5000", str(MAX_MODEL_LEN)]),
    (C, {"prompt": "x" * 100, "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded",
     ["5000", "100", str(MAX_MODEL_LEN)]),
    (C, {"prompt": "x", "model": "gpt-17"}, 404, "model", "model_not_found", ["gpt-17"]),
    (CHAT, {"messages": []}, 400, "messages", None, []),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", None, []),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None, []),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", None, ["logprobs"]),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", None, []),
    (CHAT, {"messages": USER, "max_completion_tokens": -1}, 400, "max_completion_tokens", None, []),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "messages", "context_length_exceeded",
     [str(MAX_MODEL_LEN)]),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "model", "model_not_found", []),
    (CHAT, {"messages": USER, "stream_options": {"include_usage": "maybe"}}, 400,
     "stream_options.include_usage", None, []),
]


def check_error(r: httpx.Response, status: int, param=None, code=None, words=()):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code, err
    for w in words:
        assert w in err["message"], err


@pytest.mark.parametrize("path,body,status,param,code,words", BAD_REQUESTS,
                         ids=[f"{i}-{case[3]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_request(server, path, body, status, param, code, words):
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=10)
    check_error(r, status, param, code, words)


def test_bad_bodies_then_good_request(server, oai):
    post = lambda path, **kw: httpx.post(server.url + path, headers={**AUTH, **kw.pop("headers", {})}, timeout=10,
                                         **kw)
    check_error(post(C, content=b"{not json"), 400, words=["JSON"])
    check_error(post(C, content=b"[1, 2]"), 400, words=["object"])
    check_error(post(C, json={"prompt": "x" * (MAX_REQUEST_BYTES + 10)}), 413, code="request_too_large",
                words=[str(MAX_REQUEST_BYTES)])
    check_error(httpx.get(server.url + "/v1/nowhere", headers=AUTH), 404)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=USER)
    # Bodies that parse but used to fail later (a 500, and a queued count that never fell).
    for body in (b'{"prompt": "a\\ud800b", "max_tokens": 2}', b'{"prompt": "hi", "max_tokens": 1, "stop": "\\udfff"}',
                 b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        check_error(post(C, content=body, headers={"content-type": "application/json"}), 400,
                    param="prompt" if b"a\\ud800b" in body else ("stop" if b"stop" in body else None))
    assert httpx.get(server.url + "/health", headers=AUTH).json()["queued_requests"] == 0
    # the server is still fine
    r = oai.completions.create(model=MODEL_NAME, prompt="still fine?", max_tokens=4)
    assert r.usage.completion_tokens >= 1
    # content null is legal (an assistant turn with tool calls has none)
    r = oai.chat.completions.create(model=MODEL_NAME, max_tokens=2, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "again"}])
    assert r.choices[0].message.content is not None


def long_request(stream: bool = True) -> dict:
    return {"model": MODEL_NAME, "prompt": "tick tock", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True,
            "stream": stream}


def test_queue_full_503_and_disconnect_frees_pages(server, oai):
    start = wait_idle(server)
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=30)
    streams, readers = [], []  # a dropped reader would close its stream
    try:
        # MAX_RUNNING streams that have started (a first token arrived) ...
        for _ in range(MAX_RUNNING):
            resp = http.send(http.build_request("POST", C, json=long_request()), stream=True)
            assert resp.status_code == 200
            readers.append(resp.iter_lines())
            assert next(line for line in readers[-1] if line.startswith("data: ")).startswith("data: {")
            streams.append(resp)
        # ... then MAX_QUEUED that the engine cannot admit yet (headers come back once accepted) ...
        for _ in range(MAX_QUEUED):
            resp = http.send(http.build_request("POST", C, json=long_request()), stream=True)
            assert resp.status_code == 200
            streams.append(resp)
        assert server.health()["queued_requests"] == MAX_QUEUED
        busy = metrics(server)
        assert busy['tandem:num_requests_running{replica="0"}'] == MAX_RUNNING
        assert busy['tandem:kv_pages_used{replica="0"}'] > start['tandem:kv_pages_used{replica="0"}']
        # ... so one more is refused, streaming or not.
        for stream in (False, True):
            r = http.post(C, json={**long_request(stream), "max_tokens": 4})
            check_error(r, 503, code="queue_full", words=["queue"])
            assert r.headers["retry-after"] == "1"
    finally:
        for resp in streams:
            resp.close()  # the client goes away mid-stream
        http.close()
    # every request is aborted in the engine and its pages come back
    end = wait_idle(server, start['tandem:kv_pages_used{replica="0"}'])
    aborts = end['tandem:requests_finished_total{finished_reason="abort"}']
    assert aborts - start['tandem:requests_finished_total{finished_reason="abort"}'] == MAX_RUNNING + MAX_QUEUED
    assert oai.completions.create(model=MODEL_NAME, prompt="after", max_tokens=4).choices[0].text is not None


def test_non_streaming_disconnect_aborts(server):
    start = wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, json=long_request(stream=False), headers=AUTH, timeout=0.5)
    key = 'tandem:requests_finished_total{finished_reason="abort"}'
    assert wait_for(lambda: metrics(server)[key] == start[key] + 1, timeout=10)
    wait_idle(server, start['tandem:kv_pages_used{replica="0"}'])


def test_metrics_move_by_one_request(server, oai):
    before = wait_idle(server)
    prompt = "count me"
    r = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0,
                               extra_body={"ignore_eos": True})
    after = metrics(server)
    diff = lambda key: after[key] - before[key]
    assert r.usage.completion_tokens == 10
    assert diff('tandem:requests_finished_total{finished_reason="length"}') == 1
    assert diff('tandem:requests_finished_total{finished_reason="stop"}') == 0
    assert diff("tandem:prompt_tokens_total") == r.usage.prompt_tokens == len(prompt)
    assert diff("tandem:generation_tokens_total") == 10
    assert diff("tandem:time_to_first_token_seconds_count") == 1
    assert diff("tandem:inter_token_latency_seconds_count") == 9
    assert diff("tandem:e2e_request_latency_seconds_count") == 1
    assert after['tandem:kv_pages_used{replica="0"}'] == before['tandem:kv_pages_used{replica="0"}']
    assert after['tandem:kv_pages_total{replica="0"}'] > 0 and after['tandem:engine_core_up{replica="0"}'] == 1
    assert not any(k.startswith("tandem:spec_decode") for k in after)  # not a speculative server


# ---- speculative server; engine death; shutdown ---------------------------------------------------


def test_speculative_server_metrics_engine_death_and_sigterm(spec_server, ref_engine):
    url = spec_server.url
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    model = oai.models.list().data[0].id
    before = scrape(url)
    assert before['tandem:spec_decode_num_drafts_total{replica="0"}'] == 0

    ref = greedy(ref_engine, 20, PROMPTS[1], ignore_eos=True)
    r = oai.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text  # speculative greedy == plain greedy
    # the draft is the target itself, so every draft token is accepted: 4 tokens per verify step
    assert r.usage.mean_accept_length == pytest.approx(4.0)
    assert r.usage.spec_verify_steps >= 4

    after = scrape(url)
    drafts = after['tandem:spec_decode_num_drafts_total{replica="0"}']
    accepted = after['tandem:spec_decode_num_accepted_tokens_total{replica="0"}']
    # (the engine may run a verify step whose tokens nobody needs, e.g. one scheduled ahead)
    assert drafts >= r.usage.spec_verify_steps
    assert after['tandem:spec_decode_num_draft_tokens_total{replica="0"}'] == 3 * drafts
    assert 0 < accepted <= 3 * drafts
    per_pos = [after[f'tandem:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}",replica="0"}}']
               for p in range(3)]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    assert after['tandem:spec_decode_mean_accept_length{replica="0"}'] == pytest.approx(1 + accepted / drafts)
    # Depth per engine step (this server drafts a fixed 3: --speculative-adaptive off): a histogram whose
    # buckets below 3 are empty and whose count is the steps taken.
    steps = after['tandem:spec_decode_draft_depth_count{replica="0"}']
    assert steps >= 4 and after['tandem:spec_decode_draft_depth_bucket{le="2",replica="0"}'] == 0
    assert after['tandem:spec_decode_draft_depth_bucket{le="3",replica="0"}'] == steps
    assert after['tandem:spec_decode_draft_depth_sum{replica="0"}'] == 3 * steps

    # Kill the engine core mid-stream: the stream ends with an error, the server answers 503.
    engine_pid = spec_server.health()["engine_pid"]
    errors = []

    def stream():
        try:
            for _ in oai.completions.create(model=model, prompt="x", max_tokens=MAX_MODEL_LEN - 8, stream=True,
                                            extra_body={"ignore_eos": True}):
                pass
        except openai.APIError as e:
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    assert wait_for(lambda: scrape(url)['tandem:num_requests_running{replica="0"}'] == 1, timeout=10)
    killed_at = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)
    t.join(10)
    assert not t.is_alive() and errors and "engine" in str(errors[0])
    health = wait_for(lambda: (r := httpx.get(url + "/health")).status_code == 503 and r, timeout=5)
    assert health and time.monotonic() - killed_at < 5
    assert health.json()["error"]["code"] == "engine_unavailable"
    r = httpx.post(url + C, json={"prompt": "x"})
    check_error(r, 503, code="engine_unavailable")
    dead = scrape(url)
    assert dead['tandem:engine_core_up{replica="0"}'] == 0
    assert dead['tandem:engine_core_failures_total{replica="0"}'] == 1
    # A dead engine core runs nothing and holds nothing: its last numbers must not linger.
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_pages_used"):
        assert dead[f'tandem:{gauge}{{replica="0"}}'] == 0, gauge

    # SIGTERM still shuts the front end down promptly.
    spec_server.sigterm_and_check(timeout=15)
    assert not pid_alive(engine_pid)


def hf_prompt_logprobs(ckpt: str, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def test_echo_logprobs_as_evaluation_harnesses_read_them(server, chat_ckpt, ref_engine):
    """The log-likelihood request of evaluation harnesses, unmodified: token ids, max_tokens 1 (and 0),
    logprobs 1, echo, temperature 0; prompt logprobs against transformers' log-softmax."""
    ids = ref_engine.tokenizer.encode("The quick brown fox")
    want = hf_prompt_logprobs(chat_ckpt, ids)
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=30)
    for max_tokens in (1, 0):
        r = http.post(C, json={"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "logprobs": 1,
                               "echo": True, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for t in range(1, len(ids)):
            assert abs(lp["token_logprobs"][t] - want[t - 1, ids[t]].item()) <= 1e-4, t
            assert len(lp["top_logprobs"][t]) == 1
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert choice["text"].startswith("The quick brown fox")
        assert r.json()["usage"]["completion_tokens"] == max_tokens
    # vLLM's prompt_logprobs field.
    r = http.post(C, json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0})
    plps = r.json()["choices"][0]["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(ids)
    assert abs(plps[1][str(ids[1])]["logprob"] - want[0, ids[1]].item()) <= 1e-4
    assert 2 <= len(plps[1]) <= 3  # the prompt token and the top 2 (it may be one of them)
    # Streaming: the prompt comes first, with its logprobs.
    with http.stream("POST", C, json={"model": MODEL_NAME, "prompt": "The quick", "max_tokens": 2, "logprobs": 0,
                                       "echo": True, "stream": True, "temperature": 0}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith("The quick")
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    r = http.post(C, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 0})
    check_error(r, 400, "max_tokens")  # 0 only with echo
    # The schema's response models hold for these richer answers too (logprobs, echo, prompt_logprobs).
    from tandem.server.protocol import ChatCompletionResponse, CompletionResponse

    CompletionResponse.model_validate(http.post(C, json={"prompt": ids, "max_tokens": 2, "logprobs": 2, "echo": True,
                                                         "prompt_logprobs": 1}).json())
    ChatCompletionResponse.model_validate(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json())


def test_logit_bias_min_tokens_and_best_of(server, ref_engine):
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=30)
    target = ref_engine.tokenizer.encode("Z")[-1]
    r = http.post(C, json={"prompt": "Hello", "max_tokens": 5, "temperature": 0, "logit_bias": {str(target): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Z" * 5  # a bias of 100 wins every step
    check_error(http.post(C, json={"prompt": "x", "logit_bias": {"abc": 1}}), 400, "logit_bias")
    check_error(http.post(C, json={"prompt": "x", "logit_bias": {"5": 500}}), 400, "logit_bias")
    # min_tokens keeps a stop token out of the first outputs.
    first = http.post(C, json={"prompt": "Hello", "max_tokens": 1, "temperature": 0}).json()["choices"][0]["text"]
    stop_id = ref_engine.tokenizer.encode(first)[-1]
    r = http.post(C, json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id],
                           "min_tokens": 4, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] >= 4
    # best_of: the sample with the highest cumulative logprob among best_of (seeded: sample i uses seed + i).
    body = {"prompt": "Once", "max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    all3 = http.post(C, json={**body, "n": 3, "logprobs": 0}).json()["choices"]
    best = http.post(C, json={**body, "n": 1, "best_of": 3}).json()
    want = max(all3, key=lambda ch: sum(ch["logprobs"]["token_logprobs"]))
    assert [ch["text"] for ch in best["choices"]] == [want["text"]] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == 18  # every sample counts
    check_error(http.post(C, json={**body, "n": 2, "best_of": 1}), 400, "best_of")
    check_error(http.post(C, json={**body, "best_of": 2, "stream": True}), 400, "best_of")

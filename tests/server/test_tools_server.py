"""Tool calls through the chat endpoint.

- auto: the front end parses the reply in the template's format (the echo engine replies with the
  prompt, so the reply holds exactly the call the conversation wrote), streamed and not.
- required / a named function: a live speculative server constrains the reply with a JSON-schema
  grammar, so even a tiny random model returns calls whose arguments validate against the tool's schema.
- history with assistant tool_calls (content null) and tool messages renders through the template.
"""

from __future__ import annotations

import json
import warnings

import jsonschema
import openai
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from tandem.demo import byte_level_tokenizer
from tandem.server.app import build_app
from tandem.server.replicas import ReplicaSet
from tests.server.echo_client import EchoEngineClient
from tests.server.helpers import CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"], "additionalProperties": False}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>'


@pytest.fixture
def echo_chat():
    tok = byte_level_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    engine = EchoEngineClient()
    engine.info.max_model_len = 2048
    with TestClient(build_app(ReplicaSet([engine]), tok, "echo")) as http:
        yield http


def test_auto_parses_the_call_and_keeps_the_content_before_it(echo_chat):
    body = {"messages": [{"role": "user", "content": "Weather? " + CALL}], "tools": [WEATHER], "max_tokens": 1500}
    r = echo_chat.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert msg["tool_calls"][0]["id"].startswith("call_") and msg["tool_calls"][0]["type"] == "function"
    assert msg["content"].endswith("Weather?") and "<tool_call>" not in msg["content"]
    # Streamed: the content up to the call, then one tool_calls delta; the call's text never streams.
    r = echo_chat.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    calls = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert "<tool_call>" not in content and content.strip().endswith("Weather?")
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    # tool_choice none: tools are not rendered and nothing is parsed.
    plain = echo_chat.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()["choices"][0]
    assert "tool_calls" not in plain["message"] or plain["message"]["tool_calls"] is None
    assert "<|tools|>" not in plain["message"]["content"]


def test_history_with_tool_calls_and_tool_messages_renders(echo_chat):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    r = echo_chat.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "tool_choice": "none",
                                                     "max_tokens": 1500})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    # The arguments reach the template as a mapping (not a doubly encoded string).
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>' in text
    assert "<|tool|>-3 C" in text


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests(echo_chat, body, param):
    r = echo_chat.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


NO_TOOLS_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


def test_a_template_without_tools_gets_them_in_the_system_message():
    """The whole prompt, written out by hand: the tool list and the Hermes instruction in the system message
    (after the caller's own system text), the assistant's call as a <tool_call> block after its content, and
    the tool's result as a user turn in <tool_response>."""
    from tandem.server.protocol import ChatCompletionRequest
    from tandem.server.tools import plan_tools

    tok = byte_level_tokenizer()
    tok.chat_template = NO_TOOLS_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    req = ChatCompletionRequest(model="m", messages=messages, tools=[WEATHER])
    plan = plan_tools(req, tok.chat_template, "mistral")  # (a parser flag cannot apply: the prompt teaches hermes)
    assert plan.in_system_prompt and plan.fmt == "hermes" and plan.template_kwargs() == {}
    text = tok.apply_chat_template(plan.messages([m.for_template() for m in req.messages]), tokenize=False)
    function = ('{"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", '
                '"properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}}, '
                '"required": ["city", "unit"], "additionalProperties": false}}')
    assert text == (
        "<|system|>Be brief.\n\nYou can call these functions, given as JSON schemas:\n<tools>\n" + function +
        "\n</tools>\nTo call a function, answer with one block per call and nothing else in it:\n"
        '<tool_call>{"name": "the function name", "arguments": {"an argument": "its value"}}</tool_call>\n'
        "Otherwise answer in text.\n"
        "<|user|>Weather in Oslo?\n"
        '<|assistant|>Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
        "</tool_call>\n"
        "<|user|><tool_response>\n-3 C\n</tool_response>\n<|assistant|>")
    named = ChatCompletionRequest(model="m", messages=messages[1:2], tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    system = plan_tools(named, tok.chat_template, None).messages([m.for_template() for m in named.messages])[0]
    assert system["role"] == "system" and system["content"].endswith(
        "Call the function get_weather: answer with its arguments as one JSON object, and nothing else.")


def test_a_template_without_tools_serves_them():
    """Over HTTP: 200, and (the echo engine replies with its prompt) the prompt held the tool's schema."""
    tok = byte_level_tokenizer()
    tok.chat_template = NO_TOOLS_TEMPLATE
    engine = EchoEngineClient()
    engine.info.max_model_len = 2048
    with TestClient(build_app(ReplicaSet([engine]), tok, "echo")) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                                    "max_tokens": 1500})
        assert r.status_code == 200, r.text
        assert '"name": "get_weather", "description": "Current weather"' in r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def client(structured_server):
    return openai.OpenAI(base_url=structured_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_required_and_named_tool_choice_give_schema_valid_arguments(client):
    model = client.models.list().data[0].id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather?"}],
                                             tools=[WEATHER, TIME], tool_choice="required", max_tokens=300,
                                             temperature=1.0, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, TIME], max_tokens=100,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0, seed=seed)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    one = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather?"}],
                                         tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=300, temperature=1.0, seed=7)
    assert len(one.choices[0].message.tool_calls) == 1
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Time?"}],
                                            tools=[TIME], tool_choice="required", max_tokens=300, stream=True,
                                            seed=0)  # (unseeded, a sampled reply once ran past max_tokens)
    deltas = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) >= 1 and deltas[0].function.name == "get_time"
    jsonschema.validate(json.loads(deltas[0].function.arguments), schemas["get_time"])

"""Tool-call parsers (structured/tool_parsers.py) on replies written the way each model family writes
them, and on replies that only look like calls (they stay content)."""

import json

import pytest

from tandem.structured.tool_parsers import ParsedReply, ToolCall, detect_format, parse

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "C"}))
TIME = ToolCall("get_time", json.dumps({}))

CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
     ParsedReply(None, (WEATHER,))),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     ParsedReply("Let me check.", (WEATHER, TIME))),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', ParsedReply(None, (TIME,))),  # cut at max_tokens
    ("hermes", "No tools needed: 42.", ParsedReply("No tools needed: 42.", ())),
    ("hermes", "<tool_call>{not json}</tool_call>", ParsedReply("<tool_call>{not json}</tool_call>", ())),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', ParsedReply(None, (WEATHER,))),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
                    '{"name": "get_time", "parameters": {}}', ParsedReply(None, (WEATHER, TIME))),
    ("llama3_json", '{"city": "Paris"}', ParsedReply('{"city": "Paris"}', ())),  # JSON, but not a call
    ("llama3_json", "Sure, it is sunny.", ParsedReply("Sure, it is sunny.", ())),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
                '{"name": "get_time", "arguments": {}}]', ParsedReply(None, (WEATHER, TIME))),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}', ParsedReply(None, (WEATHER,))),
    ("mistral", 'Plain answer.', ParsedReply("Plain answer.", ())),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}]', ParsedReply('[TOOL_CALLS][{"arguments": {}}]', ())),
]


@pytest.mark.parametrize("fmt,text,want", CASES)
def test_parse(fmt, text, want):
    got = parse(text, fmt)
    assert got.content == want.content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [(c.name, json.loads(c.arguments)) for c in want.calls]


def test_arguments_written_as_a_json_string_are_decoded():
    got = parse('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', "hermes")
    assert json.loads(got.calls[0].arguments) == {"tz": "UTC"}


def test_detect_format_from_templates():
    assert detect_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_format("... <|python_tag|> ... ipython") == "llama3_json"
    assert detect_format("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse("x", "qwen-xml")

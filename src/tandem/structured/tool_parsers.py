"""Tool calls in generated text, in the formats models are trained on. Pure functions over strings.

- hermes (Hermes, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
  call, after optional free text.
- llama3_json (Llama 3.1 / 3.2 / 3.3): the whole reply is a JSON object `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`; several joined by `;`).
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` per call.

`parse` returns the free text before the calls (None when there is none) and each call's name and
arguments as JSON text (OpenAI's shape). Text that only looks like a call (bad JSON, no name) stays
content: a reply is never lost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    calls: tuple[ToolCall, ...]


def detect_format(chat_template: str | None) -> str:
    """The format a chat template teaches, from the markers it writes (hermes when it names none)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def start_marker(fmt: str) -> str:
    """Text that begins a call: streamed content stops before it (llama3_json: a reply opening with '{')."""
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}[fmt]


def parse(text: str, fmt: str) -> ParsedReply:
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "llama3_json":
        return _parse_llama3(text)
    if fmt == "mistral":
        return _parse_mistral(text)
    raise ValueError(f"unknown tool-call format {fmt!r} (one of {', '.join(FORMATS)})")


def calls_from_json(value) -> tuple[ToolCall, ...] | None:
    """A decoded call object or list of them ({"name", "arguments" or "parameters"}), or None if it is not one."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return tuple(calls) if calls else None


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _parse_hermes(text: str) -> ParsedReply:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedReply(text, ())
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        try:
            found = calls_from_json(json.loads(block))
        except ValueError:
            found = None
        if found is None:
            return ParsedReply(text, ())
        calls += found
    return ParsedReply(_content(text[:start]), tuple(calls))


def _parse_llama3(text: str) -> ParsedReply:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return ParsedReply(text, ())
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            value, end = decoder.raw_decode(body, pos)
        except ValueError:
            return ParsedReply(text, ())
        found = calls_from_json(value)
        if found is None:
            return ParsedReply(text, ())
        calls += found
        pos = end
        while pos < len(body) and body[pos] in " \t\n;":
            pos += 1
    return ParsedReply(None, tuple(calls))


_MISTRAL_NEW = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\](.*?)(?=\[TOOL_CALLS\]|$)", re.DOTALL)


def _parse_mistral(text: str) -> ParsedReply:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedReply(text, ())
    rest = text[start + len("[TOOL_CALLS]"):].strip()
    found = None
    if rest.startswith("["):
        try:
            found = calls_from_json(json.JSONDecoder().raw_decode(rest)[0])
        except ValueError:
            found = None
    else:
        calls = []
        for name, args in _MISTRAL_NEW.findall(text[start:].replace("[TOOL_CALLS]", "", 1)):
            try:
                parsed = calls_from_json({"name": name, "arguments": json.loads(args)})
            except ValueError:
                parsed = None
            if parsed is None:
                calls = []
                break
            calls += parsed
        found = tuple(calls) or None
    if found is None:
        return ParsedReply(text, ())
    return ParsedReply(_content(text[:start]), found)

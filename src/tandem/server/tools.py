"""Tool calls in /v1/chat/completions: what `tools` / `tool_choice` ask, and the reply in OpenAI's shape.

- `tools` go to the chat template; the reply is parsed in the template's format
  (structured/tool_parsers.py; `--tool-call-parser` overrides the detection). A template with no tool
  section gets them in the system message instead, in the Hermes format (server/tool_prompt.py).
- `tool_choice`: `auto` (default with tools) parses whatever the model wrote; `none` renders no tools
  and parses nothing; `required` constrains the reply to a JSON array of calls of the given tools, and
  a named function constrains it to that function's arguments (a JSON-schema grammar, so forced calls
  always carry schema-valid arguments, whatever the model).
- Streams hold back text from the first sign of a call and send the calls as one `tool_calls` delta at
  the end (arguments whole), content before them as usual.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tandem.server.errors import bad_request
from tandem.server.protocol import ChatCompletionRequest, NamedToolChoice
from tandem.server.tool_prompt import messages_with_tools
from tandem.structured import tool_parsers
from tandem.structured.tool_parsers import ParsedReply

ANY_ARGUMENTS = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto", "required" or "named"
    tools: tuple[dict, ...]  # OpenAI tool definitions, as the template takes them
    fmt: str  # tool_parsers format of the reply (auto)
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: a reply may hold several calls
    in_system_prompt: bool = False  # the template has no tool section: the tools go in the system message

    def template_kwargs(self) -> dict:
        return {} if self.in_system_prompt else {"tools": list(self.tools)}

    def messages(self, messages: list[dict]) -> list[dict]:
        """The conversation as the template gets it (rewritten when the tools go in the system message)."""
        if not self.in_system_prompt:
            return messages
        return messages_with_tools(messages, list(self.tools), self.mode, self.named)

    def constraint(self) -> tuple[str, dict] | None:
        """(request field, SamplingParams keywords) of the grammar a forced call needs, or None (auto)."""
        if self.mode == "named":
            return "tool_choice", {"json_schema": self._parameters(self.named)}
        if self.mode == "required":
            options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                         "parameters": self._parameters(t["function"]["name"])},
                        "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            array = {"type": "array", "minItems": 1, "items": options[0] if len(options) == 1 else {"anyOf": options}}
            if not self.parallel:
                array["maxItems"] = 1
            return "tool_choice", {"json_schema": array}
        return None

    def _parameters(self, name: str) -> dict:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or ANY_ARGUMENTS

    def parse(self, text: str) -> ParsedReply:
        if self.mode == "named":
            return ParsedReply(None, (tool_parsers.ToolCall(self.named, text),))
        if self.mode == "required":
            try:
                calls = tool_parsers.calls_from_json(json.loads(text))
            except ValueError:
                calls = None
            return ParsedReply(None, calls) if calls else ParsedReply(text, ())
        return tool_parsers.parse(text, self.fmt)


def plan_tools(req: ChatCompletionRequest, chat_template: str | None, parser: str | None) -> ToolPlan | None:
    """The request's tool plan (None: no tools in play), after checking it against the template."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    in_system_prompt = "tools" not in (chat_template or "")
    # (tools in the system message are taught in the Hermes format, so replies are parsed in it)
    fmt = "hermes" if in_system_prompt else parser or tool_parsers.detect_format(chat_template)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
        return ToolPlan("named", tools, fmt, choice.function.name, in_system_prompt=in_system_prompt)
    return ToolPlan("required" if choice == "required" else "auto", tools, fmt,
                    parallel=req.parallel_tool_calls is not False, in_system_prompt=in_system_prompt)


def tool_calls_json(parsed: ParsedReply) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]


class ToolStream:
    """One streamed choice's text with tools in play: `push` returns the content that may go out now;
    `finish` the rest and the parsed reply."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of self.text already streamed as content

    def push(self, text: str) -> str:
        self.text += text
        safe = self._safe_len()
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def _safe_len(self) -> int:
        if self.plan.mode != "auto":
            return 0  # a forced call: nothing of it is content
        marker = tool_parsers.start_marker(self.plan.fmt)
        if self.plan.fmt == "llama3_json":  # a call is the whole reply: hold it if it opens like one
            stripped = self.text.lstrip()
            return 0 if not stripped or stripped[0] in "{<" else len(self.text)
        found = self.text.find(marker)
        if found >= 0:
            return found
        # Hold back a tail that could be the start of the marker.
        for k in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if self.text.endswith(marker[:k]):
                return len(self.text) - k
        return len(self.text)

    def finish(self) -> tuple[str, ParsedReply]:
        parsed = self.plan.parse(self.text)
        if not parsed.calls:
            return self.text[self.sent:], parsed
        start = self.text.find(tool_parsers.start_marker(self.plan.fmt)) if self.plan.mode == "auto" else 0
        return self.text[self.sent:max(start, self.sent)], parsed

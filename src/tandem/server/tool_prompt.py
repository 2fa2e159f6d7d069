"""Tools for a chat template that has no tool section (SmolLM2's ChatML, most small models' templates).

The tool list goes into the system message, in the Hermes format that Qwen and Hermes templates write
themselves: the functions as JSON inside <tools></tools>, and how to answer. The conversation's own tool
turns become that format's text, so the template needs nothing but roles and content: an assistant's
calls as <tool_call> blocks after its content, a tool result as a user turn inside <tool_response>.
Replies are parsed as hermes. A forced call (`required`, a named function) is held to its JSON by a
grammar anyway; the instruction then asks for exactly that JSON, so the model's values fit it.
"""

from __future__ import annotations

import json

AUTO_INSTRUCTION = ("To call a function, answer with one block per call and nothing else in it:\n"
                    '<tool_call>{"name": "the function name", "arguments": {"an argument": "its value"}}</tool_call>\n'
                    "Otherwise answer in text.")
REQUIRED_INSTRUCTION = ('Answer with a JSON list of calls, for example [{"name": "the function name", "parameters": '
                        '{"an argument": "its value"}}], and nothing else.')
NAMED_INSTRUCTION = "Call the function {name}: answer with its arguments as one JSON object, and nothing else."


def tool_system_prompt(tools: list[dict], mode: str, named: str | None = None) -> str:
    """The system text that teaches `tools` (OpenAI tool definitions) to a model whose template cannot."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    how = {"auto": AUTO_INSTRUCTION, "required": REQUIRED_INSTRUCTION,
           "named": NAMED_INSTRUCTION.format(name=named)}[mode]
    return f"You can call these functions, given as JSON schemas:\n<tools>\n{listing}\n</tools>\n{how}"


def messages_with_tools(messages: list[dict], tools: list[dict], mode: str, named: str | None = None) -> list[dict]:
    """`messages` (as the template takes them) rewritten for a template with roles and content only."""
    out = [_as_text(m) for m in messages]
    system = tool_system_prompt(tools, mode, named)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def _as_text(message: dict) -> dict:
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [f"<tool_call>{json.dumps(_call(c), ensure_ascii=False)}</tool_call>" for c in calls]
    content = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}


def _call(call: dict) -> dict:
    function = call.get("function") or {}
    return {"name": function.get("name"), "arguments": function.get("arguments", {})}

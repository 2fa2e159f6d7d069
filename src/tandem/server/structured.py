"""Structured output in requests: which field asks for which grammar, and its check before the engine.

Clients ask in several dialects: OpenAI's `response_format` (`json_object`, `json_schema`), SGLang's
`json_schema` / `regex` / `ebnf`, vLLM's `guided_json` / `guided_regex` / `guided_grammar` /
`guided_choice` and `structured_outputs`, plus `grammar`. Each becomes one of SamplingParams'
`json_schema`, `regex` or `grammar`; a request may use one way only (a 400 names both otherwise). The
grammar is compiled here first (cached, off the event loop), so a bad one is a 400 naming its field
before any engine work starts.
"""

from __future__ import annotations

import asyncio
import json
import re

from tandem.server.errors import bad_request
from tandem.server.protocol import SamplingRequest
from tandem.structured.grammar import ANY_JSON_OBJECT, GrammarError, spec_of

# (request field, SamplingParams field) for the fields that carry a grammar directly.
_DIRECT = (("json_schema", "json_schema"), ("regex", "regex"), ("ebnf", "grammar"), ("grammar", "grammar"),
           ("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_grammar", "grammar"))


def choice_regex(choices: list[str]) -> str:
    """One of the given strings, exactly."""
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise ValueError("must be a non-empty list of non-empty strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def requested_grammar(req: SamplingRequest, extra: tuple[str, dict] | None = None) -> tuple[str, dict] | None:
    """(request field, SamplingParams keyword) of the request's grammar, or None. `extra`: one more
    source (a tool_choice that forces a call)."""
    found: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_schema": ANY_JSON_OBJECT}))
    elif fmt is not None and fmt.type == "json_schema":
        found.append(("response_format", {"json_schema": fmt.json_schema.schema_}))
    for field, param in _DIRECT:
        value = getattr(req, field)
        if value is not None:
            found.append((field, {param: value}))
    if req.guided_choice is not None:
        found.append(("guided_choice", {"regex": _choice(req.guided_choice, "guided_choice")}))
    so = req.structured_outputs
    if so is not None:
        values = {"json": so.json_, "regex": so.regex, "grammar": so.grammar, "choice": so.choice}
        given = [k for k, v in values.items() if v is not None]
        if len(given) != 1:
            raise bad_request("structured_outputs: give exactly one of json, regex, grammar, choice",
                              "structured_outputs")
        key = given[0]
        value = values[key]
        param = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}.get(key)
        found.append((f"structured_outputs.{key}",
                      {param: value} if param else {"regex": _choice(value, "structured_outputs.choice")}))
    if extra is not None:
        found.append(extra)
    if len(found) > 1:
        raise bad_request(f"{found[1][0]}: only one structured-output constraint per request "
                          f"(this one also has {found[0][0]})", found[1][0])
    if not found:
        return None
    field, kwargs = found[0]
    if "json_schema" in kwargs and isinstance(kwargs["json_schema"], str):
        try:
            kwargs = {"json_schema": json.loads(kwargs["json_schema"])}
        except ValueError as e:
            raise bad_request(f"{field}: not valid JSON ({e})", field) from None
    if "json_schema" in kwargs and not isinstance(kwargs["json_schema"], (dict, bool)):
        raise bad_request(f"{field}: a JSON schema must be an object", field)
    return field, kwargs


def _choice(choices: list[str], field: str) -> str:
    try:
        return choice_regex(choices)
    except ValueError as e:
        raise bad_request(f"{field}: {e}", field) from None


class GrammarCheck:
    """Compiles each request's grammar in the front end (the engine core compiles it again; both cache
    by grammar), so that errors are 400s before a stream starts."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None

    async def check(self, field: str, params) -> None:
        if self.tokenizer is None:
            raise bad_request(f"{field}: structured output needs the model's tokenizer, and it has none", field)
        try:
            await asyncio.to_thread(self._compile, params)
        except GrammarError as e:
            reason = str(e).split(": ", 1)[-1]
            raise bad_request(f"{field}: {reason}", field) from None

    def _compile(self, params) -> None:
        if self._compiler is None:
            from tandem.structured.grammar import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, ())
        self._compiler.compile(spec_of(params))

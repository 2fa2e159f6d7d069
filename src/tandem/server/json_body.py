"""Request bodies from bytes to plain JSON values, refusing what later stages cannot take.

Two kinds of input parse as JSON but break something downstream: nesting deep enough to exhaust
Python's recursion (the decoder, then validation), and strings holding a lone UTF-16 surrogate
(`"\\ud800"` is valid JSON, but such a string cannot be encoded as UTF-8: the tokenizer and the
engine process boundary both fail on it). Both become a 400 naming the field here, before anything
is counted or queued.
"""

from __future__ import annotations

import json

from tandem.server.errors import bad_request

MAX_DEPTH = 64  # objects and arrays inside each other; OpenAI bodies need fewer than 10


def parse_body(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body is nested too deeply (limit {MAX_DEPTH})") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    check_values(data)
    return data


def check_values(data) -> None:
    """Walks the parsed body without recursion: raises a 400 for nesting deeper than MAX_DEPTH or a
    string (value or key) that is not valid Unicode text."""
    stack = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                _check_text(key, f"{path}.{key!r}" if path else repr(key))
                items.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            items = [(item, f"{path}[{i}]") for i, item in enumerate(value)]
        else:
            continue
        if depth > MAX_DEPTH:
            raise bad_request(f"{path or 'the request body'}: nested too deeply (limit {MAX_DEPTH})", path or None)
        stack.extend((item, p, depth + 1) for item, p in items)


def _check_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{path}: the string holds a lone UTF-16 surrogate at character {e.start} "
                          "(not valid Unicode text)", path or None) from None



"""Errors in the OpenAI JSON shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re

from pydantic import ValidationError

# HTTP status -> OpenAI error type
# (the 4xx are all "invalid_request_error" in OpenAI's API; their `code` tells them apart)
ERROR_TYPES = {500: "server_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def from_validation_error(err: ValidationError) -> OpenAIError:
    """The first pydantic error, named by its field path (`messages[0].content`)."""
    first = err.errors()[0]
    param = _param_path(first["loc"])
    if first["type"] == "extra_forbidden":
        msg = "unknown or unsupported field"
    elif first["type"] == "missing":
        msg = "field required"
    elif first["type"] == "value_error" and param is None:
        # A model validator's own message, "field: what is wrong" (protocol.py)
        msg = str(first.get("ctx", {}).get("error", first["msg"]))
        return bad_request(msg, msg.split(":")[0] if ":" in msg else None)
    else:
        msg = first["msg"]
    return bad_request(f"{param}: {msg}" if param else msg, param)


def _param_path(loc) -> str | None:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "list", "dict") or "-" in part:
            break  # pydantic names the union member it tried, not a field
        else:
            path += f".{part}" if path else part
    return path or None


_PARAMS_FIELD = re.compile(r"^SamplingParams\.(\w+): (.*)$", re.S)


def from_sampling_params_error(err: ValueError, api_names: dict[str, str]) -> OpenAIError:
    """`SamplingParams.top_p: must be in (0, 1] (got 2)` -> 400 naming the request field `top_p`."""
    m = _PARAMS_FIELD.match(str(err))
    if m is None:
        return bad_request(str(err))
    param = api_names.get(m.group(1), m.group(1))
    return bad_request(f"{param}: {m.group(2)}", param)

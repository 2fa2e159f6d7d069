"""Typed messages between the HTTP front end and the engine core process (DESIGN §3).

Two ZMQ PUSH/PULL pipes over `ipc://`: the front end pushes `AddRequest` / `AbortRequest` /
`FlushCache` / `Shutdown` to the core; the core pushes `CoreReady`, `CoreOutputs` (token deltas plus a
stats snapshot, once per engine step), `RequestRejected`, `CacheFlushed` and `CoreFailed` back. Every message is a
dataclass; on the wire it is msgpack of `[class name, {field: value}]`, nested dataclasses as dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field

import msgpack

from tandem.request import RequestDelta, SamplingParams, TokenLogprob

# ---- front end -> core ------------------------------------------------------------------------


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class AbortRequest:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class FlushCache:
    """Drop every cached KV page no request holds (Engine.flush_cache); answered by CacheFlushed."""

    flush_id: int


# ---- core -> front end ------------------------------------------------------------------------


@dataclass
class CoreReady:
    pid: int
    model_path: str
    max_model_len: int
    vocab_size: int
    page_size: int
    num_pages: int
    speculative_algorithm: str | None
    max_running_requests: int = 64


# The engine's own per-step delta travels as is: tokens only, the front end detokenizes.
TokenDelta = RequestDelta


@dataclass
class SpecCounters:
    """Cumulative since the core started (a copy of `SpecWorker.stats`)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    mean_accept_length: float = 0.0
    steps_by_depth: list[int] = field(default_factory=list)  # engine steps per chosen draft depth (0..D)
    estimated_acceptance: list[float] = field(default_factory=list)  # the adaptive policy's a_1..a_D
    catch_ups: int = 0  # steps that first ran the draft over tokens depth-0 steps deferred
    dormant_admitted: int = 0  # requests the adaptive policy admitted without draft state


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_pages_used: int = 0  # held by requests (cached pages nobody holds are not in use)
    kv_pages_total: int = 0
    spec: SpecCounters | None = None
    kv_pages_cached: int = 0  # prefix cache: pages nobody holds, kept for their content
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since the core started
    prefix_cache_hits: int = 0  # of those, tokens found


@dataclass
class CoreOutputs:
    deltas: list[TokenDelta]
    stats: EngineStats


@dataclass
class RequestRejected:
    """`Engine.add_request` failed for this request: ValueError (bad input: the front end answers 400
    with the message) or, with `internal`, any other exception (500; the engine carries on)."""

    request_id: str
    message: str
    internal: bool = False


@dataclass
class CacheFlushed:
    """The answer to FlushCache: whether every page is free now, and if not, how many requests hold pages."""

    flush_id: int
    flushed: bool
    requests_holding_pages: int = 0


@dataclass
class CoreFailed:
    """The core hit an unexpected error and is exiting."""

    message: str


MESSAGES = {cls.__name__: cls for cls in (AddRequest, AbortRequest, Shutdown, FlushCache, CoreReady, CoreOutputs,
                                          RequestRejected, CacheFlushed, CoreFailed)}


def encode(msg) -> bytes:
    return msgpack.packb([type(msg).__name__, _plain(msg)], use_bin_type=True)


def decode(data: bytes):
    name, body = msgpack.unpackb(data, raw=False, strict_map_key=False)  # logit_bias maps int keys
    return _build(MESSAGES[name], body)


def request_id_of(data: bytes) -> str | None:
    """The request id an encoded message carries, read without rebuilding it (None if it has none)."""
    try:
        _, body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        rid = body.get("request_id")
    except Exception:
        return None
    return rid if isinstance(rid, str) else None


def _plain(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _build(tp, value):
    """Rebuilds a value of type `tp` from its plain form; only dataclasses need rebuilding."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(args[0], value) if len(args) == 1 else value
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_build(item, v) for v in value]
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        return tp(**{k: _build(hints[k], v) for k, v in value.items()})
    return value

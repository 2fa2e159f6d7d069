"""Requests as the CPU side sees them: sampling parameters, request state, outputs.

Nothing here imports torch: the scheduler works on these objects alone.
"""

from __future__ import annotations

import enum
import json
import math
import random
from dataclasses import dataclass, field


SEED_MASK = (1 << 63) - 1  # seeds are kept as non-negative int64

# What the engine stores each field in bounds what a request may ask (SamplingParams.validate).
FLOAT32_MAX = 3.4028234663852886e38  # temperature and the other floats go into float32 device tables
INT32_MAX = 2**31 - 1  # counts and token ids (top_k, max_new_tokens, min_tokens, ids when no vocabulary is known)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds cross the process boundary as msgpack int64
MIN_TEMPERATURE = 1e-6  # a smaller positive temperature samples as this one (logits / T stays finite)
MAX_STOP_STRINGS = 256  # each is checked against the text after every token
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller (or the client went away)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Field names follow SGLang / vLLM."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot be drawn before this many new tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: in [-100, 100])
    # None: no logprobs; 0: logprob of the chosen token; n>0: also the top-n alternatives
    logprobs: int | None = None
    # Log-probabilities at the prompt's positions (each prompt token given the ones before it; the
    # first has none): None: not computed; 0: the prompt token's own; n>0: also the top-n there.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Structured output (at most one): the output must match a JSON schema (a dict or its JSON text;
    # {"type": "object"} for any object), a regular expression, or an EBNF grammar (xgrammar's dialect).
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop) if isinstance(self.stop, (list, tuple)) else self.stop or []
        self.stop_token_ids = (list(self.stop_token_ids) if isinstance(self.stop_token_ids, (list, tuple))
                               else self.stop_token_ids or [])
        self.validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE  # what the sampler would use anyway (logits / T stays finite)

    def validate(self, vocab_size: int | None = None) -> None:
        """Every field against its meaning and against what it is stored in (float32 and int64 device
        tables, int32 counts, msgpack int64 across the engine's process boundary), so that no value can
        fail later inside the engine core's loop. With `vocab_size`, token ids must also lie in the
        vocabulary. Raises ValueError naming the field."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name}: {why} (got {_short(getattr(self, name))})")

        if not _int_in(self.max_new_tokens, 1, INT32_MAX):
            bad("max_new_tokens", f"must be an integer in [1, {INT32_MAX}]")
        if not _float32(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a number in [0, {FLOAT32_MAX:.7g}] (a float32 holds it)")
        if not _float32(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _int_in(self.top_k, -1, INT32_MAX):
            bad("top_k", f"must be an integer in [-1, {INT32_MAX}] (-1 or 0 disables it)")
        if not _float32(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _int_in(self.seed, INT64_MIN, INT64_MAX):
            bad("seed", f"must be None or an integer in [{INT64_MIN}, {INT64_MAX}]")
        # Logits are divided or multiplied by it: far from 1 they overflow float32 (1e-300 made every
        # logit of a seen token infinite).
        if not _float32(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            bad("repetition_penalty", "must be between 0.01 and 100")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _float32(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if (not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS
                or any(not isinstance(s, str) or not s for s in self.stop)):
            bad("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings")
        token_limit = INT32_MAX if vocab_size is None else vocab_size - 1
        if not isinstance(self.stop_token_ids, list) or any(not _int_in(t, 0, token_limit)
                                                            for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {token_limit}]")
        if not _int_in(self.min_tokens, 0, self.max_new_tokens):  # (max_new_tokens was checked above)
            bad("min_tokens", "must be an integer in [0, max_new_tokens]")
        if self.logit_bias is not None:
            if (not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS
                    or any(not _int_in(t, 0, token_limit) for t in self.logit_bias)
                    or any(not _float32(v) or not -100 <= v <= 100 for v in self.logit_bias.values())):
                bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids in [0, {token_limit}] "
                                  "to numbers in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not _int_in(getattr(self, name), 0, MAX_LOGPROBS):
                bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"SamplingParams: give at most one of json_schema, regex, grammar (got {given})")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    bad("json_schema", f"is not valid JSON ({e})")
            if not isinstance(schema, (dict, bool)):
                bad("json_schema", "must be a JSON object (a schema)")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and (not isinstance(getattr(self, name), str) or not getattr(self, name)):
                bad(name, "must be a non-empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        """Whether a grammar restricts the tokens (structured output)."""
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def needs_penalties(self) -> bool:
        """Whether the stage that edits each row's logits runs: penalties, logit bias, min_tokens."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)


def _float32(x: object) -> bool:
    """A real number (not a bool) that a float32 tensor holds without overflow."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and abs(x) <= FLOAT32_MAX


def _int_in(x: object, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _short(value: object) -> str:
    """The offending value for an error message, cut short (a field may hold a huge list)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class Request:
    """One generation request and its progress. Owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    # How many tokens of prompt+output already have their KV in the cache.
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    page_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Keys every random draw of this request with each token's position (layers/sampling_noise.py): the
    # caller's seed, or one drawn here, so a recompute after preemption redraws the same tokens.
    sampling_seed: int | None = None
    # Tokens produced per verify step (speculative decoding); its mean is tau.
    spec_accept_lengths: list[int] = field(default_factory=list)
    # Prompt tokens whose KV the prefix cache held when the request was first admitted.
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if self.sampling_seed is None:
            seed = self.sampling_params.seed
            self.sampling_seed = random.getrandbits(63) if seed is None else seed & SEED_MASK

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """What `Engine.generate` returns for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    spec_accept_lengths: list[int] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing before it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's cached_tokens)

    @property
    def accept_length_mean(self) -> float | None:
        if not self.spec_accept_lengths:
            return None
        return sum(self.spec_accept_lengths) / len(self.spec_accept_lengths)


@dataclass
class RequestDelta:
    """What one engine step added to one request (for streaming; also the engine process's message)."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # set on the request's last delta
    accept_length: int | None = None  # speculative: tokens this verify step produced
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the request's first delta, if asked
    num_cached_tokens: int | None = None  # on the request's first delta: prompt tokens the prefix cache held


@dataclass
class StepOutput:
    deltas: list[RequestDelta] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)

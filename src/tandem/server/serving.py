"""OpenAI completions and chat completions on top of the engine replicas: turns a request body into
engine requests (one per prompt and sample, `n` independent requests per prompt, all on the one
replica the router picks), follows their token deltas, and writes the JSON response or the SSE stream.

Extension field: when the engine runs speculative decoding, `usage` carries
`mean_accept_length` (tokens per verify step, accepted drafts + 1, over all choices; null before the
first verify step) and `spec_verify_steps` (how many verify steps that was).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import json
import math
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem.engine import ipc
from tandem.request import SEED_MASK, SamplingParams, TokenLogprob
from tandem.server.detokenizer import IncrementalDetokenizer
from tandem.server.drain import Drain, shutting_down
from tandem.server.engine_client import EngineClient, EngineDead
from tandem.server.errors import OpenAIError, bad_request, from_sampling_params_error
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingRequest,
                                    TokenizeRequest)
from tandem.server.replicas import ReplicaSet
from tandem.server.structured import GrammarCheck, requested_grammar
from tandem.server.tools import ToolPlan, ToolStream, plan_tools, tool_calls_json

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
LOGPROB_FLOOR = -9999.0  # JSON has no -inf


@dataclass
class Choice:
    """One engine request: sample `index` of the response."""

    index: int
    request_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    chars_sent: int = 0  # streamed text so far (completions logprobs text_offset)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first delta, when asked
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held (with the first delta)
    output_hidden: bool = False  # echo with max_tokens 0: the one token generated is not returned


@dataclass
class Update:
    choice: Choice
    text: str  # newly showable text
    logprobs: list[TokenLogprob]  # of the new tokens, when asked for
    finish_reason: str | None


class Generation:
    """The engine requests behind one HTTP request, merged into one stream of updates. They all run
    on one replica, picked at `start`; aborts go to it."""

    def __init__(self, replicas: ReplicaSet, metrics: ServerMetrics, prompts: list[list[int]],
                 choices: list[Choice], prompt_param: str, on_close=None):
        self.on_close = on_close  # called once, when the generation is done with (drain bookkeeping)
        self.replicas = replicas
        self.replica: EngineClient | None = None
        self.metrics = metrics
        self.prompts = prompts
        self.choices = choices
        self.prompt_param = prompt_param
        self._by_id = {c.request_id: c for c in choices}
        self._open: set[str] = set()
        self._queue: asyncio.Queue = asyncio.Queue()

    def start(self) -> None:
        try:
            self.replica = self.replicas.pick(len(self.choices), self.prompts)
        except EngineDead as e:
            raise engine_unavailable(str(e)) from None
        for c in self.choices:
            try:
                self.replica.add(c.request_id, c.prompt_token_ids, c.params, self._queue)
            except EngineDead as e:
                self.close()
                raise engine_unavailable(str(e)) from None
            self._open.add(c.request_id)
            self.metrics.prompt_tokens.inc(len(c.prompt_token_ids))

    async def next(self) -> Update | None:
        """The next update of any choice; None once all have finished."""
        while self._open:
            item = await self._queue.get()
            if isinstance(item, EngineDead):
                self._end_all("error")
                raise engine_unavailable(str(item))
            if isinstance(item, OpenAIError):  # `interrupt`: the server is shutting down
                self.close()
                raise item
            if isinstance(item, ipc.RequestRejected):
                self._open.discard(item.request_id)
                if item.internal:
                    raise OpenAIError(500, item.message, code="internal_error")
                raise bad_request(item.message, self.prompt_param)
            delta, now = item
            return self._apply(self._by_id[delta.request_id], delta, now)
        return None

    def _apply(self, c: Choice, delta: ipc.TokenDelta, now: float) -> Update:
        new = delta.new_token_ids
        self.metrics.on_tokens(len(new), c.arrival, c.first_token_at, c.last_token_at, now)
        c.first_token_at = c.first_token_at or now
        c.last_token_at = now
        c.token_ids.extend(new)
        if delta.prompt_logprobs is not None:
            c.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens is not None:
            c.num_cached_tokens = delta.num_cached_tokens
        if delta.accept_length is not None:
            c.accept_lengths.append(delta.accept_length)
        new_logprobs = (delta.logprobs or []) if c.params.logprobs is not None else []
        c.logprobs.extend(new_logprobs)
        reason = delta.finish_reason
        text = c.detok.push(new, final=reason is not None)
        if reason is None and c.detok.stopped:
            # The engine stops at the same token unless its decoding saw the text differently.
            self.replica.abort([c.request_id])
            reason = "stop"
        if reason is not None:
            c.finish_reason = reason
            self._open.discard(c.request_id)
            self.metrics.on_finished(reason, c.arrival, now)
            self.replicas.remember(self.replica, [c.prompt_token_ids + c.token_ids])  # its pages stay cached there
        return Update(c, text, new_logprobs, reason)

    def interrupt(self, error: OpenAIError) -> None:
        """Ends the generation with `error` (raised by `next`), whatever is still running."""
        self._queue.put_nowait(error)

    def close(self) -> None:
        """Aborts whatever has not finished (client gone, error); safe to call more than once."""
        if self._open:
            self.replica.abort(list(self._open))
            self._end_all("abort")
        if self.on_close is not None:
            self.on_close(self)
            self.on_close = None

    def _end_all(self, reason: str) -> None:
        now = time.monotonic()
        for rid in self._open:
            self.metrics.on_finished(reason, self._by_id[rid].arrival, now)
        self._open.clear()


def default_queue_limit(replicas: ReplicaSet) -> int:
    """The default for --max-queued-requests: twice the requests the engine cores can run at once, each
    replica counting min(--max-running-requests, requests of 2048 tokens (or the context length, if
    shorter) its KV pool holds), and at least 16. Overload then shows as 503 + Retry-After instead of
    client time-outs, while a burst of twice the engine's capacity still queues."""
    runnable = 0
    for replica in replicas.replicas:
        i = replica.info
        per_request = min(i.max_model_len, 2048)
        runnable += min(i.max_running_requests, max(1, i.num_pages * i.page_size // per_request))
    return max(16, 2 * runnable)


def engine_unavailable(reason: str) -> OpenAIError:
    return OpenAIError(503, f"the engine is not available: {reason}", code="engine_unavailable")


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the stream ends (done, error,
    client gone), so that unfinished engine requests are always aborted."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    def __init__(self, replicas: ReplicaSet, metrics: ServerMetrics, tokenizer, model_name: str,
                 max_queued_requests: int | None, drain: Drain | None = None, tool_call_parser: str | None = None):
        self.drain = drain or Drain(0.0)
        self.replicas = replicas
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.model_name = model_name
        # None: the default, from what the engine cores can hold; 0: no limit.
        self.max_queued_requests = (default_queue_limit(replicas) if max_queued_requests is None
                                    else max_queued_requests or None)
        self._token_strs: dict[int, str] = {}
        self._shown_lens: dict[int, int] = {}
        self._max_token_chars: int | None = None  # the vocabulary's longest entry (_check_text_fits)
        self._grammar_check: GrammarCheck | None = None
        self.tool_call_parser = tool_call_parser

    @property
    def speculative(self) -> bool:
        return self.replicas.info is not None and self.replicas.info.speculative_algorithm is not None

    # ---- /v1/completions ----------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req.model)
        if req.suffix is not None:
            raise bad_request("suffix: not supported", "suffix")
        best_of = req.n if req.best_of is None else req.best_of
        if best_of < req.n or best_of > 128:
            raise bad_request(f"best_of: must be between n ({req.n}) and 128", "best_of")
        if best_of > req.n and req.stream:
            raise bad_request("best_of: cannot stream when best_of > n (the best are known only at the end)",
                              "best_of")
        prompts = await self._completion_prompts(req)
        grammar = await self._grammar(req)
        # echo with max_tokens 0 (log-likelihood of the prompt alone): the engine needs one new token,
        # which is then not returned.
        echo_only = req.echo and req.max_tokens == 0
        prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
        if req.prompt_logprobs is not None:
            prompt_lps = max(prompt_lps or 0, req.prompt_logprobs)
        # best_of > n needs each sample's cumulative logprob: the chosen tokens' logprobs at least.
        logprobs = req.logprobs if best_of == req.n or req.logprobs is not None else 0
        gen = self._start(req, prompts, "prompt", 1 if echo_only else req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS,
                          logprobs, {"logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"}, arrival,
                          prompt_logprobs=prompt_lps, samples=best_of, grammar=grammar)
        for c in gen.choices:
            c.output_hidden = echo_only
        texts = self._prompt_texts(req, prompts) if req.echo else None
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return SSEResponse(self._completion_stream(gen, rid, created, req.include_usage, req.continuous_usage,
                                                       req, texts), gen.close)
        if not await self._run_to_end(gen, http):
            return Response(status_code=499)
        choices = []
        for c in self._best(gen.choices, req.n, best_of):
            text = "" if c.output_hidden else c.detok.text
            lps = [] if c.output_hidden else c.logprobs
            logprobs = None
            if req.logprobs is not None:
                logprobs = (self._echo_logprobs(c, lps, texts[c.prompt_index]) if req.echo
                            else self._completion_logprobs(lps, 0))
            index = c.index if best_of == req.n else len(choices)
            choice = {"index": index, "text": (texts[c.prompt_index] if req.echo else "") + text,
                      "finish_reason": c.finish_reason, "logprobs": logprobs}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(c, req.prompt_logprobs)
            choices.append(choice)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self._usage(gen)})

    @staticmethod
    def _best(choices: list[Choice], n: int, best_of: int) -> list[Choice]:
        """best_of > n: per prompt, the n samples with the highest cumulative logprob (OpenAI's rule)."""
        if best_of == n:
            return choices
        best = []
        for i in range(0, len(choices), best_of):
            group = choices[i:i + best_of]
            best += sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs))[:n]
        return best

    def _prompt_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What echo returns before the completion: the prompt as sent (text), or decoded (token ids)."""
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], str):
            return list(p)
        return [self.tokenizer.decode(ids) if self.tokenizer is not None else "" for ids in prompts]

    def _echo_logprobs(self, c: Choice, lps: list[TokenLogprob], prompt_text: str) -> dict:
        """OpenAI's legacy shape over prompt + completion: the first prompt token has no logprob (null,
        and null top_logprobs); offsets run through the prompt text, then the completion's."""
        prompt = c.prompt_logprobs or [None] * len(c.prompt_token_ids)
        tokens, offsets, values, tops = [], [], [], []
        offset = 0
        for t, token_id in enumerate(c.prompt_token_ids):
            tokens.append(self._token_str(token_id))
            offsets.append(offset)
            offset += self._shown_len(token_id)
            lp = prompt[t] if t < len(prompt) else None
            values.append(None if lp is None else _finite(lp.logprob))
            tops.append(None if lp is None else {self._token_str(i): _finite(v) for i, v in lp.top})
        rest = self._completion_logprobs(lps, len(prompt_text))
        return {"tokens": tokens + rest["tokens"], "token_logprobs": values + rest["token_logprobs"],
                "top_logprobs": tops + rest["top_logprobs"], "text_offset": offsets + rest["text_offset"]}

    def _vllm_prompt_logprobs(self, c: Choice, top_n: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {logprob,
        decoded_token}} for the prompt token and the top n there."""
        out: list[dict | None] = []
        for lp in c.prompt_logprobs or [None] * len(c.prompt_token_ids):
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": _finite(lp.logprob), "decoded_token": self._token_str(lp.token_id)}}
            for i, v in lp.top[:top_n]:
                entry.setdefault(str(i), {"logprob": _finite(v), "decoded_token": self._token_str(i)})
            out.append(entry)
        return out

    async def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], str)):
            texts = [p] if isinstance(p, str) else p
            if self.tokenizer is None:
                raise bad_request("prompt: the model has no tokenizer; send token ids", "prompt")
            for i, t in enumerate(texts):
                self._check_text_fits(len(t), "prompt" if isinstance(p, str) else f"prompt[{i}]")
            # Tokenising a long text takes seconds: off the event loop, which keeps serving.
            return await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])
        if p and isinstance(p[0], int):
            return [list(p)]
        return [list(ids) for ids in p] or [[]]

    async def _completion_stream(self, gen: Generation, rid: str, created: int, include_usage: bool,
                                 continuous_usage: bool = False, req: CompletionRequest | None = None,
                                 texts: list[str] | None = None):
        def chunk(choices, **extra):
            if continuous_usage and "usage" not in extra:
                extra["usage"] = self._usage(gen)
            return sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": choices, **extra})

        echoed: set[int] = set()  # choices whose prompt text went out
        prompt_lps_sent: set[int] = set()
        try:
            while (u := await gen.next()) is not None:
                c = u.choice
                text, new_lps = ("", []) if c.output_hidden else (u.text, u.logprobs)
                lp = None
                if c.params.logprobs is not None:
                    lp = self._completion_logprobs(new_lps, c.chars_sent)
                if texts is not None and c.index not in echoed:
                    # echo: the prompt (and its logprobs) comes first, in the choice's first chunk
                    echoed.add(c.index)
                    prompt_text = texts[c.prompt_index]
                    if c.params.logprobs is not None:
                        lp = self._echo_logprobs(c, new_lps, prompt_text)
                    text = prompt_text + text
                c.chars_sent += len(text)
                if text or new_lps or u.finish_reason or lp:
                    body = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": u.finish_reason}
                    if (req is not None and req.prompt_logprobs is not None and c.prompt_logprobs is not None
                            and c.index not in prompt_lps_sent):
                        prompt_lps_sent.add(c.index)
                        body["prompt_logprobs"] = self._vllm_prompt_logprobs(c, req.prompt_logprobs)
                    yield chunk([body])
            if include_usage:
                yield chunk([], usage=self._usage(gen))
            yield "data: [DONE]\n\n"
        except OpenAIError as e:
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 (the stream has started: end it with an error event, not a cut)
            logger.exception("unhandled error in a stream")
            yield sse(OpenAIError(500, f"internal server error: {type(e).__name__}").body())
        finally:
            gen.close()

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs=true", "top_logprobs")
        self._check_text_fits(sum(len(m.content) if isinstance(m.content, str) else
                                  sum(len(part.text) for part in m.content or ()) for m in req.messages), "messages")
        tools = plan_tools(req, getattr(self.tokenizer, "chat_template", None), self.tool_call_parser)
        prompt = await asyncio.to_thread(self._chat_prompt, req, tools)
        grammar = await self._grammar(req, tools.constraint() if tools else None)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        gen = self._start(req, [prompt], "messages", max_tokens, None, logprobs,
                          {"logprobs": "top_logprobs", "max_new_tokens": max_tokens_name}, arrival, grammar=grammar)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return SSEResponse(self._chat_stream(gen, rid, created, req.include_usage, req.continuous_usage, tools),
                               gen.close)
        if not await self._run_to_end(gen, http):
            return Response(status_code=499)
        choices = []
        for c in gen.choices:
            message, finish = {"role": "assistant", "content": c.detok.text}, c.finish_reason
            parsed = tools.parse(c.detok.text) if tools else None
            if parsed is not None and parsed.calls:
                message = {"role": "assistant", "content": parsed.content, "tool_calls": tool_calls_json(parsed)}
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c.index, "message": message, "finish_reason": finish,
                            "logprobs": {"content": self._chat_logprobs(c.logprobs)} if req.logprobs else None})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self._usage(gen)})

    def _chat_prompt(self, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_request(f"the model {self.model_name!r} has no chat template; use /v1/completions "
                              "with a plain prompt", "messages", "no_chat_template")
        messages = [m.for_template() for m in req.messages]
        extra = dict(req.chat_template_kwargs or {})
        if req.continue_final_message:
            extra["continue_final_message"] = True
        if tools is not None:
            messages = tools.messages(messages)
            extra.update(tools.template_kwargs())
        try:
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=req.add_generation_prompt,
                                          **extra)
        except Exception as e:  # jinja2 errors, or the template's own raise_exception(...)
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
        return list(ids)

    async def _chat_stream(self, gen: Generation, rid: str, created: int, include_usage: bool,
                           continuous_usage: bool = False, tools: ToolPlan | None = None):
        def chunk(choices, **extra):
            if continuous_usage and "usage" not in extra:
                extra["usage"] = self._usage(gen)
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": self.model_name, "choices": choices, **extra})

        try:
            for c in gen.choices:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            held = {c.index: ToolStream(tools) for c in gen.choices} if tools else {}
            while (u := await gen.next()) is not None:
                c = u.choice
                lp = {"content": self._chat_logprobs(u.logprobs)} if c.params.logprobs is not None else None
                text, delta, finish = u.text, {}, u.finish_reason
                if tools:
                    text = held[c.index].push(u.text)
                    if finish is not None:
                        rest, parsed = held[c.index].finish()
                        text += rest
                        if parsed.calls:
                            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls_json(parsed))]
                            finish = "tool_calls" if finish == "stop" else finish
                if text:
                    delta = {"content": text, **delta}
                if delta or u.logprobs or finish:
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}])
            if include_usage:
                yield chunk([], usage=self._usage(gen))
            yield "data: [DONE]\n\n"
        except OpenAIError as e:
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 (the stream has started: end it with an error event, not a cut)
            logger.exception("unhandled error in a stream")
            yield sse(OpenAIError(500, f"internal server error: {type(e).__name__}").body())
        finally:
            gen.close()

    # ---- /tokenize, /detokenize ---------------------------------------------------------------
    async def flush_cache(self) -> dict:
        """POST /flush_cache: every replica drops the cached KV pages no request holds. 503 naming the
        replicas where requests still hold pages (those stay cached; flush again once they end)."""
        try:
            answers = await asyncio.gather(*(r.flush_cache() for r in self.replicas.replicas))
        except EngineDead as e:
            raise engine_unavailable(str(e)) from None
        held = [f"replica {i}: {a.requests_holding_pages} running requests" for i, a in enumerate(answers)
                if not a.flushed]
        if held:
            raise OpenAIError(503, "the prefix cache was flushed except the pages that running requests hold ("
                              + "; ".join(held) + "); flush again once they end", code="cache_in_use")
        return {"flushed": True}

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise bad_request("the model has no tokenizer", "prompt")
        if req.prompt is not None:
            self._check_text_fits(len(req.prompt), "prompt")
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
            ids = await asyncio.to_thread(self._chat_prompt, chat)
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self.replicas.info.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        vocab = self.replicas.info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens: token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        if self.tokenizer is None:
            raise bad_request("the model has no tokenizer", "tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, req.tokens)}

    # ---- shared -------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model {model!r} does not exist (this server serves "
                                   f"{self.model_name!r})", "model", "model_not_found")

    def _start(self, req: SamplingRequest, prompts: list[list[int]], prompt_param: str,
               max_tokens: int | None, default_max_tokens: int | None, logprobs: int | None,
               api_names: dict[str, str], arrival: float, prompt_logprobs: int | None = None,
               samples: int | None = None, grammar: dict | None = None) -> Generation:
        """Validates everything, then sends one engine request per (prompt, sample)."""
        if self.drain.started:
            raise shutting_down()
        if self.replicas.dead_reason is not None:
            raise engine_unavailable(self.replicas.dead_reason)
        names = {"max_new_tokens": "max_tokens", **api_names}
        base = self._sampling_params(req, 1 if max_tokens is None else max_tokens, logprobs, names, prompt_logprobs,
                                     grammar)
        choices = []
        for i, ids in enumerate(prompts):
            room = self._check_prompt(ids, prompt_param)
            if max_tokens is None:
                n_new = room if default_max_tokens is None else min(default_max_tokens, room)
            elif max_tokens > room:
                raise bad_request(f"{names['max_new_tokens']}={max_tokens} does not fit: the prompt has {len(ids)} "
                                  f"tokens and the context length is {self.replicas.info.max_model_len}",
                                  names["max_new_tokens"], "context_length_exceeded")
            else:
                n_new = max_tokens
            samples = samples or req.n
            for j in range(samples):
                index = i * samples + j
                # n samples of one request must differ, and stay reproducible under one seed.
                # (masked as the engine masks every seed, so seed 2**63 - 1 with n > 1 stays an int64)
                seed = None if req.seed is None else (req.seed + index) & SEED_MASK
                params = dataclasses.replace(base, max_new_tokens=n_new, seed=seed)
                detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                               req.include_stop_str_in_output)
                choices.append(Choice(index, f"{uuid.uuid4().hex[:16]}-{index}", i, ids, params, detok, arrival))
        if self.max_queued_requests is not None and len(choices) > self.max_queued_requests:
            # Retrying could never help: a 400 naming what makes the request too big.
            raise bad_request(f"{'n' if samples > 1 else prompt_param}: the request makes {len(choices)} engine "
                              f"requests (prompts x n), more than the queue ever holds ({self.max_queued_requests})",
                              "n" if samples > 1 else prompt_param)
        if self.max_queued_requests is not None and self.replicas.num_queued + len(choices) > self.max_queued_requests:
            raise OpenAIError(503, f"the server's request queue is full ({self.replicas.num_queued} waiting, "
                                   f"limit {self.max_queued_requests}); retry later",
                              code="queue_full", headers={"Retry-After": "1"})
        gen = Generation(self.replicas, self.metrics, prompts, choices, prompt_param,
                         on_close=self.drain.active.discard)
        gen.start()
        self.drain.active.add(gen)
        return gen

    async def _grammar(self, req: SamplingRequest, extra: tuple[str, dict] | None = None) -> dict:
        """The request's structured-output constraint as SamplingParams keywords ({} for none), compiled
        once here so that a bad grammar is a 400 naming its field (server/structured.py)."""
        found = requested_grammar(req, extra)
        if found is None:
            return {}
        field, kwargs = found
        try:
            params = SamplingParams(**kwargs)
        except ValueError as e:
            raise bad_request(f"{field}: {str(e).split(': ', 1)[-1]}", field) from None
        if self._grammar_check is None:
            self._grammar_check = GrammarCheck(self.tokenizer, self.replicas.info.vocab_size)
        await self._grammar_check.check(field, params)
        return kwargs

    def _sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                         names: dict[str, str], prompt_logprobs: int | None = None,
                         grammar: dict | None = None) -> SamplingParams:
        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias: keys must be token ids (integers as strings)", "logit_bias") from None
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens, min_tokens=req.min_tokens, logit_bias=bias, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, seed=req.seed, repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens, **(grammar or {}))
            params.validate(self.replicas.info.vocab_size)  # token ids (stop_token_ids, logit_bias) too
            return params
        except ValueError as e:
            raise from_sampling_params_error(e, names) from None

    def _check_text_fits(self, num_chars: int, param: str) -> None:
        """A 400 before tokenising for text that cannot fit the context: no token decodes to more
        characters than the vocabulary's longest entry, so a text longer than (context length x that
        length), with a margin of 2 for normalisation, has more tokens than fit."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_chars = max((len(t) for t in vocab), default=0) or 1 << 20
        limit = 2 * self.replicas.info.max_model_len * self._max_token_chars
        if num_chars > limit:
            raise bad_request(f"{param}: {num_chars} characters cannot fit the model's context length of "
                              f"{self.replicas.info.max_model_len} tokens (at most {limit} characters are "
                              "tokenised)", param, "context_length_exceeded")

    def _check_prompt(self, ids: list[int], param: str) -> int:
        """Room left for new tokens; 400 if the prompt is empty, too long or has bad token ids."""
        info = self.replicas.info
        if not ids:
            raise bad_request(f"{param}: the prompt is empty", param)
        if len(ids) >= info.max_model_len:
            raise bad_request(f"{param}: the prompt has {len(ids)} tokens, but the model's context length is "
                              f"{info.max_model_len} (the prompt plus at least one new token must fit)",
                              param, "context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise bad_request(f"{param}: token ids out of range [0, {info.vocab_size}): {bad[:5]}", param)
        return info.max_model_len - len(ids)

    async def _run_to_end(self, gen: Generation, http: Request) -> bool:
        """Runs the generation to its end; False (and the engine requests aborted) if the client
        disconnects first."""
        async def consume():
            while await gen.next() is not None:
                pass

        consumer = asyncio.create_task(consume())
        watcher = asyncio.create_task(_wait_disconnect(http))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer.done():
                consumer.result()  # raises the request's error, if any
                return True
            return False
        finally:
            consumer.cancel()
            watcher.cancel()
            gen.close()

    def _usage(self, gen: Generation) -> dict:
        prompt_tokens = sum(len(p) for p in gen.prompts)  # once per prompt, whatever n is
        completion_tokens = sum(len(c.token_ids) for c in gen.choices if not c.output_hidden)
        # Per prompt, the most any of its samples found in the prefix cache (OpenAI's field).
        cached = {}
        for c in gen.choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.num_cached_tokens)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
        if self.speculative:
            lengths = [n for c in gen.choices for n in c.accept_lengths]
            usage["mean_accept_length"] = sum(lengths) / len(lengths) if lengths else None
            usage["spec_verify_steps"] = len(lengths)
        return usage

    def _shown_len(self, token_id: int) -> int:
        """Characters the token adds to decoded text (0 for special tokens such as BOS, which the echoed
        prompt text does not show): what text_offset advances by."""
        n = self._shown_lens.get(token_id)
        if n is None:
            n = len(self.tokenizer.decode([token_id], skip_special_tokens=True)) if self.tokenizer is not None else 0
            self._shown_lens[token_id] = n
        return n

    def _token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
            self._token_strs[token_id] = s
        return s

    def _completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict:
        tokens, offsets = [], []
        for lp in lps:
            s = self._token_str(lp.token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps],
                "top_logprobs": [{self._token_str(t): _finite(v) for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> list[dict]:
        def entry(token_id: int, logprob: float) -> dict:
            s = self._token_str(token_id)
            return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode())}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR

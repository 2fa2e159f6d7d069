"""CPU-only scheduler: a token budget over `num_computed_tokens` (vLLM V1 style).

There are no prefill and decode phases in the logic. A running request needs
`num_tokens - num_computed_tokens` more tokens fed: the rest of its prompt (a
prefill, chunked when the budget runs short) or 1 (a decode). One step feeds at
most `max_num_batched_tokens` tokens in total. When KV pages run out, the most
recently admitted request is retracted and later recomputed from scratch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from tandem.config import SchedulerConfig
from tandem.request import FinishReason, Request, RequestStatus
from tandem.scheduler.outputs import ScheduledChunk, SchedulerOutput, SchedulerUpdate
from tandem.scheduler.page_allocator import PageAllocator


class Scheduler:
    def __init__(self, config: SchedulerConfig, page_size: int, num_pages: int,
                 num_lookahead_tokens: int = 0) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {page_size})")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0 (got {num_lookahead_tokens})")
        self.config = config
        self.page_size = page_size
        # KV slots reserved past the end of a sampling chunk, for speculative draft tokens.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.allocator = PageAllocator(num_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last one is retracted first
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._awaiting_sample: set[str] = set()  # scheduled with sample=True, tokens not back yet
        self._finished_ids: list[str] = []  # reported (then cleared) by the next schedule()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        """The request if it is still waiting or running, else None."""
        return self._requests.get(request_id)

    # ---- intake and removal --------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        prompt_len = len(req.prompt_token_ids)
        max_len = self.config.max_model_len
        if prompt_len == 0:
            raise ValueError(f"request {req.request_id!r}: the prompt is empty")
        if prompt_len >= max_len:
            raise ValueError(f"request {req.request_id!r}: the prompt has {prompt_len} tokens, but max_model_len "
                             f"is {max_len} (prompt + output); the prompt must be shorter than that")
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} is already scheduled")
        if req.status is not RequestStatus.WAITING or req.page_ids or req.num_computed_tokens:
            raise ValueError(f"request {req.request_id!r} is not a fresh waiting request")
        # A request that cannot fit the whole pool alone would be retracted forever: refuse it now.
        # Its last token is sampled but never fed, hence the -1.
        longest = min(max_len, prompt_len + req.sampling_params.max_new_tokens) - 1
        need = self._pages_for(longest + self.num_lookahead_tokens)
        if need > self.allocator.num_total:
            raise ValueError(f"request {req.request_id!r} may need {need} KV pages but the pool has only "
                             f"{self.allocator.num_total}; lower max_new_tokens or max_model_len")
        self._requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a waiting or running request (stop string, abort). None if unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._finish(req, reason)
        return req

    def abort(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, FinishReason.ABORT)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        budget = self._schedule_running(chunks, preempted, self.config.max_num_batched_tokens)
        # After a retraction pages are short: new work would only be retracted again.
        if not preempted:
            self._schedule_waiting(chunks, budget)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(chunks=tuple(chunks), preempted_ids=tuple(preempted), finished_ids=finished)

    def _schedule_running(self, chunks: list[ScheduledChunk], preempted: list[str], budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n == 0:  # its sampled token has not come back through update() yet
                i += 1
                continue
            # Retract from the back until this request fits. Everything behind index i is
            # unscheduled this step, so no chunk already emitted loses its pages.
            while not self._allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget  # it was the last running request
            chunks.append(self._commit(req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, chunks: list[ScheduledChunk], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens, budget)  # a waiting request has nothing computed
            if not self._allocate(req, n):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._commit(req, n))
            budget -= n

    def _allocate(self, req: Request, n: int) -> bool:
        """Grow the request's pages to hold n more tokens (and the lookahead when it samples)."""
        end = req.num_computed_tokens + n
        if end == req.num_tokens:
            end += self.num_lookahead_tokens
        need = self._pages_for(end) - len(req.page_ids)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        req.page_ids.extend(self.allocator.allocate(need))
        return True

    def _commit(self, req: Request, n: int) -> ScheduledChunk:
        # Counted as computed now (not after the step) so that the next schedule() moves on.
        start = req.num_computed_tokens
        req.num_computed_tokens = start + n
        sample = req.num_computed_tokens == req.num_tokens
        if sample:
            self._awaiting_sample.add(req.request_id)
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=_token_slice(req, start, start + n),
            start_pos=start,
            page_ids=tuple(req.page_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            sample=sample,
        )

    def _preempt(self, req: Request) -> None:
        """Retract by recompute: drop its KV; it rejoins at the front with prompt+outputs as its prompt."""
        self._free_pages(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self._awaiting_sample.discard(req.request_id)
        self.waiting.appendleft(req)

    # ---- results -------------------------------------------------------------------------

    def update(self, sampled: Mapping[str, Sequence[int]]) -> SchedulerUpdate:
        """Append the tokens sampled for the chunks that had sample=True.

        Each list may hold several tokens (a speculative run: accepted drafts + bonus token);
        all but the last were fed to the model in this step, so they count as computed.
        Tokens for requests that finished or were aborted meanwhile are dropped.
        """
        live = {rid: toks for rid, toks in sampled.items()
                if rid in self._requests and self._requests[rid].status is RequestStatus.RUNNING}
        self._check_sampled(live)
        result = SchedulerUpdate()
        for rid, token_ids in live.items():
            req = self._requests[rid]
            self._awaiting_sample.discard(rid)
            appended, reason = self._append(req, token_ids)
            result.new_token_ids[rid] = appended
            if reason is not None:
                self._finish(req, reason)
                result.finished.append(req)
        return result

    def _check_sampled(self, live: Mapping[str, Sequence[int]]) -> None:
        # Checked before any change so that a bad call leaves the scheduler as it was.
        for rid, token_ids in live.items():
            if rid not in self._awaiting_sample:
                raise ValueError(f"request {rid!r} got tokens but its last chunk did not sample")
            if not 1 <= len(token_ids) <= 1 + self.num_lookahead_tokens:
                raise ValueError(f"request {rid!r} got {len(token_ids)} tokens; between 1 and "
                                 f"1 + num_lookahead_tokens ({1 + self.num_lookahead_tokens}) are allowed")
        missing = self._awaiting_sample - live.keys()
        if missing:
            raise ValueError(f"update() has no tokens for sampling requests {sorted(missing)}")

    def _append(self, req: Request, token_ids: Sequence[int]) -> tuple[list[int], FinishReason | None]:
        """Append tokens up to and including the first one that stops the request."""
        appended: list[int] = []
        reason = None
        for tok in token_ids:
            req.output_token_ids.append(tok)
            appended.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                break
        req.num_computed_tokens += len(appended) - 1
        return appended, reason

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        params = req.sampling_params
        # Like vLLM, the EOS / stop token stays in output_token_ids; the detokenizer may hide it.
        if tok in params.stop_token_ids or (not params.ignore_eos and tok in req.eos_token_ids):
            return FinishReason.STOP
        if len(req.output_token_ids) >= params.max_new_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._free_pages(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.request_id]
        self._awaiting_sample.discard(req.request_id)
        self._finished_ids.append(req.request_id)

    def _free_pages(self, req: Request) -> None:
        self.allocator.free(req.page_ids)
        req.page_ids = []

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


def _token_slice(req: Request, start: int, end: int) -> tuple[int, ...]:
    """all_token_ids[start:end] without building the whole prompt+output list every step."""
    prompt, outputs = req.prompt_token_ids, req.output_token_ids
    p = len(prompt)
    head = prompt[start:end] if start < p else []
    tail = outputs[max(start - p, 0):end - p] if end > p else []
    return tuple(head) + tuple(tail)

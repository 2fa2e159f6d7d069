"""CPU-only scheduler: a token budget over `num_computed_tokens` (vLLM V1 style).

There are no prefill and decode phases in the logic. A running request needs
`num_tokens - num_computed_tokens` more tokens fed: the rest of its prompt (a
prefill, chunked when the budget runs short) or 1 (a decode). One step feeds at
most `max_num_batched_tokens` tokens in total. When KV pages run out, the most
recently admitted request is retracted and later recomputed from scratch.

With prefix caching, a request is admitted with `num_computed_tokens` at the longest page-aligned prefix
whose KV the cache holds (scheduler/prefix_cache.py), and each of its full pages is indexed once the
engine reports its KV computed (`update`), never when it is merely scheduled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from tandem.config import SchedulerConfig
from tandem.request import FinishReason, Request, RequestStatus
from tandem.scheduler.outputs import NO_DRAFT_KV, ScheduledChunk, SchedulerOutput, SchedulerUpdate
from tandem.scheduler.prefix_cache import PrefixCache, PrefixCacheStats, page_hash


class Scheduler:
    def __init__(self, config: SchedulerConfig, page_size: int, num_pages: int,
                 num_lookahead_tokens: int = 0, async_decode: bool = False, prefix_caching: bool = False,
                 draft_model: bool = False, draftless_hits: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {page_size})")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0 (got {num_lookahead_tokens})")
        self.config = config
        self.page_size = page_size
        # KV slots reserved past the end of a sampling chunk, for speculative draft tokens.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.allocator = PrefixCache(num_pages)
        # Off, the pool behaves as a plain free list: nothing is indexed, so nothing is cached.
        self.prefix_caching = prefix_caching
        # A draft model writes KV at the same pages, and its entry at a page's last position depends on
        # the token after the page (`_cached_prefix`).
        self.draft_model = draft_model
        # Whether a request may start from cached pages without its draft KV, and then run without draft
        # state (the adaptive policy's dormant requests: their pages hold none).
        self.draftless_hits = draftless_hits
        self.prefix_stats = PrefixCacheStats()
        self._page_keys: dict[str, list[bytes]] = {}  # per request: content keys of its full pages, as needed
        self._num_indexed: dict[str, int] = {}  # per running request: its leading pages that are indexed
        self._cached_len: dict[str, int] = {}  # per running request: what its admission took from the cache
        self._draftless: set[str] = set()  # running requests whose hit holds no draft KV for them
        # per running request: (iteration, end) of its known-token chunks whose step is not processed yet
        self._unconfirmed: dict[str, list[tuple[int, int]]] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last one is retracted first
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        # Overlap mode: a decoding request may be scheduled again before its last step's tokens are
        # back ("future" chunk: its input token and length live on the device). One step in flight
        # at most, so pages are reserved for one worst-case run (num_lookahead_tokens) plus this step.
        self.async_decode = async_decode
        self._iteration = 0
        # request id -> [(iteration, is_future)] of sampling chunks whose tokens are not back yet
        self._outstanding: dict[str, list[tuple[int, bool]]] = {}
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

    def flush_cache(self) -> bool:
        """Drops every cached page no request holds. True when every page is free afterwards (False
        while requests hold pages)."""
        return self.allocator.flush()

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        if self.config.prefill_first and self._head_can_join():
            # Prompts only: the running requests' decodes (and prompt continuations) wait one step. With
            # speculation a decode row in a prompt step costs a pass of its own over the weights (the
            # verify graph beside the prompt forward: 5 ms a step at batch 32, 8B shape, H200), where
            # plain decoding folds it into the prompt forward. Each such step admits at least the head
            # of the queue, so decodes wait at most one step per admission step, and not at all once the
            # running batch is full or the queue empty.
            self._schedule_waiting(chunks, self.config.max_num_batched_tokens)
        else:
            budget = self._schedule_running(chunks, preempted, self.config.max_num_batched_tokens)
            # After a retraction pages are short: new work would only be retracted again.
            if not preempted:
                self._schedule_waiting(chunks, budget)
        finished, self._finished_ids = tuple(self._finished_ids), []
        room = max(0, self.config.max_num_seqs - len(self.running))
        out = SchedulerOutput(chunks=tuple(chunks), preempted_ids=tuple(preempted), finished_ids=finished,
                              iteration=self._iteration, batch_ahead=len(self.running) + min(room, len(self.waiting)))
        self._iteration += 1
        return out

    def _schedule_running(self, chunks: list[ScheduledChunk], preempted: list[str], budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = self._outstanding.get(req.request_id, [])
            if pending:
                if not self._can_schedule_future(req, pending):
                    i += 1  # its sampled tokens have not come back through update() yet
                    continue
                if not self._allocate(req, 1, in_flight=len(pending)):
                    # Scheduling ahead reserves a worst case; when those pages are not free the
                    # request waits one step for its results instead of retracting others (or,
                    # near the pool's size, itself, over and over).
                    i += 1
                    continue
                future = True
                n = 1
            else:
                future = False
                n = min(req.num_tokens - req.num_computed_tokens, budget)
            # Retract from the back until this request fits. Everything behind index i is
            # unscheduled this step, so no chunk already emitted loses its pages.
            while not self._allocate(req, n, in_flight=len(pending)):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget  # it was the last running request
            chunks.append(self._commit_future(req) if future else self._commit(req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, chunks: list[ScheduledChunk], budget: int) -> None:
        computing = self._pages_in_progress()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            (hit, draftless), n, need = self._admission(req, budget)
            if self._waits_for_pages(req, hit, computing):
                i += 1  # a running request is computing its next page: it starts from that page's KV later
                continue
            if not self.allocator.can_allocate(need + self.allocator.num_unheld(hit)):
                break  # first come, first served: nobody overtakes the head of the queue
            del self.waiting[i]
            self._admit(req, hit, draftless)
            req.page_ids.extend(self.allocator.allocate(need))
            chunks.append(self._commit(req, n))
            budget -= n
            computing |= self._unindexed_keys(req)

    def _head_can_join(self) -> bool:
        """Whether `_schedule_waiting` would admit a waiting request now (room, and pages for its first
        chunk): the first one that does not wait for pages in progress."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        computing = self._pages_in_progress()
        for req in self.waiting:
            (hit, _), _, need = self._admission(req, self.config.max_num_batched_tokens)
            if not self._waits_for_pages(req, hit, computing):
                # Holding the hit takes its unheld pages out of what allocation may evict.
                return self.allocator.can_allocate(need + self.allocator.num_unheld(hit))
        return False

    # In-step sharing: requests that arrive together with one prompt (the `n` samples of a request, a
    # batch of calls with one system prompt) would each compute its pages, since a page is indexed only
    # once its step is processed. A waiting request whose next page to compute is a page a running
    # request is computing waits for it instead (SGLang's scheduler deprioritises such requests too), and
    # other waiting requests go ahead of it meanwhile. It waits at most until that request's step is
    # processed, or ends, or is retracted: then the page is indexed or no longer in progress.

    def _pages_in_progress(self) -> set[bytes]:
        """Content keys of the full pages of known tokens that running requests have not indexed yet."""
        if not self.prefix_caching or not self.waiting:
            return set()
        keys: set[bytes] = set()
        for req in self.running:
            keys |= self._unindexed_keys(req)
        return keys

    def _unindexed_keys(self, req: Request) -> set[bytes]:
        if not self.prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return set()
        done = self._num_indexed.get(req.request_id, 0)
        return set(self._keys(req, req.num_tokens // self.page_size)[done:])

    def _waits_for_pages(self, req: Request, hit: list[int], computing: set[bytes]) -> bool:
        if not computing or req.sampling_params.prompt_logprobs is not None:
            return False
        nxt = len(hit)  # the first page it would compute; a later hit must leave a token to compute
        if nxt >= (req.num_tokens - 1) // self.page_size:
            return False
        return self._keys(req, nxt + 1)[nxt] in computing

    def _admission(self, req: Request, budget: int) -> tuple[tuple[list[int], bool], int, int]:
        """For a waiting request: the cached pages it starts from (and whether they lack its draft KV), the
        tokens of its first chunk, and the fresh pages that chunk needs."""
        hit, draftless = self._cached_prefix(req)
        start = len(hit) * self.page_size
        n = min(req.num_tokens - start, budget)
        end = start + n + (self.num_lookahead_tokens if start + n >= req.num_tokens else 0)
        return (hit, draftless), n, max(0, self._pages_for(end) - len(hit))

    def _cached_prefix(self, req: Request) -> tuple[list[int], bool]:
        """The cached pages holding the longest page-aligned prefix of the request's tokens that it may
        start from, and whether it must then run without draft state (the pages lack its draft KV)."""
        if not self.prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return [], False  # prompt logprobs need every prompt position's logits: the whole prompt runs
        # At least one token is computed: its logits give the next token. (With a draft, that also leaves
        # the token after each matched page known.)
        keys = self._keys(req, (req.num_tokens - 1) // self.page_size)
        pages, with_draft = self.allocator.match(keys, req.all_token_ids, self.page_size)
        if not self.draft_model or with_draft == len(pages):
            return pages, False
        # EAGLE's draft KV at position t pairs token t+1 with the target's features at t, so a page's last
        # draft entry was made with the next token of the request that computed it, and some pages hold no
        # draft KV at all (dormant requests'). A drafting request may reuse only pages whose draft KV is its
        # own (docs/architecture.md, prefix caching). Past them, a longer run of pages serves the target
        # alone, when the engine lets the request run dormant; one page short is recomputed instead (a
        # prompt that parts from a cached one right at a page boundary should keep its draft).
        if self.draftless_hits and len(pages) - with_draft >= 2:
            return pages, True
        return pages[:with_draft], False

    def _keys(self, req: Request, num_pages: int) -> list[bytes]:
        """Content keys of the request's first `num_pages` full pages (kept: its known tokens never change)."""
        keys = self._page_keys.setdefault(req.request_id, [])
        while len(keys) < num_pages:
            keys.append(page_hash(keys[-1] if keys else None, self._content(req, len(keys))))
        return keys[:num_pages]

    def _content(self, req: Request, i: int) -> tuple[int, ...]:
        ps = self.page_size
        return _token_slice(req, i * ps, (i + 1) * ps)

    def _admit(self, req: Request, hit: list[int], draftless: bool = False) -> None:
        self.allocator.hold(hit)
        cached = len(hit) * self.page_size
        req.page_ids = list(hit)
        req.num_computed_tokens = cached
        rid = req.request_id
        self._cached_len[rid] = cached
        self._num_indexed[rid] = len(hit)
        if draftless:
            self._draftless.add(rid)
        if req.num_preemptions == 0:  # (a recompute's hit is the engine's own business, not the client's)
            req.num_cached_tokens = cached
            if self.prefix_caching:
                self.prefix_stats.queries += len(req.prompt_token_ids)
                self.prefix_stats.hits += cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _can_schedule_future(self, req: Request, pending: list) -> bool:
        return self.async_decode and len(pending) == 1

    def _pages_needed(self, req: Request, n: int, in_flight: int = 0) -> int:
        """Pages the request lacks to hold n more tokens (and the lookahead when it samples), plus a
        worst-case run of tokens for each step still in flight; <= 0 when it has enough."""
        end = req.num_computed_tokens + n
        if in_flight:
            end = req.num_tokens + in_flight * self.num_lookahead_tokens
        if end >= req.num_tokens:
            end += self.num_lookahead_tokens
        return self._pages_for(end) - len(req.page_ids)

    def _allocate(self, req: Request, n: int, in_flight: int = 0) -> bool:
        """Grow the request's pages as `_pages_needed` says; False (nothing allocated) if they are short."""
        need = self._pages_needed(req, n, in_flight)
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
        if self.prefix_caching:
            self._unconfirmed.setdefault(req.request_id, []).append((self._iteration, start + n))
        sample = req.num_computed_tokens == req.num_tokens
        if sample:
            self._outstanding.setdefault(req.request_id, []).append((self._iteration, False))
        return self._chunk(req, _token_slice(req, start, start + n), start, sample, future=False)

    def _commit_future(self, req: Request) -> ScheduledChunk:
        """A decode whose input token and length are the device-side results of the step in flight."""
        self._outstanding[req.request_id].append((self._iteration, True))
        return self._chunk(req, (), req.num_computed_tokens, True, future=True)

    def _chunk(self, req: Request, token_ids: tuple, start: int, sample: bool, future: bool) -> ScheduledChunk:
        cached = self._cached_len.get(req.request_id, 0)
        first = start == cached and not future
        params = req.sampling_params
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            page_ids=tuple(req.page_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            sample=sample,
            is_future=future,
            seed=req.sampling_seed,
            request_len=req.num_tokens,
            next_token=_next_prompt_token(req, start + len(token_ids)) if not future else -1,
            suppress_ids=_min_tokens_suppressed(req) if first else (),
            cached_len=cached,
            draftless=first and req.request_id in self._draftless,
            cached_token_ids=(_token_slice(req, 0, cached) if first and cached and (
                params.needs_penalties or params.constrained) else ()),
        )

    def _preempt(self, req: Request) -> None:
        """Retract by recompute: drop its KV; it rejoins at the front with prompt+outputs as its prompt."""
        self._free_pages(req)  # (its indexed pages stay cached: the recompute may start from them)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self._outstanding.pop(req.request_id, None)
        self._drop_admission(req.request_id)
        self.waiting.appendleft(req)

    # ---- results -------------------------------------------------------------------------

    def update(self, sampled: Mapping[str, Sequence[int]], iteration: int | None = None,
               draft_behind: Mapping[str, int] | None = None) -> SchedulerUpdate:
        """Append the tokens sampled in one scheduled iteration (the oldest one not yet updated).

        Each list may hold several tokens (a speculative run: accepted drafts + bonus token);
        all but the last were fed to the model in that step, so they count as computed (for a
        future chunk, whose input token was not counted when scheduled, all of them do).
        Tokens for requests that finished, were aborted or were retracted meanwhile are dropped.

        The step's KV is computed now, so its requests' full pages are indexed for the prefix cache.
        `draft_behind` (speculation): per request of the step, how many of its computed tokens still lack
        draft KV (NO_DRAFT_KV: it keeps none; its pages are indexed for the target alone).
        """
        if iteration is None:
            iteration = min((p[0][0] for p in self._outstanding.values() if p), default=self._iteration - 1)
        live = {rid: toks for rid, toks in sampled.items()
                if rid in self._requests and self._requests[rid].status is RequestStatus.RUNNING}
        self._check_sampled(live, iteration)
        confirmed = self._confirmed_chunks(iteration)
        result = SchedulerUpdate()
        for rid, token_ids in live.items():
            req = self._requests[rid]
            _, future = self._outstanding[rid].pop(0)
            if not self._outstanding[rid]:
                del self._outstanding[rid]
            appended, reason = self._append(req, token_ids, future)
            result.new_token_ids[rid] = appended
            # (Nothing after a sampling chunk but future chunks, which count nothing until processed.)
            confirmed.pop(rid, None)
            self._index(req, req.num_computed_tokens, draft_behind)  # before finishing frees its pages
            if reason is not None:
                self._finish(req, reason)
                result.finished.append(req)
            elif future or self.async_decode:
                self._release_reservation(req)
        for rid, end in confirmed.items():
            self._index(self._requests[rid], end, draft_behind)
        return result

    def _confirmed_chunks(self, iteration: int) -> dict[str, int]:
        """Per running request, the end of its chunks in steps up to `iteration` (now processed)."""
        confirmed = {}
        for rid, pending in list(self._unconfirmed.items()):
            done = [end for it, end in pending if it <= iteration]
            if done:
                confirmed[rid] = max(done)
                pending[:] = [(it, end) for it, end in pending if it > iteration]
                if not pending:
                    del self._unconfirmed[rid]
        return confirmed

    def _index(self, req: Request, computed: int, draft_behind: Mapping[str, int] | None) -> None:
        """Indexes the request's full pages within its first `computed` tokens, whose KV the step just
        processed holds (with a draft, only once the draft's is written too)."""
        if not self.prefix_caching:
            return
        # With a draft, a page is indexed with the token after it once its draft entries are written too
        # (that token is known then), or without one (for the target alone) if the request keeps no draft KV.
        has_draft = self.draft_model and draft_behind is not None
        behind = draft_behind.get(req.request_id, NO_DRAFT_KV) if has_draft else 0
        if behind == NO_DRAFT_KV:
            has_draft, behind = False, 0
        rid, ps = req.request_id, self.page_size
        full = min((computed - behind) // ps, len(req.page_ids), (req.num_tokens - int(has_draft)) // ps)
        done = self._num_indexed.get(rid, 0)
        if full <= done:
            return
        keys = self._keys(req, full)
        tokens = req.all_token_ids
        for i in range(done, full):
            # A page whose content another page already holds stays private (False): nothing to do.
            nxt = tokens[(i + 1) * ps] if has_draft else None
            self.allocator.insert(req.page_ids[i], keys[i], self._content(req, i), nxt)
        self._num_indexed[rid] = full

    def _release_reservation(self, req: Request) -> None:
        """Now that the real length is known, free pages reserved for a longer worst case."""
        keep = self._pages_for(req.num_tokens + self.num_lookahead_tokens
                               + len(self._outstanding.get(req.request_id, [])) * self.num_lookahead_tokens)
        if len(req.page_ids) > keep:
            self.allocator.free(req.page_ids[keep:])
            del req.page_ids[keep:]

    def _check_sampled(self, live: Mapping[str, Sequence[int]], iteration: int) -> None:
        # Checked before any change so that a bad call leaves the scheduler as it was.
        for rid, token_ids in live.items():
            pending = self._outstanding.get(rid)
            if not pending or pending[0][0] != iteration:
                raise ValueError(f"request {rid!r} got tokens but its chunk in iteration {iteration} did not sample")
            if not 1 <= len(token_ids) <= 1 + self.num_lookahead_tokens:
                raise ValueError(f"request {rid!r} got {len(token_ids)} tokens; between 1 and "
                                 f"1 + num_lookahead_tokens ({1 + self.num_lookahead_tokens}) are allowed")
        missing = {rid for rid, p in self._outstanding.items() if p and p[0][0] == iteration} - live.keys()
        if missing:
            raise ValueError(f"update() has no tokens for sampling requests {sorted(missing)}")

    def _append(self, req: Request, token_ids: Sequence[int], future: bool = False) -> tuple[list[int], FinishReason | None]:
        """Append tokens up to and including the first one that stops the request."""
        appended: list[int] = []
        reason = None
        for tok in token_ids:
            req.output_token_ids.append(tok)
            appended.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                break
        req.num_computed_tokens += len(appended) - (0 if future else 1)
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
        self._outstanding.pop(req.request_id, None)
        self._drop_admission(req.request_id)
        self._page_keys.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    def _drop_admission(self, rid: str) -> None:
        """Forgets what the request's admission knew: a page of a step still in flight is never indexed."""
        self._unconfirmed.pop(rid, None)
        self._num_indexed.pop(rid, None)
        self._cached_len.pop(rid, None)
        self._draftless.discard(rid)

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


def _next_prompt_token(req: Request, end: int) -> int:
    """The prompt token at position `end`, for requests that want prompt logprobs (else -1)."""
    if req.sampling_params.prompt_logprobs is None or end >= len(req.prompt_token_ids):
        return -1
    return req.prompt_token_ids[end]


def _min_tokens_suppressed(req: Request) -> tuple[int, ...]:
    """The tokens that would end the request, which min_tokens keeps out of its first outputs."""
    params = req.sampling_params
    if params.min_tokens <= 0:
        return ()
    ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(req.eos_token_ids))
    return tuple(sorted(ids))

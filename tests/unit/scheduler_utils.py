"""Helpers to drive the scheduler without a model (like vLLM's tests/v1/core/utils.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from tandem.config import SchedulerConfig
from tandem.request import Request, SamplingParams
from tandem.scheduler import NO_DRAFT_KV, Scheduler, SchedulerOutput, SchedulerUpdate


def create_scheduler(max_num_batched_tokens: int = 64, max_num_seqs: int = 16, max_model_len: int = 256,
                     page_size: int = 4, num_pages: int = 1000, num_lookahead_tokens: int = 0,
                     prefill_first: bool = False, prefix_caching: bool = False, draft_model: bool = False,
                     async_decode: bool = False, draftless_hits: bool = False) -> Scheduler:
    """A scheduler over a fake, tiny KV pool (page ids only; nothing is allocated)."""
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, prefill_first=prefill_first)
    return Scheduler(config, page_size=page_size, num_pages=num_pages, num_lookahead_tokens=num_lookahead_tokens,
                     prefix_caching=prefix_caching, draft_model=draft_model, async_decode=async_decode,
                     draftless_hits=draftless_hits)


def create_request(request_id: str | int, prompt_len: int = 8, max_new_tokens: int = 4, *,
                   prompt: list[int] | None = None, eos: tuple[int, ...] = (), **sampling) -> Request:
    prompt = list(prompt) if prompt is not None else [(7 * i + len(str(request_id))) % 1000 + 1
                                                      for i in range(prompt_len)]
    return Request(request_id=str(request_id), prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_new_tokens=max_new_tokens, **sampling),
                   eos_token_ids=frozenset(eos))


class FakeModel:
    """Plays the model runner: keeps the tokens it was fed per request (its "KV cache")
    and samples a token that depends on all of them, so feeding a wrong or missing token
    after a chunk split or a recompute changes the output.

    It also checks the runner-side contract: chunks arrive contiguously, pages cover them.
    """

    def __init__(self, page_size: int, num_lookahead_tokens: int = 0,
                 script: dict[str, list[list[int]]] | None = None,
                 run_length: Callable[[], int] | None = None) -> None:
        self.page_size = page_size
        self.num_lookahead_tokens = num_lookahead_tokens
        self.fed: dict[str, list[int]] = {}
        # Optional per-request list of runs to return instead of the formula (one run per sample).
        self.script = {k: list(v) for k, v in (script or {}).items()}
        # Speculative mode: each sample returns a run of run_length() tokens, as if that many
        # drafts were accepted; like a verify pass, the KV of all but the last is written now.
        self.run_length = run_length

    @staticmethod
    def next_token(tokens: list[int]) -> int:
        return (sum(tokens) * 31 + 7) % 1000

    def __call__(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for rid in out.preempted_ids + out.finished_ids:
            self.fed.pop(rid, None)  # drop "KV": a retracted request is fed again from position 0
        sampled = {}
        for c in out.chunks:
            fed = self.fed.setdefault(c.request_id, [])
            assert c.start_pos == len(fed), f"{c.request_id}: chunk starts at {c.start_pos}, model has {len(fed)}"
            fed.extend(c.token_ids)
            reserved = c.num_tokens + (self.num_lookahead_tokens if c.sample else 0)
            assert len(c.page_ids) * self.page_size >= c.start_pos + reserved, "pages do not cover the chunk"
            if c.sample:
                run = self.script[c.request_id].pop(0) if c.request_id in self.script else self._generate(fed)
                assert 1 <= len(run) <= 1 + self.num_lookahead_tokens
                fed.extend(run[:-1])  # the accepted drafts were fed by the verify pass
                sampled[c.request_id] = run
        return sampled

    def _generate(self, fed: list[int]) -> list[int]:
        run: list[int] = []
        for _ in range(self.run_length() if self.run_length else 1):
            run.append(self.next_token(fed + run))
        return run


def reference_outputs(prompt: list[int], max_new_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
    """What FakeModel generates for one request run alone, one token at a time."""
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        tok = FakeModel.next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if tok in eos:
            break
    return out


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    """What must hold after every schedule()."""
    cfg = sched.config
    assert out.num_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
    assert len(out.chunks) <= cfg.max_num_seqs
    assert sched.num_running <= cfg.max_num_seqs
    ids = [c.request_id for c in out.chunks]
    assert len(ids) == len(set(ids)), "a request was scheduled twice in one step"
    assert not set(ids) & set(out.preempted_ids), "a retracted request was also scheduled"
    assert all(c.num_tokens > 0 for c in out.chunks)

    check_pages(sched)

    for c in out.chunks:
        req = sched.get_request(c.request_id)
        assert req is not None and any(r is req for r in sched.running)
        assert c.end_pos == req.num_computed_tokens
        assert list(c.token_ids) == req.all_token_ids[c.start_pos:c.end_pos]
        assert c.page_ids == tuple(req.page_ids)
        assert c.sample == (c.end_pos == req.num_tokens)
        assert c.num_prompt_tokens == len(req.prompt_token_ids)


def check_pages(sched: Scheduler) -> None:
    """Page accounting: every held page is counted once per holder, shared pages are full and computed
    for each holder, and held + free + cached pages are the whole pool."""
    alloc = sched.allocator
    holders = Counter(p for r in sched.running for p in r.page_ids)
    for r in sched.running:
        assert len(r.page_ids) == len(set(r.page_ids)), f"{r.request_id} holds a page twice"
        for i, p in enumerate(r.page_ids):
            if holders[p] > 1 or alloc.key_of(p) is not None:
                assert (i + 1) * sched.page_size <= r.num_computed_tokens, "a shared page is not full and computed"
    assert all(alloc.refs(p) == n for p, n in holders.items()), "a page's reference count is off"
    assert all(not r.page_ids and r.num_computed_tokens == 0 for r in sched.waiting)
    assert len(holders) == alloc.num_used
    assert len(holders) + alloc.num_free + alloc.num_cached == alloc.num_total, "pages leaked"


class PagedFakeModel:
    """FakeModel over a shared paged "KV cache": each KV slot holds the token fed at its position, and a
    sampled token depends on the tokens read back through the request's page table. A cached page with
    the wrong content, or a shared page written again, changes the outputs or fails an assertion.

    With `draft=True` it also keeps an EAGLE-style draft cache, written as the runner writes it: the draft
    entry at position t holds the token at t+1 (the draft pairs embed(x[t+1]) with the target's features at
    t). `draft_errors` counts entries read back wrong at each sample: what would lower acceptance.
    Requests in `dormant` keep no draft KV (and report NO_DRAFT_KV)."""

    def __init__(self, sched: Scheduler, draft: bool = False, run_length: Callable[[], int] | None = None,
                 dormant: set[str] | None = None) -> None:
        self.sched = sched
        self.page_size = sched.page_size
        self.draft = draft
        self.run_length = run_length
        self.dormant = dormant or set()
        self.kv: dict[int, int] = {}
        self.draft_kv: dict[int, int] = {}
        self.next_pos: dict[str, int] = {}  # per request: the position its next chunk starts at
        self.decoding: set[str] = set()  # requests whose next one-token chunk is a verify step
        self.draft_errors: dict[str, int] = {}
        self.draft_behind: dict[str, int] = {}  # of the last call (Scheduler.update's argument)
        self.first_chunks: list = []

    def _slot(self, c, pos: int) -> int:
        return c.page_ids[pos // self.page_size] * self.page_size + pos % self.page_size

    def _write(self, store: dict[int, int], c, pos: int, token: int) -> None:
        page = c.page_ids[pos // self.page_size]
        alloc = self.sched.allocator
        assert alloc.key_of(page) is None and alloc.refs(page) == 1, f"{c.request_id} writes shared page {page}"
        store[self._slot(c, pos)] = token

    def __call__(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for rid in out.preempted_ids + out.finished_ids:
            self.next_pos.pop(rid, None)
            self.decoding.discard(rid)
        sampled, self.draft_behind = {}, {}
        for c in out.chunks:
            rid, draft = c.request_id, self.draft and c.request_id not in self.dormant
            if c.first_chunk:
                self.first_chunks.append(c)
                if c.draftless:
                    self.dormant.add(rid)  # as the runner does: no draft state for it
                    draft = False
                self.next_pos[rid] = c.start_pos
                self.decoding.discard(rid)
                if c.cached_len:
                    assert all(self.kv[self._slot(c, t)] is not None for t in range(c.cached_len))
            assert c.start_pos == self.next_pos[rid], f"{rid}: chunk at {c.start_pos}, model at {self.next_pos[rid]}"
            verify = rid in self.decoding and c.sample and c.num_tokens == 1
            for i, tok in enumerate(c.token_ids):
                self._write(self.kv, c, c.start_pos + i, tok)
            if draft and not verify:
                # A prefill chunk pairs each token with the features before it: positions start-1 .. end-2
                # (its first chunk skips start-1: x[0] has nothing before it, and after a cache hit that
                # entry is the cached page's own).
                for pos in range(c.start_pos - (0 if c.first_chunk else 1), c.end_pos - 1):
                    self._write(self.draft_kv, c, pos, c.token_ids[pos + 1 - c.start_pos])
            self.next_pos[rid] = c.end_pos
            behind = 1 if draft else 0
            if c.sample:
                seq = [self.kv[self._slot(c, t)] for t in range(c.end_pos)]
                run = [self._next(seq)]
                for _ in range((self.run_length() if self.run_length and verify else 1) - 1):
                    run.append(self._next(seq + run))
                for i, tok in enumerate(run[:-1]):  # the accepted drafts' KV, written by the verify pass
                    self._write(self.kv, c, c.end_pos + i, tok)
                if draft:  # the extend (or the prefill's sampled token): positions end-1 .. end-2+len(run)
                    for i, tok in enumerate(run):
                        self._write(self.draft_kv, c, c.end_pos - 1 + i, tok)
                    full = seq + run
                    wrong = sum(self.draft_kv.get(self._slot(c, t)) != full[t + 1] for t in range(len(full) - 1))
                    self.draft_errors[rid] = self.draft_errors.get(rid, 0) + wrong
                self.next_pos[rid] = c.end_pos + len(run) - 1
                self.decoding.add(rid)
                sampled[rid] = run
                behind = 0
            self.draft_behind[rid] = NO_DRAFT_KV if self.draft and not draft else behind
        return sampled

    @staticmethod
    def _next(tokens: list[int]) -> int:
        return FakeModel.next_token(tokens)

    def step(self):
        out = self.sched.schedule()
        check_invariants(self.sched, out)
        sampled = self(out)
        return out, self.sched.update(sampled, out.iteration, self.draft_behind if self.draft else None)

    def run(self, max_steps: int = 10_000, before_step: Callable[[int], None] | None = None) -> None:
        for i in range(max_steps):
            if before_step is not None:
                before_step(i)
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")


def run_steps(sched: Scheduler, model: Callable[[SchedulerOutput], dict[str, list[int]]],
              max_steps: int = 10_000, before_step: Callable[[int], None] | None = None,
              ) -> tuple[list[SchedulerOutput], list[SchedulerUpdate]]:
    """schedule -> model -> update until nothing is left; invariants checked every step."""
    outs, updates = [], []
    for step in range(max_steps):
        if before_step is not None:
            before_step(step)
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_invariants(sched, out)
        outs.append(out)
        updates.append(sched.update(model(out)))
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    return outs, updates

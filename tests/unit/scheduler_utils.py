"""Helpers to drive the scheduler without a model (like vLLM's tests/v1/core/utils.py)."""

from __future__ import annotations

from collections.abc import Callable

from tandem.config import SchedulerConfig
from tandem.request import Request, SamplingParams
from tandem.scheduler import Scheduler, SchedulerOutput, SchedulerUpdate


def create_scheduler(max_num_batched_tokens: int = 64, max_num_seqs: int = 16, max_model_len: int = 256,
                     page_size: int = 4, num_pages: int = 1000, num_lookahead_tokens: int = 0,
                     prefill_first: bool = False) -> Scheduler:
    """A scheduler over a fake, tiny KV pool (page ids only; nothing is allocated)."""
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, prefill_first=prefill_first)
    return Scheduler(config, page_size=page_size, num_pages=num_pages, num_lookahead_tokens=num_lookahead_tokens)


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

    owned = [p for r in sched.running for p in r.page_ids]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert all(not r.page_ids and r.num_computed_tokens == 0 for r in sched.waiting)
    assert len(owned) + sched.allocator.num_free == sched.allocator.num_total, "pages leaked"

    for c in out.chunks:
        req = sched.get_request(c.request_id)
        assert req is not None and any(r is req for r in sched.running)
        assert c.end_pos == req.num_computed_tokens
        assert list(c.token_ids) == req.all_token_ids[c.start_pos:c.end_pos]
        assert c.page_ids == tuple(req.page_ids)
        assert c.sample == (c.end_pos == req.num_tokens)
        assert c.num_prompt_tokens == len(req.prompt_token_ids)


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

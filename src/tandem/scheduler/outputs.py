"""Typed data that crosses the scheduler's boundary (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.request import Request, SamplingParams

# Scheduler.update's draft_behind for a request that keeps no draft KV (the adaptive policy's dormant
# requests): its pages are not cached in a speculative engine.
NO_DRAFT_KV = -1


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens of one request that the model runs this step."""

    request_id: str
    token_ids: tuple[int, ...]  # all_token_ids[start_pos : start_pos + len(token_ids)]
    start_pos: int  # == request.num_computed_tokens before this step; position of token_ids[0]
    page_ids: tuple[int, ...]  # every page of the request after this step's allocation
    num_prompt_tokens: int  # len(original prompt); tokens after it are outputs (for penalties)
    sampling_params: SamplingParams
    sample: bool  # the chunk reaches the end of the known sequence, so a token is sampled after it
    # Overlap mode: a decode whose input token and start position are still on the device (the
    # results of the step in flight); token_ids is empty and start_pos a lower bound.
    is_future: bool = False
    seed: int = 0  # the request's sampling seed (keys its noise together with each token's position)
    # Tokens (prompt + outputs) the request had when scheduled: on a first chunk, what the runner must
    # count as already produced (a recompute after preemption re-feeds earlier outputs).
    request_len: int = 0
    # The token right after this chunk when it is known (a prompt chunk before the last one), else -1:
    # the prompt-logprob target of the chunk's last position.
    next_token: int = -1
    # min_tokens: the ids the sampler must not draw before then (stop_token_ids, and EOS unless ignored)
    suppress_ids: tuple[int, ...] = ()
    # Tokens at the start of the request whose KV this admission took from the prefix cache: its first
    # chunk starts there (0 without a hit).
    cached_len: int = 0
    # On a first chunk after a hit, for a penalised or grammar-constrained request: the cached tokens
    # [0, cached_len), which its penalty and grammar state must still see.
    cached_token_ids: tuple[int, ...] = ()
    # On a first chunk: the cached pages hold no draft KV for this request, so it runs without draft state.
    draftless: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def first_chunk(self) -> bool:
        """The request's first chunk since admission (fresh, or a recompute after preemption): the runner
        (re)starts its per-request state here. After a prefix-cache hit it does not start at 0."""
        return not self.is_future and self.start_pos == self.cached_len


@dataclass(frozen=True)
class SchedulerOutput:
    """What to run this step, plus the requests whose runner state must be dropped."""

    chunks: tuple[ScheduledChunk, ...]
    # Retracted this step: their KV is gone; they come back later as a fresh prefill.
    preempted_ids: tuple[str, ...] = ()
    # Finished or aborted since the previous schedule().
    finished_ids: tuple[str, ...] = ()
    iteration: int = 0  # pass back to Scheduler.update with this step's tokens
    # The running batch once the waiting requests it has room for are admitted (they join within a few
    # steps: a burst of prompts is prefilled a chunk budget at a time).
    batch_ahead: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to drop: the runner can skip this step entirely."""
        return not self.chunks and not self.preempted_ids and not self.finished_ids


@dataclass
class SchedulerUpdate:
    """What `Scheduler.update` did with the sampled tokens."""

    # Per request: the tokens actually appended (after truncation at a stop condition).
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests that finished in this update (status FINISHED, finish_reason set, pages freed).
    finished: list[Request] = field(default_factory=list)

"""What one step hands back to the engine: each request's new tokens, logprobs and accept lengths."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.request import TokenLogprob


@dataclass
class StepResult:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # request id -> new tokens
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    accept_lengths: dict[str, int] = field(default_factory=dict)  # speculative: tokens per verify step
    spec_max_depth: int = 0
    spec_num_proposed: int = 0  # draft tokens each verify row proposed this step
    # request id -> {index of a prompt token: its logprob} (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[str, dict[int, TokenLogprob]] = field(default_factory=dict)
    # Speculation: per request of the step, how many of its tokens with target KV lack draft KV after it
    # (scheduler.NO_DRAFT_KV: it keeps none). The prefix cache indexes only pages both have written.
    draft_behind: dict[str, int] | None = None


def collect_logprobs(wanted: dict[str, int], request_ids, tokens, lens, chosen, top_v, top_i, result: StepResult
                     ) -> None:
    """Host lists of each request's produced tokens' logprobs. chosen [B, Q]; top_v, top_i [B, Q, n]."""
    chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
    for i, rid in enumerate(request_ids):
        n = wanted.get(rid)
        if n is None:
            continue
        result.logprobs[rid] = [
            TokenLogprob(tokens[i][j], chosen[i][j], list(zip(top_i[i][j][:n], top_v[i][j][:n])) if n else [])
            for j in range(lens[i])
        ]

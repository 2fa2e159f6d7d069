"""Log-probabilities at prompt positions (SamplingParams.prompt_logprobs), from a prefill step's hidden
states: the row of position p predicts prompt token p + 1. Each chunk of a prompt gives the positions
it covers, its last row predicting the next chunk's first token (`ScheduledChunk.next_token`); a
recompute after preemption gives them again (the engine keeps the first). Raw model log-probabilities,
as for output logprobs (layers/sampler.token_logprobs), so the draft never changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.sampler import token_logprobs
from tandem.request import TokenLogprob
from tandem.runtime.uploads import to_device

ROWS_PER_SLICE = 256  # logits of this many rows at a time: [256, vocab] float32, not [prompt, vocab]


@dataclass
class PromptLogprobRows:
    rows: list[int]  # rows of the step's hidden states
    targets: list[int]  # the prompt token each row predicts
    owners: list[tuple[str, int, int]]  # per row: (request id, index of the predicted token, top-n asked)


def rows_for(chunks, first_row: dict[str, int]) -> PromptLogprobRows | None:
    """The rows of this step that predict a prompt token of a request asking for prompt logprobs."""
    out = PromptLogprobRows([], [], [])
    for c in chunks:
        top_n = c.sampling_params.prompt_logprobs
        if top_n is None or c.is_future or c.request_id not in first_row:
            continue
        for t in range(c.start_pos + 1, min(c.end_pos + 1, c.num_prompt_tokens)):
            target = c.token_ids[t - c.start_pos] if t < c.end_pos else c.next_token
            if target < 0:
                continue
            out.rows.append(first_row[c.request_id] + t - 1 - c.start_pos)
            out.targets.append(target)
            out.owners.append((c.request_id, t, top_n))
    return out if out.rows else None


def compute(model, hidden: torch.Tensor, rows: PromptLogprobRows) -> dict[str, torch.Tensor]:
    """Device tensors of the chosen logprob [R] and the top-n [R, n] (n the most any row asked)."""
    top_n = max(n for _, _, n in rows.owners)
    device = hidden.device
    index = to_device(rows.rows, device, torch.long)
    targets = to_device(rows.targets, device, torch.long)
    parts = []
    for i in range(0, len(rows.rows), ROWS_PER_SLICE):
        logits = model.compute_logits(hidden[index[i:i + ROWS_PER_SLICE]])
        parts.append(token_logprobs(logits, targets[i:i + ROWS_PER_SLICE], top_n))
    chosen, top_v, top_i = (torch.cat(t) for t in zip(*parts))
    return {"prompt_logprob": chosen, "prompt_top_v": top_v, "prompt_top_i": top_i}


def collect(rows: PromptLogprobRows, host: dict[str, torch.Tensor]) -> dict[str, dict[int, TokenLogprob]]:
    """Request id -> {index of the prompt token: its TokenLogprob}, from the host copies."""
    chosen, top_v, top_i = (host[k].tolist() for k in ("prompt_logprob", "prompt_top_v", "prompt_top_i"))
    out: dict[str, dict[int, TokenLogprob]] = {}
    for j, ((rid, t, n), target) in enumerate(zip(rows.owners, rows.targets)):
        top = list(zip(top_i[j][:n], top_v[j][:n])) if n else []
        out.setdefault(rid, {})[t] = TokenLogprob(target, chosen[j], top)
    return out

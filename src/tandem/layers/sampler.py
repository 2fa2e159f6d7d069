"""Token sampling: pure functions from logits to chosen tokens.

The pipeline, per row of the batch (`logits_to_probs` is the single place it lives):

    raw logits
      -> penalties      repetition (HF, over prompt + output), frequency / presence (OpenAI, output only)
      -> / temperature
      -> softmax
      -> top-k          -> renormalize
      -> top-p          -> renormalize
      -> min-p          -> renormalize
    = target distribution   (greedy rows: one-hot on the argmax of the penalized logits)

`sample` draws from that distribution with an exponential race, argmax(p / E) with
E ~ Exp(1), which picks token i with probability p_i and needs no GPU->CPU sync
(unlike `torch.multinomial` followed by `.item()`).

Everything works on any device and does its math in float32. Per-row parameters
arrive as Python objects (`SampleRow`) and become small tensors here; which fast
paths apply is decided from those Python values, never from device tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.request import SamplingParams

_SEED_MASK = (1 << 63) - 1
_MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # repetition penalty looks at prompt + output (HF semantics)
    output_token_ids: Sequence[int]  # frequency / presence look at output only (OpenAI); its length is the seed step


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # The three below are None when no row asked for logprobs, and all tensors otherwise.
    logprobs: torch.Tensor | None  # [B] float32, logprob of the chosen token
    top_logprob_ids: torch.Tensor | None  # [B, n] int64, n = max logprobs asked; best first
    top_logprobs: torch.Tensor | None  # [B, n] float32; rows that asked fewer ignore the extra columns


# ---------------------------------------------------------------------------
# Penalties


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties. logits: [B, V]. Never writes into `logits`.

    Repetition (HF `RepetitionPenaltyLogitsProcessor`): each distinct token of prompt + output
    gets logit / p if the logit is positive, logit * p otherwise.
    Frequency / presence (OpenAI): logit -= frequency * count_in_output + presence * (count > 0).
    Returns `logits` itself (float32) when no row needs a penalty.
    """
    logits = logits.float()
    if not any(r.params.needs_penalties for r in rows):
        return logits
    _, vocab = logits.shape
    device = logits.device

    # Token lists only for the rows that use them: prompts can be long.
    rep_ids = [
        [*r.prompt_token_ids, *r.output_token_ids] if r.params.repetition_penalty != 1.0 else [] for r in rows
    ]
    freq_ids = [
        r.output_token_ids if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 else []
        for r in rows
    ]

    out = logits
    if any(rep_ids):
        seen = _token_counts(rep_ids, vocab, device) > 0  # [B, V]
        rep = _row_tensor([r.params.repetition_penalty for r in rows], torch.float32, device)[:, None]
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    if any(freq_ids):
        counts = _token_counts(freq_ids, vocab, device)  # [B, V]
        freq = _row_tensor([r.params.frequency_penalty for r in rows], torch.float32, device)[:, None]
        pres = _row_tensor([r.params.presence_penalty for r in rows], torch.float32, device)[:, None]
        out = out - freq * counts - pres * (counts > 0).float()
    return out


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each row's list: [B, V] float32."""
    width = max(len(ids) for ids in token_lists)
    # Pad with the id `vocab`, which lands in an extra column that is dropped.
    padded = [[*ids, *([vocab] * (width - len(ids)))] for ids in token_lists]
    ids = torch.tensor(padded, dtype=torch.int64, device=device)  # [B, L]
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


# ---------------------------------------------------------------------------
# Filters on probabilities. Each zeroes tokens and does NOT renormalize.


def apply_top_k(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k most likely tokens of each row, zero the rest. probs: [B, V]; top_k: [B].

    k <= 0 disables the filter for that row; k >= V keeps everything. Exactly k tokens
    stay even with ties (a stable sort keeps the lower token id).
    """
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [B]
    _, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = torch.arange(vocab, device=probs.device)[None, :] < k[:, None]  # [B, V] by rank
    keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)  # back to token order
    return probs.masked_fill(~keep, 0.0)


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose total is >= top_p.

    probs: [B, V], each row summing to 1; top_p: [B] in (0, 1]. The most likely token is
    always kept; top_p >= 1 keeps every token (rounding in the cumulative sum cannot drop any).
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    # A token is kept if the mass strictly before it has not yet reached top_p.
    mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [B, V]
    keep_sorted = mass_before < top_p[:, None]
    keep_sorted[:, 0] = True
    keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    keep |= (top_p >= 1.0)[:, None]
    return probs.masked_fill(~keep, 0.0)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with p >= min_p * max(p) of their row. probs: [B, V]; min_p: [B] in [0, 1]."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


# ---------------------------------------------------------------------------
# The target distribution


def logits_to_probs(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """The distribution each row samples from: [B, V] float32, rows summing to 1.

    penalties -> / temperature -> softmax -> top-k -> renormalize -> top-p -> renormalize
    -> min-p -> renormalize. Greedy rows (temperature 0) get a one-hot on the argmax of
    their penalized logits. Speculative rejection sampling uses this same distribution.
    """
    penalized = apply_penalties(logits, rows)
    device = penalized.device
    params = [r.params for r in rows]
    greedy = [p.greedy for p in params]

    if all(greedy):
        return _one_hot_argmax(penalized)

    # Greedy rows divide by 1 here; they are overwritten by a one-hot below. The floor keeps
    # logits / T finite in float32 (inf - inf would turn softmax into nan).
    temperature = _row_tensor(
        [1.0 if g else max(p.temperature, _MIN_TEMPERATURE) for p, g in zip(params, greedy)], torch.float32, device
    )
    probs = torch.softmax(penalized / temperature[:, None], dim=-1)

    if any(p.top_k > 0 for p in params):
        probs = _renormalize(apply_top_k(probs, _row_tensor([p.top_k for p in params], torch.int64, device)))
    if any(p.top_p < 1.0 for p in params):
        probs = _renormalize(apply_top_p(probs, _row_tensor([p.top_p for p in params], torch.float32, device)))
    if any(p.min_p > 0.0 for p in params):
        probs = _renormalize(apply_min_p(probs, _row_tensor([p.min_p for p in params], torch.float32, device)))

    if any(greedy):
        is_greedy = _row_tensor(greedy, torch.bool, device)[:, None]
        probs = torch.where(is_greedy, _one_hot_argmax(penalized), probs)
    return probs


def _renormalize(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()


# ---------------------------------------------------------------------------
# Drawing tokens


def sample(
    logits: torch.Tensor, rows: Sequence[SampleRow], generator: torch.Generator | None = None
) -> SamplerOutput:
    """Choose one token per row. logits: [B, V], raw from the model.

    Rows with `params.seed` draw their noise from a generator of their own, seeded by
    (seed, number of tokens output so far), so a seeded request gives the same tokens
    whatever else is in the batch and after preemption + recompute. Other rows share
    `generator` (the global RNG when None).

    Logprobs are those of the RAW logits, before penalties, temperature and filters
    (vLLM's default): what the model thinks, not what the sampler was allowed to pick.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
    logits = logits.float()

    if all(r.params.greedy for r in rows):
        # No softmax, no noise: the argmax of the penalized logits is the answer.
        token_ids = apply_penalties(logits, rows).argmax(dim=-1)
    else:
        probs = logits_to_probs(logits, rows)
        noise = _exponential_noise(probs, rows, generator)
        # Exponential race: argmax_i p_i / E_i picks i with probability p_i. Zero-probability
        # tokens score exactly 0 while every kept token scores > 0, so they never win.
        token_ids = (probs / noise).argmax(dim=-1)

    return _with_logprobs(token_ids, logits, rows)


def seed_for_step(seed: int, step: int) -> int:
    """The generator seed for a seeded request's `step`-th output token (0-based). Deterministic across processes."""
    return (seed * 1_000_003 + step) & _SEED_MASK


def _exponential_noise(
    probs: torch.Tensor, rows: Sequence[SampleRow], generator: torch.Generator | None
) -> torch.Tensor:
    """Exp(1) noise [B, V]: seeded rows from their own generators, all other rows in one call."""
    device = probs.device
    noise = torch.empty_like(probs)
    seeded = [i for i, r in enumerate(rows) if r.params.seed is not None and not r.params.greedy]
    if not seeded:
        noise.exponential_(generator=generator)
    else:
        seeded_set = set(seeded)
        others = [i for i in range(len(rows)) if i not in seeded_set]
        if others:
            idx = _row_tensor(others, torch.int64, device)
            noise[idx] = torch.empty(len(others), probs.shape[-1], device=device).exponential_(generator=generator)
        for i in seeded:
            row_gen = torch.Generator(device=device)
            row_gen.manual_seed(seed_for_step(rows[i].params.seed, len(rows[i].output_token_ids)))
            noise[i].exponential_(generator=row_gen)
    # Exp(1) can round to 0 in float32; p / 0 would be inf (or nan for p = 0).
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _with_logprobs(token_ids: torch.Tensor, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
    asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    if not asked:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V] of the raw logits
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    n = min(max(asked), logits.shape[-1])
    top_logprobs, top_ids = logprobs.topk(n, dim=-1)  # sorted, best first
    return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)


def _row_tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    # Pinned and asynchronous: a copy from pageable memory waits for the stream to drain, which under
    # the overlap scheduler means waiting for the step still in flight. (PyTorch's pinned-memory
    # allocator keeps the buffer until the copy has run.)
    return host.pin_memory().to(device, non_blocking=True)

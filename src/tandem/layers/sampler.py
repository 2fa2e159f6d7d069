"""Token sampling on the device: pure functions from logits and per-row tensors to chosen tokens.

The pipeline, per row (`logits_to_probs` writes it out as a distribution):

    raw logits
      -> grammar mask   tokens a row's grammar forbids at -inf (structured output; the mask comes from the host)
      -> penalties      repetition (HF, over prompt + output), frequency / presence (OpenAI, output only)
      -> / temperature
      -> softmax
      -> top-k          -> renormalize
      -> top-p          -> renormalize
      -> min-p          -> renormalize
    = target distribution   (greedy rows: one-hot on the argmax of the penalized logits)

Each filter keeps a *prefix of the tokens sorted by probability*, so the three together keep exactly
the tokens whose scaled logit reaches one threshold per row (`filter_threshold`). Ties at a cut are
kept together: top-k keeps every token at least as likely as the k-th, top-p every token whose more
likely tokens hold less than top_p of the (top-k) mass.

`choose_tokens` draws from that distribution by the Gumbel-max race, argmax over kept tokens of
(scaled logit + g), with g keyed by (seed, position, token) (layers/sampling_noise.py): token i wins
with probability p_i, nothing leaves the device, and the token at a position is the same draw
whichever step computes it. That is what makes speculative decoding's acceptance a plain comparison
(speculative/verify.py) and seeded outputs independent of speculation. On a GPU one Triton kernel
(layers/sampling_kernels.py) does the race and the top-p / min-p cuts without sorting the vocabulary;
`sample_reference` is the same draw in torch (CPU, and the tests' reference). Only top-k sorts.

Every per-request value arrives as a row tensor (`SamplingMetadata`); the only host decisions are the
`SamplingFeatures` flags, which pick which stages run (and which CUDA graph replays them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tandem.layers import sampling_noise
from tandem.request import MIN_TEMPERATURE, SamplingParams  # MIN_TEMPERATURE: keeps logits / T finite
# Top-k cuts up to this k take the k-th value from torch.topk (a radix select) instead of a sort of the
# whole vocabulary: 0.31 against 1.75 ms for 128 rows of 128,256 logits on an H200
# (bench/topk_threshold_bench.py). A larger top_k keeps the sort and runs outside the CUDA graphs.
MAX_SELECTED_TOP_K = 1024


@dataclass(frozen=True)
class SamplingFeatures:
    """Which stages a batch needs, decided on the host from its requests' parameters (never from device
    values). Each combination is its own CUDA graph."""

    sampled: bool = False  # some row has temperature > 0
    top_k: bool = False  # some sampled row uses top-k (the one filter that needs a selection)
    large_top_k: bool = False  # some sampled row's top_k exceeds MAX_SELECTED_TOP_K: a full sort, no graph
    penalties: bool = False  # some row uses a repetition, frequency or presence penalty
    logprobs: int | None = None  # most top logprobs any row asked for; None: no row asked
    constrained: bool = False  # some row's tokens are restricted by a grammar (a mask from the host)

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingFeatures:
        sampled = [p for p in params if not p.greedy]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            sampled=bool(sampled),
            top_k=any(p.top_k > 0 for p in sampled),
            large_top_k=any(p.top_k > MAX_SELECTED_TOP_K for p in sampled),
            penalties=any(p.needs_penalties for p in params),
            logprobs=max(asked) if asked else None,
            constrained=any(p.constrained for p in params),
        )

    @property
    def name(self) -> str:
        parts = ["sampled" if self.sampled else "greedy"]
        parts += ["top_k"] * self.top_k + ["large"] * self.large_top_k + ["penalties"] * self.penalties
        if self.logprobs is not None:
            parts.append(f"logprobs{self.logprobs}")
        if self.constrained:
            parts.append("grammar")
        return "+".join(parts)


GREEDY = SamplingFeatures()
SAMPLED = SamplingFeatures(sampled=True)
SAMPLED_TOP_K = SamplingFeatures(sampled=True, top_k=True)
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit; SamplingParams checks it)
# Every stage on: penalties, logit bias, min_tokens and the top-20 logprobs (with top-k, or without:
# its sort cost 40% of an 8B-shape iteration at batch 32). It serves any batch that needs one of
# those, exactly: a row with neutral weights keeps every logit (x / 1, x - 0 * c, x + 0), a greedy
# row still takes the argmax, and a row that asked for fewer logprobs takes the first of 20.
GENERAL = SamplingFeatures(sampled=True, penalties=True, logprobs=MAX_LOGPROBS)
GENERAL_TOP_K = replace(GENERAL, top_k=True)
# The combinations captured as CUDA graphs: greedy; sampling with temperature, top-p and min-p (the
# server's defaults among them); with top-k too (it sorts); and the two GENERAL ones.
GRAPHED_SAMPLING = (GREEDY, SAMPLED, SAMPLED_TOP_K)
GRAPHED_GENERAL = (GENERAL, GENERAL_TOP_K)
# Speculation's depth-0 steps under a grammar also replay whole-iteration graphs (their one mask, the
# root's, is known before launch; speculative/phases.py).
GRAPHED_CONSTRAINED = tuple(replace(f, constrained=True) for f in GRAPHED_SAMPLING)


def graph_features(features: SamplingFeatures) -> SamplingFeatures:
    """The captured combination that runs a batch of these features: itself, or GENERAL for a batch
    with penalties or logprobs (constrained ones keep their own, and run eagerly with those stages)."""
    if features.constrained or features.large_top_k or (not features.penalties and features.logprobs is None):
        return features
    return GENERAL_TOP_K if features.top_k else GENERAL


def step_mode(features: SamplingFeatures) -> str:
    """The sampling mode a speculative step's costs are kept under (the adaptive depth policy's tables): the
    name of the combination that runs it (`graph_features`: one CUDA graph each)."""
    return graph_features(features).name


@dataclass
class SamplingMetadata:
    """One step's sampling inputs, one row per row of logits (R rows), all on the logits' device."""

    temperature: torch.Tensor  # [R] float32, 0 for greedy rows
    top_k: torch.Tensor  # [R] int64, <= 0 disables
    top_p: torch.Tensor  # [R] float32 in (0, 1]
    min_p: torch.Tensor  # [R] float32 in [0, 1]
    seed: torch.Tensor  # [R] int64
    position: torch.Tensor  # [R] int64: index (in prompt + outputs) of the token being drawn
    # The penalty stage's inputs (None when a step has no penalised row).
    repetition_penalty: torch.Tensor | None  # [R] float32
    frequency_penalty: torch.Tensor | None  # [R] float32
    presence_penalty: torch.Tensor | None  # [R] float32
    output_counts: torch.Tensor | None = None  # [R, V] float32: each token's count in the outputs so far
    prompt_mask: torch.Tensor | None = None  # [R, V] bool: the token occurs in the prompt
    logit_bias: torch.Tensor | None = None  # [R, V] float32: added to the logits
    suppress: torch.Tensor | None = None  # [R, V] bool: not drawable while the row has < min_tokens outputs
    min_tokens: torch.Tensor | None = None  # [R] int64
    num_prompt: torch.Tensor | None = None  # [R] int64: position - num_prompt = index among the outputs
    allowed: torch.Tensor | None = None  # [R, V] bool: the tokens a grammar allows (None: every token)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], positions: Sequence[int], device="cpu",
                    seeds: Sequence[int] | None = None, prompts: Sequence[Sequence[int]] | None = None,
                    outputs: Sequence[Sequence[int]] | None = None, vocab: int = 0) -> SamplingMetadata:
        """Rows built from host values (tests, references). Serving builds them from the device state
        (runtime/sampling_state.py). Unseeded rows use seed 0 here."""
        def col(values, dtype):
            return torch.tensor(list(values), dtype=dtype, device=device)

        seeds = seeds if seeds is not None else [p.seed or 0 for p in params]
        meta = cls(col((p.temperature for p in params), torch.float32), col((p.top_k for p in params), torch.int64),
                   col((p.top_p for p in params), torch.float32), col((p.min_p for p in params), torch.float32),
                   col(seeds, torch.int64), col(positions, torch.int64),
                   col((p.repetition_penalty for p in params), torch.float32),
                   col((p.frequency_penalty for p in params), torch.float32),
                   col((p.presence_penalty for p in params), torch.float32))
        if prompts is not None or outputs is not None:
            n = len(params)
            meta.output_counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
            meta.prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
            for i in range(n):
                for t in (outputs[i] if outputs else ()):
                    meta.output_counts[i, t] += 1
                for t in (prompts[i] if prompts else ()):
                    meta.prompt_mask[i, t] = True
        return meta


# ---------------------------------------------------------------------------
# Grammar mask and penalties


def apply_grammar(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Tokens the row's grammar forbids get -inf (first, so every later stage sees the masked row)."""
    if meta.allowed is None:
        return logits
    return logits.masked_fill(~meta.allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties, then logit bias and min_tokens. logits: [R, V]
    float32; never written.

    Repetition (HF `RepetitionPenaltyLogitsProcessor`): each token of prompt + output gets logit / p
    if the logit is positive, logit * p otherwise. Frequency / presence (OpenAI):
    logit -= frequency * count_in_output + presence * (count > 0). Logit bias (OpenAI): added. min_tokens
    (HF `MinNewTokensLengthLogitsProcessor`): EOS and stop ids at -inf before that many outputs. Rows
    with neutral values are unchanged.
    """
    counts = meta.output_counts
    seen_in_output = counts > 0
    seen = seen_in_output | meta.prompt_mask
    rep = meta.repetition_penalty[:, None]
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    out = out - meta.frequency_penalty[:, None] * counts - meta.presence_penalty[:, None] * seen_in_output.float()
    if meta.logit_bias is not None:
        out = out + meta.logit_bias
    if meta.suppress is not None:
        # min_tokens: the tokens that would end the request are out until it has that many outputs.
        early = (meta.position - meta.num_prompt) < meta.min_tokens  # [R]
        out = out.masked_fill(meta.suppress & early[:, None], float("-inf"))
    return out


# ---------------------------------------------------------------------------
# The kept set: one threshold per row


def filter_threshold(scaled: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[R] float32: the smallest scaled logit (logits / T) that top-k, then top-p, then min-p keep.

    scaled: [R, V] float32. Kept tokens are exactly those with scaled >= threshold; a row with no
    filter gets -inf. The most likely token is always kept (every threshold is a value of the row, or
    below its maximum).
    """
    vocab = scaled.shape[-1]
    neg_inf = torch.full_like(meta.min_p, float("-inf"))  # (no host value: this runs inside CUDA graphs)
    sorted_s, _ = scaled.sort(dim=-1, descending=True)  # [R, V]
    probs = torch.softmax(sorted_s, dim=-1)
    # top-k: the k-th largest value; ties with it stay.
    k = torch.where(meta.top_k > 0, meta.top_k, vocab).clamp(max=vocab)
    kth = sorted_s.gather(1, (k - 1)[:, None])  # [R, 1]
    kept_k = sorted_s >= kth  # a prefix of the sorted row
    # top-p over the top-k survivors, renormalised: keep while the mass strictly before a token (over
    # tokens more likely than it, so ties share their first member's mass) is below top_p.
    mass_k = torch.where(kept_k, probs, 0.0)
    total = mass_k.sum(dim=-1, keepdim=True)
    before = mass_k.cumsum(dim=-1) - mass_k
    first_of_tie = F.pad(sorted_s[:, 1:] != sorted_s[:, :-1], (1, 0), value=True)
    before = torch.where(first_of_tie, before, torch.zeros_like(before))
    before = before.cummax(dim=-1).values  # ties inherit the mass before their first member
    kept_p = kept_k & (before < meta.top_p[:, None] * total)
    last = kept_p.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    threshold = sorted_s.gather(1, last).squeeze(1)
    threshold = torch.where(meta.top_p >= 1.0, kth.squeeze(1), threshold)
    # min-p: p >= min_p * max(p), the same ratio before and after renormalising.
    min_p_cut = torch.where(meta.min_p > 0, sorted_s[:, 0] + torch.log(meta.min_p), neg_inf)
    return torch.maximum(threshold, min_p_cut)


def inverse_temperature(meta: SamplingMetadata) -> torch.Tensor:
    """[R] 1 / T; greedy rows get 1 (they take the argmax instead)."""
    t = torch.where(meta.temperature > 0, meta.temperature.clamp(min=MIN_TEMPERATURE), 1.0)
    return 1.0 / t


def scaled_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits / T, as a product with 1 / T: a correctly rounded multiply, so the GPU kernel, which scales
    on the fly, compares exactly the values the threshold was taken from."""
    return logits * inverse_temperature(meta)[:, None]


def top_k_threshold(scaled: torch.Tensor, meta: SamplingMetadata, large: bool = False) -> torch.Tensor:
    """[R]: the k-th largest scaled logit of each row (top-k keeps the tokens at or above it), -inf for
    rows without top-k. The GPU kernel applies top-p and min-p itself but takes this from a selection
    of the MAX_SELECTED_TOP_K largest values, or from a sort when some row's k is `large`er."""
    vocab = scaled.shape[-1]
    if large:
        ranked = scaled.sort(dim=-1, descending=True).values
        k = torch.where(meta.top_k > 0, meta.top_k, vocab).clamp(max=vocab)
    else:
        ranked = scaled.topk(min(MAX_SELECTED_TOP_K, vocab), dim=-1).values  # descending
        k = meta.top_k.clamp(min=1, max=ranked.shape[-1])  # (rows without top-k are -inf below)
    kth = ranked.gather(1, (k - 1)[:, None]).squeeze(1)
    return torch.where(meta.top_k > 0, kth, torch.full_like(kth, float("-inf")))


def logits_to_probs(logits: torch.Tensor, meta: SamplingMetadata, features: SamplingFeatures | None = None
                    ) -> torch.Tensor:
    """The distribution each row samples from: [R, V] float32, rows summing to 1 (the definition that
    tests and `choose_tokens` agree on)."""
    features = features or SamplingFeatures(sampled=True, top_k=True, penalties=meta.output_counts is not None)
    logits = apply_grammar(logits.float(), meta)
    penalized = apply_penalties(logits, meta) if features.penalties else logits
    scaled = scaled_logits(penalized, meta)
    threshold = filter_threshold(scaled, meta)
    probs = torch.softmax(scaled.masked_fill(scaled < threshold[:, None], float("-inf")), dim=-1)
    one_hot = F.one_hot(penalized.argmax(dim=-1), logits.shape[-1]).float()
    return torch.where((meta.temperature == 0)[:, None], one_hot, probs)


# ---------------------------------------------------------------------------
# Drawing tokens


def choose_tokens(logits: torch.Tensor, meta: SamplingMetadata, features: SamplingFeatures) -> torch.Tensor:
    """One token per row: [R] int64. logits: [R, V], raw from the model. No host sync, no host values:
    safe inside a CUDA graph."""
    logits = apply_grammar(logits.float(), meta)
    penalized = apply_penalties(logits, meta) if features.penalties else logits
    if not features.sampled:
        return penalized.argmax(dim=-1)
    if not logits.is_cuda:
        return sample_reference(penalized, meta)
    from tandem.layers.sampling_kernels import sample_triton  # imports triton

    inv_t = inverse_temperature(meta)
    if features.top_k:
        kth = top_k_threshold(penalized * inv_t[:, None], meta, large=features.large_top_k)
    else:
        kth = torch.full_like(inv_t, float("-inf"))
    return sample_triton(penalized, inv_t, kth, meta.temperature, meta.top_p, meta.min_p, meta.seed, meta.position)


def sample_reference(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The draw written out in torch: the kept tokens by sorting (`filter_threshold`), then the race with
    the position-keyed noise (none for greedy rows, which take the argmax). logits: penalized, float32."""
    inv_t = inverse_temperature(meta)
    scaled = logits * inv_t[:, None]
    if logits.is_cuda or bool(((meta.top_k > 0) | (meta.top_p < 1.0)).any()):
        threshold = filter_threshold(scaled, meta)
    else:
        # No row keeps a top-k or top-p set, so nothing needs the sort (on a CPU it was a fifth of a
        # sampled demo-pair step, and a verify step sorts every tree node): min-p alone, or no cut.
        # (A host read: this branch runs only off the GPU, where no graph is being captured.)
        neg_inf = torch.full_like(meta.min_p, float("-inf"))
        threshold = torch.where(meta.min_p > 0, scaled.amax(dim=-1) + torch.log(meta.min_p), neg_inf)
    noise_scale = (meta.temperature > 0).float()
    return gumbel_race_reference(logits, inv_t, threshold, meta.seed, meta.position, noise_scale)


def gumbel_race_reference(logits, inv_t, threshold, seed, position, noise_scale=None) -> torch.Tensor:
    """With s = logits * inv_t: argmax over tokens with s >= threshold of s + g, g the Gumbel noise of
    (seed, position, token) times noise_scale [R] (default 1), so token i wins with probability
    softmax(s over the kept tokens)_i. All [R] but logits [R, V]."""
    scaled = logits * inv_t[:, None]
    noise = sampling_noise.gumbel_noise(seed, position, scaled.shape[-1])
    if noise_scale is not None:
        noise = noise * noise_scale[:, None]
    score = torch.where(scaled >= threshold[:, None], scaled + noise, float("-inf"))
    return score.argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the RAW logits (vLLM's default: what the model thinks, before penalties, temperature
    and filters): the chosen tokens' [R], and the top-n [R, n] values and ids, best first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.clamp(min=0)[:, None]).squeeze(1)
    top_v, top_i = logp.topk(max(1, min(top_n, logp.shape[-1])), dim=-1)
    return chosen, top_v, top_i

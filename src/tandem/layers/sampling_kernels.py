"""Sampling as one Triton kernel: the Gumbel-max race over the kept tokens, top-p and min-p without a sort.

layers/sampler.py defines what is drawn (`sample_reference` writes it out in torch, with a sort); this
kernel draws the same token. Each program owns one row of logits:

  pass 0  (rows with top-p or min-p) the row's max m and the mass W = sum exp(s - m) over the tokens
          top-k keeps (s >= kth, the k-th largest scaled logit, found by the caller; -inf without top-k)
  race    c = argmax over tokens with s >= max(kth, m + log min_p) and s > pivot of s + g, where
          g is the Gumbel noise of (seed, position, token), hashed in registers (sampling_noise.py)
  check   (rows with top-p < 1) is c in the nucleus: the mass of tokens strictly more likely than c
          below top_p * W? If not, no token at most as likely as c is (the kept set is an upper set
          of the scaled logits), so pivot = s_c and the race runs again over the tokens above it.

The winner over a superset of the kept set that lies in the kept set is the winner over the kept set,
so the result is exact; a round is two passes over the row, and a round fails only when the drawn token
falls outside the nucleus (about 1 - top_p of the time), so rows take 1-2 rounds. No [rows, vocab]
tensor is ever written. Greedy rows (temperature 0) race without noise: the argmax. Ties go to the
lowest token id, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.layers import sampling_noise

_BLOCK = 2048


@triton.jit
def _mix32(x, MUL1: tl.constexpr, MUL2: tl.constexpr):
    # int64 holding uint32 values, exactly as sampling_noise.mix32 computes it.
    x = x ^ (x >> 16)
    x = (x * MUL1) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * MUL2) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(logits_ptr, stride, vocab, inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, kth_ptr,
                   seed_ptr, position_ptr, out_ptr,
                   MUL1: tl.constexpr, MUL2: tl.constexpr, SALT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    inv_t = tl.load(inv_t_ptr + row)
    sampled = tl.load(temperature_ptr + row) > 0.0
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    kth = tl.load(kth_ptr + row)
    seed = tl.load(seed_ptr + row)
    position = tl.load(position_ptr + row)
    # Row keys, as sampling_noise.row_keys.
    k1 = _mix32(_mix32(_mix32(seed & 0xFFFFFFFF, MUL1, MUL2) ^ ((seed >> 32) & 0xFFFFFFFF), MUL1, MUL2)
                ^ (position & 0xFFFFFFFF), MUL1, MUL2)
    k2 = _mix32(k1 ^ SALT, MUL1, MUL2)
    noise_scale = sampled.to(tl.float32)  # greedy rows race without noise
    offsets = tl.arange(0, BLOCK)

    # Pass 0: the row's max and the top-k mass, for the top-p and min-p cuts.
    needs_mass = sampled & ((top_p < 1.0) | (min_p > 0.0))
    row_max = float("-inf")
    mass = 1.0
    if needs_mass:
        m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        w_vec = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            ids = start + offsets
            s = tl.load(base + ids, mask=ids < vocab, other=float("-inf")) * inv_t
            new_m = tl.maximum(m_vec, s)
            scale = tl.exp(tl.where(new_m == float("-inf"), float("-inf"), m_vec - new_m))
            # (s > -inf as well: a masked token's exp(-inf - -inf) would be nan)
            w_vec = w_vec * scale + tl.where((s >= kth) & (s > float("-inf")), tl.exp(s - new_m), 0.0)
            m_vec = new_m
        row_max = tl.max(m_vec, axis=0)
        mass = tl.sum(w_vec * tl.exp(tl.where(m_vec == float("-inf"), float("-inf"), m_vec - row_max)), axis=0)
    min_p_cut = tl.where(needs_mass & (min_p > 0.0), row_max + tl.log(min_p), float("-inf"))
    threshold = tl.maximum(kth, min_p_cut)
    check_nucleus = needs_mass & (top_p < 1.0)

    pivot = float("-inf")
    winner = tl.zeros([], dtype=tl.int64)
    searching = tl.full([], 1, tl.int32)
    while searching != 0:
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_id = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, vocab, BLOCK):
            ids = start + offsets
            valid = ids < vocab
            s = tl.load(base + ids, mask=valid, other=float("-inf")) * inv_t
            h = _mix32(_mix32(ids.to(tl.int64) ^ k1, MUL1, MUL2) ^ k2, MUL1, MUL2)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            score = s - noise_scale * tl.log(-tl.log(u))
            score = tl.where(valid & (s >= threshold) & (s > pivot), score, float("-inf"))
            better = score > best  # strict: each lane keeps its first (lowest id) maximum
            best = tl.where(better, score, best)
            best_id = tl.where(better, ids.to(tl.int64), best_id)
        top = tl.max(best, axis=0)
        candidate = tl.min(tl.where(best == top, best_id, vocab), axis=0)
        s_c = tl.load(base + candidate) * inv_t
        above = 0.0
        if check_nucleus:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, vocab, BLOCK):
                ids = start + offsets
                s = tl.load(base + ids, mask=ids < vocab, other=float("-inf")) * inv_t
                acc += tl.where(s > s_c, tl.exp(s - row_max), 0.0)
            above = tl.sum(acc, axis=0)
        kept = (~check_nucleus) | (above < top_p * mass)
        winner = tl.where(kept, candidate, winner)
        searching = tl.where(kept, 0, 1)
        pivot = tl.where(kept, pivot, s_c)
    tl.store(out_ptr + row, winner)


def sample_triton(logits: torch.Tensor, inv_t: torch.Tensor, kth: torch.Tensor, temperature: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Same contract as sampler.sample_reference; logits [R, V] float32. Every per-row argument is [R]."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](logits, logits.stride(0), vocab, inv_t.float().contiguous(),
                                temperature.float().contiguous(), top_p.float().contiguous(),
                                min_p.float().contiguous(), kth.float().contiguous(), seed.long().contiguous(),
                                position.long().contiguous(), out, MUL1=sampling_noise.MUL1,
                                MUL2=sampling_noise.MUL2, SALT=sampling_noise.ROUND2_SALT, BLOCK=_BLOCK)
    return out

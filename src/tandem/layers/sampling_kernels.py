"""Sampling in two Triton kernels: the Gumbel-max race over the kept tokens, top-p and min-p without a sort.

layers/sampler.py defines what is drawn (`sample_reference` writes it out in torch, with a sort); these
kernels draw the same token:

  round 1 (`_first_round_kernel`, each row cut into slices so that a small batch still fills the GPU)
          c = argmax of s + g over the tokens top-k keeps (s >= kth, the k-th largest scaled logit,
          found by the caller; -inf without top-k), g the Gumbel noise of (seed, position, token)
          hashed in registers (sampling_noise.py); the same pass finds the row's max m and, for rows
          with top-p or min-p, the top-k mass W = sum exp(s - m)
  settle  (`_settle_kernel`, one program per row) is c kept: s_c >= m + log(min_p), and (rows with
          top-p < 1) the mass of tokens strictly more likely than c below top_p * W? If not, no token
          at most as likely as c is (the kept set is an upper set of the scaled logits), so the race
          runs again over the tokens above s_c and the min-p cut, until a kept token wins.

The winner over a superset of the kept set that lies in the kept set is the winner over the kept set,
so the result is exact. Rows without top-p or min-p take one pass; a round fails only when the drawn
token falls outside the kept set (about 1 - top_p of the time), so other rows take 2-4 passes. No
[rows, vocab] tensor is ever written. Greedy rows (temperature 0) race without noise: the argmax. Ties
go to the lowest token id, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.layers import sampling_noise

_BLOCK = 2048
# Enough warps per program to hide the hash's latency (measured 4, 8, 16: bench/sampling_kernel_bench.py).
NUM_WARPS = 16
# Pivot rounds run over all of a row's slices at once; a row still unsettled after them finishes alone in
# the settle kernel. A round settles about top_p of the rows it checks, so three leave about 1 in 1000.
# Only for batches of up to PIVOT_ROUNDS_MAX_ROWS rows: on an H200 at 128k tokens they cut top-p 0.9 at 32
# rows from 113 to 67 us (flat logits) and 179 to 82 us (peaked), but cost 3-5 us more at 1 row, and at
# 128 rows, which fill the GPU one program per row, 17 us more
# (bench/results/sampling-kernel-pivot-rounds-h200-a260f3f.json).
PIVOT_ROUNDS = 3
PIVOT_ROUNDS_MAX_ROWS = 64


@triton.jit
def _mix32(x, MUL1: tl.constexpr, MUL2: tl.constexpr):
    # uint32 arithmetic wraps modulo 2^32: the same bits as sampling_noise.mix32's masked int64.
    x = x ^ (x >> 16)
    x = x * MUL1
    x = x ^ (x >> 15)
    x = x * MUL2
    return x ^ (x >> 16)


@triton.jit
def _race_block(base, start, vocab, inv_t, k1, k2, noise_scale, lower, pivot, MUL1: tl.constexpr,
                MUL2: tl.constexpr, BLOCK: tl.constexpr):
    """One block of the race: token ids, scaled logits, and scores (-inf where s < lower or s <= pivot)."""
    ids = start + tl.arange(0, BLOCK)
    valid = ids < vocab
    s = tl.load(base + ids, mask=valid, other=float("-inf")) * inv_t
    h = _mix32(_mix32(ids.to(tl.uint32) ^ k1, MUL1, MUL2) ^ k2, MUL1, MUL2)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    score = s - noise_scale * tl.log(-tl.log(u))
    return ids, s, tl.where(valid & (s >= lower) & (s > pivot), score, float("-inf"))


@triton.jit
def _row_params(inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr, row,
                MUL1: tl.constexpr, MUL2: tl.constexpr, SALT: tl.constexpr):
    inv_t = tl.load(inv_t_ptr + row)
    sampled = tl.load(temperature_ptr + row) > 0.0
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    position = tl.load(position_ptr + row)
    # Row keys, as sampling_noise.row_keys.
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    k1 = _mix32(_mix32(_mix32(lo, MUL1, MUL2) ^ hi, MUL1, MUL2) ^ (position & 0xFFFFFFFF).to(tl.uint32), MUL1, MUL2)
    k2 = _mix32(k1 ^ SALT, MUL1, MUL2)
    needs_mass = sampled & ((top_p < 1.0) | (min_p > 0.0))
    return inv_t, sampled.to(tl.float32), top_p, min_p, k1, k2, needs_mass


@triton.jit
def _first_round_kernel(logits_ptr, stride, vocab, chunk, inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr,
                        kth_ptr, seed_ptr, position_ptr, part_score_ptr, part_id_ptr, part_max_ptr, part_mass_ptr,
                        MUL1: tl.constexpr, MUL2: tl.constexpr, SALT: tl.constexpr, BLOCK: tl.constexpr):
    """Round 1 over one slice of a row (programs: rows x slices): the best score of the race over the
    tokens top-k keeps, and the slice's max and top-k mass (for the top-p and min-p cuts)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    base = logits_ptr + row * stride
    inv_t, noise_scale, top_p, min_p, k1, k2, needs_mass = _row_params(
        inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr, row, MUL1, MUL2, SALT)
    kth = tl.load(kth_ptr + row)
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    w_vec = tl.zeros([BLOCK], dtype=tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], dtype=tl.int32)
    begin = part * chunk
    end = tl.minimum(begin + chunk, vocab)
    for start in range(begin, end, BLOCK):
        ids, s, score = _race_block(base, start, end, inv_t, k1, k2, noise_scale, kth, float("-inf"),
                                    MUL1, MUL2, BLOCK)
        if needs_mass:
            new_m = tl.maximum(m_vec, s)
            scale = tl.exp(tl.where(new_m == float("-inf"), float("-inf"), m_vec - new_m))
            # (s > -inf as well: a masked token's exp(-inf - -inf) would be nan)
            w_vec = w_vec * scale + tl.where((s >= kth) & (s > float("-inf")), tl.exp(s - new_m), 0.0)
            m_vec = new_m
        better = score > best  # strict: each lane keeps its first (lowest id) maximum
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids, best_id)
    part_max = tl.max(m_vec, axis=0)
    top = tl.max(best, axis=0)
    out = row * num_parts + part
    tl.store(part_score_ptr + out, top)
    tl.store(part_id_ptr + out, tl.min(tl.where(best == top, best_id, vocab), axis=0))
    tl.store(part_max_ptr + out, part_max)
    tl.store(part_mass_ptr + out, tl.sum(
        w_vec * tl.exp(tl.where(m_vec == float("-inf"), float("-inf"), m_vec - part_max)), axis=0))


@triton.jit
def _row_totals(part_max_ptr, part_mass_ptr, row, PARTS: tl.constexpr):
    """The row's max scaled logit and top-k mass, from round 1's slices."""
    parts = row * PARTS + tl.arange(0, PARTS)
    part_max = tl.load(part_max_ptr + parts)
    part_mass = tl.load(part_mass_ptr + parts)
    row_max = tl.max(part_max, axis=0)
    mass = tl.sum(part_mass * tl.exp(tl.where(part_max == float("-inf"), float("-inf"), part_max - row_max)),
                  axis=0)
    return row_max, mass


@triton.jit
def _best_of_slices(score_ptr, id_ptr, row, vocab, PARTS: tl.constexpr):
    """The race's winner over a row's slices (ties: the lowest token id)."""
    parts = row * PARTS + tl.arange(0, PARTS)
    score = tl.load(score_ptr + parts)
    ids = tl.load(id_ptr + parts)
    top = tl.max(score, axis=0)
    return tl.min(tl.where(score == top, ids, vocab), axis=0)


@triton.jit
def _settled(base, candidate, inv_t, lower, check_nucleus, above, top_p, mass):
    """Whether the candidate is kept: not under the top-k / min-p bound, and (rows with top-p < 1) the mass
    of tokens strictly more likely than it below top_p of the top-k mass."""
    s_c = tl.load(base + candidate) * inv_t
    return (s_c >= lower) & ((~check_nucleus) | (above < top_p * mass))


@triton.jit
def _decide(base, row, vocab, prev_ptr, prev_done_ptr, above_ptr, score_ptr, id_ptr, inv_t, lower, check_nucleus,
            top_p, mass, FIRST: tl.constexpr, part_score_ptr, part_id_ptr, PARTS: tl.constexpr):
    """The candidate a pivot round checks, and whether the row is settled. FIRST: from round 1's race
    (settled at once when only the bounds, which need no mass, decide); else from the previous pivot
    round: its candidate if kept, otherwise the winner of its race over the tokens above it."""
    if FIRST:
        candidate = _best_of_slices(part_score_ptr, part_id_ptr, row, vocab, PARTS)
        done = ((tl.load(base + candidate) * inv_t >= lower) & ~check_nucleus).to(tl.int32)
    else:
        candidate = tl.load(prev_ptr + row)
        done = tl.load(prev_done_ptr + row)
        if done == 0:
            parts = row * PARTS + tl.arange(0, PARTS)
            above = tl.sum(tl.load(above_ptr + parts), axis=0)
            done = _settled(base, candidate, inv_t, lower, check_nucleus, above, top_p, mass).to(tl.int32)
            if done == 0:
                candidate = _best_of_slices(score_ptr, id_ptr, row, vocab, PARTS)
    return candidate, done


@triton.jit
def _round_start(base, row, vocab, inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, kth_ptr, seed_ptr, position_ptr,
                 part_score_ptr, part_id_ptr, part_max_ptr, part_mass_ptr, prev_ptr, prev_done_ptr, prev_above_ptr,
                 prev_score_ptr, prev_id_ptr, FIRST: tl.constexpr, PARTS: tl.constexpr, MUL1: tl.constexpr,
                 MUL2: tl.constexpr, SALT: tl.constexpr):
    """What a pivot round and the settle both start from: the row's parameters, max, top-k mass and
    lower bound (top-k, min-p), and the candidate to check now with whether the row is settled."""
    inv_t, noise_scale, top_p, min_p, k1, k2, needs_mass = _row_params(
        inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr, row, MUL1, MUL2, SALT)
    row_max, mass = _row_totals(part_max_ptr, part_mass_ptr, row, PARTS)
    min_p_cut = tl.where(needs_mass & (min_p > 0.0), row_max + tl.log(min_p), float("-inf"))
    lower = tl.maximum(tl.load(kth_ptr + row), min_p_cut)
    check_nucleus = needs_mass & (top_p < 1.0)
    candidate, done = _decide(base, row, vocab, prev_ptr, prev_done_ptr, prev_above_ptr, prev_score_ptr, prev_id_ptr,
                              inv_t, lower, check_nucleus, top_p, mass, FIRST, part_score_ptr, part_id_ptr, PARTS)
    return inv_t, noise_scale, top_p, k1, k2, row_max, mass, lower, check_nucleus, candidate, done


@triton.jit
def _pivot_round_kernel(logits_ptr, stride, vocab, chunk, inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, kth_ptr,
                        seed_ptr, position_ptr, part_score_ptr, part_id_ptr, part_max_ptr, part_mass_ptr,
                        prev_ptr, prev_done_ptr, prev_above_ptr, prev_score_ptr, prev_id_ptr,
                        cand_ptr, done_ptr, above_ptr, score_ptr, id_ptr,
                        FIRST: tl.constexpr, PARTS: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr,
                        SALT: tl.constexpr, BLOCK: tl.constexpr):
    """One pivot round over one slice of a row (programs: rows x slices). Every program of a row first
    settles the previous round the same way (from its slices' sums), and slice 0 records the candidate
    this round checks; then one pass over the slice gives both the mass above the candidate (is it
    kept?) and the race over the tokens above it (the next candidate if not)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    base = logits_ptr + row * stride
    inv_t, noise_scale, top_p, k1, k2, row_max, mass, lower, check_nucleus, candidate, done = _round_start(
        base, row, vocab, inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, kth_ptr, seed_ptr, position_ptr,
        part_score_ptr, part_id_ptr, part_max_ptr, part_mass_ptr, prev_ptr, prev_done_ptr, prev_above_ptr,
        prev_score_ptr, prev_id_ptr, FIRST, PARTS, MUL1, MUL2, SALT)
    if part == 0:
        tl.store(cand_ptr + row, candidate.to(tl.int32))
        tl.store(done_ptr + row, done)
    if done == 0:
        s_c = tl.load(base + candidate) * inv_t
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_id = tl.zeros([BLOCK], dtype=tl.int32)
        begin = part * chunk
        end = tl.minimum(begin + chunk, vocab)
        for start in range(begin, end, BLOCK):
            ids, s, score = _race_block(base, start, end, inv_t, k1, k2, noise_scale, lower, s_c, MUL1, MUL2, BLOCK)
            if check_nucleus:  # (min-p alone needs no mass above the candidate)
                acc += tl.where(s > s_c, tl.exp(s - row_max), 0.0)
            better = score > best
            best = tl.where(better, score, best)
            best_id = tl.where(better, ids, best_id)
        top = tl.max(best, axis=0)
        out = row * PARTS + part
        tl.store(above_ptr + out, tl.sum(acc, axis=0))
        tl.store(score_ptr + out, top)
        tl.store(id_ptr + out, tl.min(tl.where(best == top, best_id, vocab), axis=0))


@triton.jit
def _settle_kernel(logits_ptr, stride, vocab, inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, kth_ptr,
                   seed_ptr, position_ptr, part_score_ptr, part_id_ptr, part_max_ptr, part_mass_ptr,
                   prev_ptr, prev_done_ptr, prev_above_ptr, prev_score_ptr, prev_id_ptr, out_ptr,
                   FIRST: tl.constexpr, PARTS: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr,
                   SALT: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: settles the last pivot round, then (rarely: a row whose draws fell outside
    its nucleus round after round) checks and races again alone over the whole row until a kept token wins."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    inv_t, noise_scale, top_p, k1, k2, row_max, mass, lower, check_nucleus, candidate, done = _round_start(
        base, row, vocab, inv_t_ptr, temperature_ptr, top_p_ptr, min_p_ptr, kth_ptr, seed_ptr, position_ptr,
        part_score_ptr, part_id_ptr, part_max_ptr, part_mass_ptr, prev_ptr, prev_done_ptr, prev_above_ptr,
        prev_score_ptr, prev_id_ptr, FIRST, PARTS, MUL1, MUL2, SALT)
    winner = candidate
    searching = 1 - done
    while searching != 0:
        s_c = tl.load(base + candidate) * inv_t
        above = 0.0
        if check_nucleus & (s_c >= lower):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, vocab, BLOCK):
                ids = start + tl.arange(0, BLOCK)
                s = tl.load(base + ids, mask=ids < vocab, other=float("-inf")) * inv_t
                acc += tl.where(s > s_c, tl.exp(s - row_max), 0.0)
            above = tl.sum(acc, axis=0)
        kept = _settled(base, candidate, inv_t, lower, check_nucleus, above, top_p, mass)
        winner = tl.where(kept, candidate, winner)
        searching = tl.where(kept, 0, 1)
        if searching != 0:
            # No token at most as likely as the candidate is kept: race again over those above it.
            best = tl.full([BLOCK], float("-inf"), tl.float32)
            best_id = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, vocab, BLOCK):
                ids, s, score = _race_block(base, start, vocab, inv_t, k1, k2, noise_scale, lower, s_c,
                                            MUL1, MUL2, BLOCK)
                better = score > best
                best = tl.where(better, score, best)
                best_id = tl.where(better, ids, best_id)
            top = tl.max(best, axis=0)
            candidate = tl.min(tl.where(best == top, best_id, vocab), axis=0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def _num_parts(rows: int, vocab: int) -> int:
    """Slices per row in round 1: enough programs to fill the GPU (about 132 multiprocessors, two
    programs each), at least 8 blocks per slice; a power of two (the settle kernel loads them as a block)."""
    parts = 1
    while rows * parts * 2 < 264 and vocab // (parts * 2) >= 8 * _BLOCK:
        parts *= 2
    return parts


def sample_triton(logits: torch.Tensor, inv_t: torch.Tensor, kth: torch.Tensor, temperature: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                  num_warps: int | None = None, pivot_rounds: int | None = None) -> torch.Tensor:
    """Same contract as sampler.sample_reference; logits [R, V] float32. Every per-row argument is [R].
    pivot_rounds: parallel pivot rounds before the per-row settle (default PIVOT_ROUNDS; tests vary it)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    parts = _num_parts(rows, vocab)
    chunk = triton.cdiv(triton.cdiv(vocab, parts), _BLOCK) * _BLOCK
    part_score = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    part_id = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    part_max = torch.empty_like(part_score)
    part_mass = torch.empty_like(part_score)
    per_row = (inv_t.float().contiguous(), temperature.float().contiguous(), top_p.float().contiguous(),
               min_p.float().contiguous(), kth.float().contiguous(), seed.long().contiguous(),
               position.long().contiguous())
    consts = dict(MUL1=sampling_noise.MUL1, MUL2=sampling_noise.MUL2, SALT=sampling_noise.ROUND2_SALT, BLOCK=_BLOCK,
                  num_warps=num_warps or NUM_WARPS)
    _first_round_kernel[(rows, parts)](logits, logits.stride(0), vocab, chunk, *per_row, part_score, part_id,
                                       part_max, part_mass, **consts)
    # Pivot rounds, each over every slice at once: a row's own rounds in one program read its whole row per
    # pass from one multiprocessor (118 us for 32 rows of 128k at top-p 0.9 on an H200, against 28 us
    # without top-p). Two buffers of round state: a round reads the previous one's while writing its own.
    state = [(torch.empty(rows, dtype=torch.int32, device=logits.device),
              torch.empty(rows, dtype=torch.int32, device=logits.device),
              torch.empty(rows, parts, dtype=torch.float32, device=logits.device),
              torch.empty(rows, parts, dtype=torch.float32, device=logits.device),
              torch.empty(rows, parts, dtype=torch.int32, device=logits.device)) for _ in range(2)]
    shared = (part_score, part_id, part_max, part_mass)
    if pivot_rounds is None:
        pivot_rounds = PIVOT_ROUNDS if 1 < rows <= PIVOT_ROUNDS_MAX_ROWS else 0
    rounds = pivot_rounds
    prev = state[1]
    for r in range(rounds):
        cur = state[r % 2]
        _pivot_round_kernel[(rows, parts)](logits, logits.stride(0), vocab, chunk, *per_row, *shared, *prev, *cur,
                                           FIRST=r == 0, PARTS=parts, **consts)
        prev = cur
    _settle_kernel[(rows,)](logits, logits.stride(0), vocab, *per_row, *shared, *prev, out, FIRST=rounds == 0,
                            PARTS=parts, **consts)
    return out

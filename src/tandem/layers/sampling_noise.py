"""The one definition of a sampled token's randomness: Gumbel noise keyed by (seed, position, token id).

Every random number behind a sampled token is a pure function of the request's seed, the position of
the token being drawn (its index in prompt + outputs) and the candidate token id. So the token at
position t is always the same draw, whoever computes it: a plain decode step, a prefill's last row,
or any node of a speculative tree at that depth. No generator state exists, nothing is advanced, and
preemption, batch companions, overlap or CUDA graphs cannot shift the stream.

The generator is a counter-based hash: a 32-bit integer mixer (Wellons' "lowbias32", two rounds per
element) over the key, computed in int64 tensor arithmetic on the low 32 bits so the CPU reference and
the GPU kernel (layers/sampling_kernels.py) give the same bits. The top 23 bits become a uniform u
strictly inside (0, 1) and g = -log(-log u) a standard Gumbel sample.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B
ROUND2_SALT = 0x9E3779B9  # decorrelates the second row key from the first


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2^32). Products wrap modulo 2^64 and are cut back
    to 32 bits, which leaves exactly the low 32 bits of the unsigned 32-bit product."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from (seed [R] int64, position [R] int64): the whole row's noise follows."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    k1 = mix32(mix32(mix32(lo) ^ hi) ^ (positions & _MASK32))
    k2 = mix32(k1 ^ ROUND2_SALT)
    return k1, k2


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """Top 23 bits of a 32-bit hash as a float32 uniform strictly inside (0, 1). 23, not 24: the largest
    value (2^23 - 1) + 0.5 must be exact in float32, or it rounds up to u = 1 and an infinite noise."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32 Gumbel(0, 1) noise; row r is keyed by (seeds[r], positions[r])."""
    k1, k2 = row_keys(seeds.long(), positions.long())
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = mix32(mix32(token[None, :] ^ k1[:, None]) ^ k2[:, None])
    u = uniform_from_hash(h)
    return -torch.log(-torch.log(u))

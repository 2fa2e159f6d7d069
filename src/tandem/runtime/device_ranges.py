"""Index ranges made once per device and length, then only read: a speculative iteration builds about fifteen
`torch.arange`s (verify, extend and draft metadata, acceptance), each one kernel inside a CUDA graph. Made
outside any graph capture (an engine's eager warm-up steps run first), a range costs a replay nothing; made
during a capture, it is made fresh, as before, and not kept (its memory would belong to the graph's pool).

Callers never write into a range: a write would change every later reader's (tests check they stay ranges)."""

from __future__ import annotations

import torch

_RANGES: dict[tuple[int, int, str], torch.Tensor] = {}


def arange(n: int, device: torch.device | str, start: int = 0) -> torch.Tensor:
    """torch.arange(start, start + n) as int64 on `device`; read-only."""
    device = torch.device(device)
    key = (start, n, str(device))
    cached = _RANGES.get(key)
    if cached is not None:
        return cached
    with torch.inference_mode(False):  # (an inference tensor may not meet autograd-tracked code outside the mode)
        r = torch.arange(start, start + n, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _RANGES[key] = r
    return r


def kept_ranges() -> dict[tuple[int, int, str], torch.Tensor]:
    """The ranges kept so far, by (start, length, device): for tests that check none was written."""
    return dict(_RANGES)

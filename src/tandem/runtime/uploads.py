"""Host values onto the device without waiting for the device.

`torch.tensor(values, device=cuda)` and `cpu_tensor.to(cuda)` copy from pageable memory and then
synchronise the stream: the host stops until every kernel queued before has run. Inside a step's
launch that throws away the overlap (the host would otherwise prepare the next step while this one
runs) and leaves the GPU idle while the host builds what follows. Measured: a speculative prefill
step waited for its own target forward before launching its sampling and draft prefill.

A copy from pinned memory with non_blocking=True is queued like a kernel instead; PyTorch's pinned
allocator keeps the host buffer until that copy has run.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list or host tensor as a tensor on `device`, queued on the current stream (CPU: a plain tensor)."""
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)

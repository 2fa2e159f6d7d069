"""Plain decoding under the overlap scheduler: step N+1 is launched before the host has read step
N's tokens, so a decode's input token ("future" chunk) comes from the device. This pool keeps each
running request's last sampled token there; the handle carries one step's results to the host
through pinned memory and one event."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.layers.sampler import SampleRow


class PlainStatePool:
    def __init__(self, max_requests: int, device: torch.device):
        self.last_token = torch.zeros(max_requests, dtype=torch.long, device=device)
        # The last row belongs to no request: padded rows of a CUDA-graph batch read it.
        self.pad_slot = max_requests - 1
        self._free = list(range(max_requests - 2, -1, -1))
        self.slot_of: dict[str, int] = {}

    def slot(self, request_id: str) -> int:
        slot = self.slot_of.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError("plain decoding state pool is full")
            slot = self.slot_of[request_id] = self._free.pop()
        return slot

    def release(self, request_ids) -> None:
        # Reusable at once: every read and write of these rows is on one stream, in order.
        for rid in request_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self._free.append(slot)


@dataclass
class PlainStepHandle:
    """One launched plain step: where its sampled tokens (and logprobs) will be on the host."""

    iteration: int
    request_ids: list[str] = field(default_factory=list)  # the sampled rows, in order
    rows: list[SampleRow] = field(default_factory=list)
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: torch.cuda.Event | None = None  # None on a CPU (the copies were synchronous)
    keep_alive: list = field(default_factory=list)  # device tensors the copies read

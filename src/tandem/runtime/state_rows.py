"""Which row of a device-resident per-request state pool each running request owns.

Both state pools (speculative decoding's in speculative/state.py, plain decoding's in runtime/plain_state.py)
give every running request one row and keep the last row for padding: padded rows of a CUDA-graph
batch read and write it, so they never touch a request's state.
"""

from __future__ import annotations


class StateRows:
    def __init__(self, max_requests: int, what: str):
        self.what = what  # named in the "full" error
        self.pad_slot = max_requests - 1
        self._free = list(range(max_requests - 2, -1, -1))
        self.slot_of: dict[str, int] = {}

    def slot(self, request_id: str) -> int:
        slot = self.slot_of.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"{self.what} state pool is full")
            slot = self.slot_of[request_id] = self._free.pop()
        return slot

    def release(self, request_ids) -> None:
        # Safe to reuse at once: every write to these rows happens on the main stream, in order, so a
        # step still in flight for the old owner finishes before the new owner's first write.
        for rid in request_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self._free.append(slot)

    def has(self, request_id: str) -> bool:
        return request_id in self.slot_of

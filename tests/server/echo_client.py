"""A stand-in for `EngineClient` with no engine process, for fast tests of the HTTP front end."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tandem.engine import ipc


class EchoEngineClient:
    """Answers each request with its own prompt tokens, one delta per token."""

    def __init__(self, name: str = "engine core", pid: int = 0):
        self.name = name
        self.info = ipc.CoreReady(pid=pid, model_path="/m", max_model_len=64, vocab_size=259, page_size=4,
                                  num_pages=16, speculative_algorithm=None)
        self.stats = ipc.EngineStats(kv_pages_total=16)
        self.dead_reason = None
        self.alive = True
        self.num_queued = self.num_in_flight = self.queued_tokens = 0
        self.process = SimpleNamespace(pid=pid)
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.holding_pages = 0  # requests the flush answer says hold KV pages
        self.cached_tokens = 0  # what the first delta says the prefix cache held

    async def start(self):
        return self.info

    async def shutdown(self):
        pass

    def add(self, request_id, prompt_token_ids, params, queue):
        self.added.append(request_id)
        out = prompt_token_ids[: params.max_new_tokens]
        for i, tok in enumerate(out):
            last = i == len(out) - 1
            delta = ipc.TokenDelta(request_id, [tok], None, "length" if last else None,
                                   num_cached_tokens=self.cached_tokens if i == 0 else None)
            queue.put_nowait((delta, time.monotonic()))

    def abort(self, request_ids):
        self.aborted += request_ids

    async def flush_cache(self):
        return ipc.CacheFlushed(0, not self.holding_pages, self.holding_pages)

"""Device-resident per-request state of the speculative pipeline: the "future" values one iteration
hands to the next without a trip through the CPU.

Every request holds a row (`slot`) in each pool while it runs. The main stream writes all of them; the
plan stream uploads the step's page-table rows, which the host prepares in pinned host staging buffers that the plan stream copies from each step.
"""

from __future__ import annotations

import torch

from tandem.runtime.state_rows import StateRows


class SpecStatePool(StateRows):
    def __init__(self, max_requests: int, max_pages_per_request: int, topk: int, draft_hidden: int,
                 feature_size: int | None, dtype: torch.dtype, device: torch.device, catch_up_window: int = 0):
        super().__init__(max_requests, "speculative")
        self.max_requests = max_requests
        z = dict(device=device)
        self.verified_id = torch.zeros(max_requests, dtype=torch.long, **z)  # last token; no target KV yet
        self.seq_lens = torch.zeros(max_requests, dtype=torch.long, **z)  # tokens with target KV
        self.draft_entries = torch.zeros(max_requests, dtype=torch.long, **z)  # real draft KV entries
        self.topk_logp = torch.zeros(max_requests, topk, dtype=torch.float32, **z)  # next token's draft top-k
        self.topk_ids = torch.zeros(max_requests, topk, dtype=torch.long, **z)
        self.draft_hidden = torch.zeros(max_requests, draft_hidden, dtype=dtype, **z)  # fed at tree step 2
        # Target feature of a prefill chunk's last token, waiting for the next chunk's first token.
        self.pending_feature = (torch.zeros(max_requests, feature_size, dtype=dtype, **z)
                                if feature_size else None)
        # Draft extends deferred by steps that drafted nothing (adaptive depth 0, speculative/catch_up.py):
        # the verified tokens and the target features the extend would have paired them with, run
        # through the draft in one catch-up before the next drafting step. [R], [R, W], [R, W, F].
        self.catch_up_window = catch_up_window
        self.lag = torch.zeros(max_requests, dtype=torch.long, **z)
        self.lag_tokens = torch.zeros(max_requests, max(catch_up_window, 1), dtype=torch.long, **z)
        self.lag_features = (torch.zeros(max_requests, max(catch_up_window, 1), feature_size, dtype=dtype, **z)
                             if feature_size and catch_up_window else None)
        # Host-side staging for the per-step upload of pool rows and page tables (pinned on a GPU so
        # the copy is asynchronous); reused every step, guarded by a write-after-read edge.
        # One buffer, [slot, page ids...] per row, so a step uploads both in one copy (the demo pair's steps
        # wait on the host, where every copy call counts).
        pin = device.type == "cuda"
        self.staging = torch.zeros(max_requests, 1 + max_pages_per_request, dtype=torch.long, pin_memory=pin)
        self.staging_slots = self.staging[:, 0]  # views of it
        self.staging_pages = self.staging[:, 1:]

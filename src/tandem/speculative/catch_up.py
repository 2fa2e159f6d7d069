"""Steps that draft nothing, and the draft catching up afterwards.

When the adaptive policy (speculative/policy.py) picks depth 0, the step is plain decoding's
(speculative/root_step.py). Running the draft extend over its one new token would keep the draft in step, but
costs a draft forward every step (measured on an H200, Llama-3.1-8B shape: 0.64 ms on a 4.8 ms step),
which is exactly the case where the draft is not worth running. So a depth-0 step *defers* the extend:
it appends the verified token and the target feature the extend would have paired it with to the
request's lag buffer (`SpecStatePool.lag_*`). Before the next step that drafts, or once the buffer is
full, one catch-up runs the draft over every deferred token at once: causal attention over the same
positions gives the draft the KV and next top-k that the per-step extends would have (up to rounding).

Nothing here changes what is generated: the draft only proposes, and the target's own tokens decide
(speculative/verify.py). Pure tensor functions: no host values, so both run inside CUDA graphs.
"""

from __future__ import annotations

import torch

from tandem.layers.attention.base import page_slots
from tandem.layers.attention.torch_backend import TorchAttentionMetadata

# Depth-0 steps a request can defer before a catch-up is forced. A catch-up costs about one extend at
# small batches (memory-bound on the draft's weights), and at large ones mostly its gather of every
# row's KV window, whatever the number of queries: 0.42 ms at batch 1 and 1.31 ms at batch 128 for a
# window of 8 (8B shape, H200, bench/results/depth0-cost-llama-3.1-8b-h200-6603c51.json), 1.1% and 2.9%
# of a long run of depth-0 steps. A window as long as the probe interval (policy.py: 32 steps) cuts that about
# fourfold; the buffer costs W * feature bytes per state row (57 MB for an 8B EAGLE-3 head, 72 rows).
CATCH_UP_WINDOW = 32


def defer_extend(pool, slots: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
    """A depth-0 step's draft extend, deferred: tokens [B] (the verified token) and features [B, F] (the
    target feature of the token before it) go to each row's lag buffer. A full buffer keeps its last
    entry overwritten (the engine catches up first, so that only happens on the pad row)."""
    index = pool.lag[slots].clamp(max=pool.catch_up_window - 1)  # [B]
    pool.lag_tokens[slots, index] = tokens
    if features is not None:
        pool.lag_features[slots, index] = features
    pool.lag[slots] = index + 1


def catch_up_metadata(page_rows, first_pos, lag, window: int, kv_bound: int, page_size: int, sink_slot: int):
    """Causal rows of `window` queries: query j < lag[b] is draft position first_pos[b] + j; queries past
    a row's lag compute values nobody reads and store their KV in the sink slot (their positions may
    lie past the row's pages). Returns (metadata, positions [B * window])."""
    b, device = page_rows.shape[0], page_rows.device
    j = torch.arange(window, device=device)
    real = j[None, :] < lag[:, None]  # [B, W]
    last = first_pos + (lag - 1).clamp(min=0)  # a position every query may use
    q_pos = torch.minimum(first_pos[:, None] + j, last[:, None])  # [B, W]
    slot_mapping = torch.where(real, page_slots(page_rows, q_pos, page_size), sink_slot)
    kv_pos = torch.arange(kv_bound, device=device)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [B, W, L]
    metadata = TorchAttentionMetadata(
        slot_mapping=slot_mapping.reshape(-1),
        query_index=torch.arange(b * window, device=device).view(b, window),
        query_valid=None,
        kv_slots=page_slots(page_rows, kv_pos.expand(b, -1), page_size),
        mask=mask[:, None],
        kv_lens=(last + 1).clamp(max=kv_bound).to(torch.int32),
    )
    return metadata, q_pos.reshape(-1)

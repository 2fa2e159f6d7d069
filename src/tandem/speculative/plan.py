"""Attention metadata for the speculative decode path, built on the device from device-resident
lengths (pure tensor functions: no host sync, so they can run on the plan stream while the draft
runs, before the CPU knows the previous step's accept lengths).

Every function returns padded metadata: each row's KV is a window of `kv_bound` positions (an upper
bound the CPU knows from the pages it reserved) with a validity mask, and each row has the same
number of queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.attention.base import page_slots
from tandem.layers.attention.torch_backend import TorchAttentionMetadata


@dataclass
class VerifyPlan:
    """What the plan stream prepares for verification (all [B, ...] on the device)."""

    seq_lens: torch.Tensor  # [B] tokens with target KV before this step (position of the root)
    node_slots: torch.Tensor  # [B, N] cache slot of tree node j: position seq_len + j
    node_cols: torch.Tensor  # [B, N] KV column of node j in the window
    kv_slots: torch.Tensor  # [B, L]
    prefix_mask: torch.Tensor  # [B, N, L] the cached prefix, visible to every node


def plan_verify(page_rows, seq_lens, num_nodes: int, kv_bound: int, page_size: int) -> VerifyPlan:
    b, device = page_rows.shape[0], page_rows.device
    kv_pos = torch.arange(kv_bound, device=device).expand(b, -1)  # [B, L]
    node_pos = seq_lens[:, None] + torch.arange(num_nodes, device=device)  # [B, N]
    prefix = (kv_pos < seq_lens[:, None])[:, None, :].expand(b, num_nodes, kv_bound)
    return VerifyPlan(seq_lens, page_slots(page_rows, node_pos, page_size), node_pos,
                      page_slots(page_rows, kv_pos, page_size), prefix)


def verify_metadata(plan: VerifyPlan, ancestors: torch.Tensor) -> TorchAttentionMetadata:
    """Adds the draft-dependent part (tree mask [B, N, N]) to the plan: node i sees the prefix and
    its ancestors. Runs on the main stream, after the draft."""
    b, n = ancestors.shape[:2]
    mask = plan.prefix_mask.clone()
    mask.scatter_(2, plan.node_cols[:, None, :].expand(b, n, n), ancestors)
    query_index = torch.arange(b * n, device=mask.device).view(b, n)
    # Nothing past the last node is visible: backends that read kv_lens stop there.
    kv_lens = (plan.seq_lens + n).clamp(max=plan.kv_slots.shape[1]).to(torch.int32)
    return TorchAttentionMetadata(plan.node_slots.reshape(-1), query_index, None, plan.kv_slots, mask[:, None],
                                  kv_lens=kv_lens)


def extend_metadata(page_rows, first_pos, num_queries: int, kv_bound: int, page_size: int) -> TorchAttentionMetadata:
    """Causal rows of `num_queries` tokens starting at draft position `first_pos` [B]; padded
    queries past a row's real count compute (and store) values nobody reads."""
    b, device = page_rows.shape[0], page_rows.device
    q_pos = first_pos[:, None] + torch.arange(num_queries, device=device)  # [B, Q]
    kv_pos = torch.arange(kv_bound, device=device)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]
    query_index = torch.arange(b * num_queries, device=device).view(b, num_queries)
    kv_lens = (first_pos + num_queries).clamp(max=kv_bound).to(torch.int32)
    return TorchAttentionMetadata(page_slots(page_rows, q_pos, page_size).reshape(-1), query_index, None,
                                  page_slots(page_rows, kv_pos.expand(b, -1), page_size), mask[:, None],
                                  kv_lens=kv_lens)


def draft_window(page_rows, width: int, page_size: int):
    """[B, width]: the cache slots of draft positions 0..width-1 (for `chain_step_metadata`)."""
    b = page_rows.shape[0]
    return page_slots(page_rows, torch.arange(width, device=page_rows.device).expand(b, -1), page_size)


def chain_step_metadata(window, base, depth: int):
    """`draft_step_metadata` for a chain (topk 1): the node at depth d stores its KV at position
    base + d - 1, right after the prefix [0, base) and its d - 1 ancestors, so its keys are the plain
    run of positions [0, base + d): a window of slots (`draft_window`, as wide as any base + depth)
    cut by a length, with no scratch columns to splice in."""
    b, width = window.shape
    row_end = base + depth  # [B]
    last = row_end - 1  # this node's position
    cols = torch.arange(width, device=window.device)
    metadata = TorchAttentionMetadata(
        slot_mapping=window.gather(1, last[:, None]).reshape(-1),
        query_index=torch.arange(b, device=window.device).view(b, 1),
        query_valid=None,
        kv_slots=window,
        mask=(cols[None, :] < row_end[:, None]).view(b, 1, 1, width),
        kv_lens=row_end.to(torch.int32),
    )
    return metadata, last


def draft_step_metadata(page_rows, base, paths, topk: int, kv_bound: int, page_size: int):
    """One tree-drafting step: frontier node (b, k) at depth d sits at draft position base + d - 1,
    stores its KV in scratch position base + (d - 1) * topk + k, and sees the real draft prefix
    [0, base) plus the scratch entries of its ancestors (`paths` [B, K, d]: frontier slot per depth).
    Returns (metadata over B*K single-query rows, positions [B*K]).

    Row (b, k)'s KV columns are its prefix [0, base) followed at once by its d scratch entries, so
    the row ends at base + d (`kv_lens`): kernels that read kv_lens stop there instead of walking the
    whole window, which with CUDA graphs is as wide as the longest possible request."""
    b, k, d = paths.shape
    device = page_rows.device
    width = kv_bound + d
    cols = torch.arange(width, device=device)
    prefix_slots = page_slots(page_rows, cols.clamp(max=kv_bound - 1).expand(b, -1), page_size)  # [B, W]
    scratch_pos = base[:, None, None] + torch.arange(d, device=device) * topk + paths  # [B, K, d]
    scratch_slots = page_slots(page_rows, scratch_pos.reshape(b, k * d), page_size).view(b, k, d)
    j = (cols[None, :] - base[:, None])[:, None, :]  # [B, 1, W]: column's index among the scratch entries
    in_scratch = (j >= 0) & (j < d)
    scratch_at = scratch_slots.gather(2, j.clamp(0, d - 1).expand(b, k, width))  # [B, K, W]
    kv_slots = torch.where(in_scratch, scratch_at, prefix_slots[:, None, :])  # [B, K, W]
    row_end = base + d  # [B]
    mask = (cols[None, :] < row_end[:, None])[:, None, :].expand(b, k, width)
    metadata = TorchAttentionMetadata(
        slot_mapping=scratch_slots[:, :, -1].reshape(-1),
        query_index=torch.arange(b * k, device=device).view(b * k, 1),
        query_valid=None,
        kv_slots=kv_slots.reshape(b * k, width),
        mask=mask.reshape(b * k, 1, 1, width),
        kv_lens=row_end.repeat_interleave(k).to(torch.int32),
    )
    positions = (base + d - 1)[:, None].expand(b, k).reshape(-1)
    return metadata, positions

"""The MTP drafter: one next-n module per draft step, chain only (models/mtp.py has the format).

Module k at position t consumes (x[t+k+1], h_k-1,t) and predicts x[t+k+2]. Once the target has
verified tokens up to x[M] (M = seq_len: x[M] has no target KV yet), module k's real KV can reach
position M-1-k only: beyond it the token it needs is not known yet. So the modules' frontiers lag
one position per module, and each request keeps, on the device, module k's newest real output
(`MTPStatePool.module_out[:, k]`), which is module k+1's hidden input at the first position it
has not covered yet.

Drafting (topk 1): d_1 = argmax of module 0 at M-1 (kept from the last extend); step k+1 runs module
k at position M-1 on (d_k, the previous step's output) and writes a scratch KV entry there, seeing
module k's real prefix [0, M-1-k] plus that entry and nothing in between (the positions between
would need drafted tokens). Positions the real KV has not reached are free, so the scratch entry
needs no extra page.

Advancing (prefill chunks, and extend after verification): the q new tokens x[s+1..s+q] are the
same for every module; module k puts them at positions s-k .. s-k+q-1, and its hidden inputs are
module k-1's outputs one position back: the kept newest output, then this call's first q-1. Queries
that stand for no real position (padding past a row's length, or positions below 0 while a prompt
is shorter than the lag) write their KV to a trash page of this drafter's cache that no window
lists, so no real entry is ever overwritten with padding.

All state stays on the device and all metadata is built there from device lengths: nothing here
reads a device value on the host, so the worker's overlap path holds.
"""

from __future__ import annotations

import torch

from tandem.kv_cache import KVCache
from tandem.layers.attention.torch_backend import TorchAttentionMetadata
from tandem.models.llama import StepContext
from tandem.models.mtp import MTPDraft
from tandem.speculative.drafter import PrefillFeed
from tandem.speculative.plan import page_slots
from tandem.speculative.state import SpecStatePool
from tandem.speculative.tree import DraftTree, chain_tree


class MTPStatePool(SpecStatePool):
    """SpecStatePool plus each module's newest real output per request. `draft_entries` counts
    module 0's real KV entries (M after a verify), `topk_ids[:, 0]` is d_1."""

    def __init__(self, max_requests: int, max_pages_per_request: int, num_modules: int, hidden: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(max_requests, max_pages_per_request, 1, hidden, hidden, dtype, device)
        self.module_out = torch.zeros(max_requests, num_modules, hidden, dtype=dtype, device=device)  # [R, n, H]
        self.draft_hidden = self.module_out[:, 0]  # what draft step 2 is fed: module 0's newest output


def window_metadata(page_rows, q_pos, valid, kv_bound: int, page_size: int, trash_slot: int) -> TorchAttentionMetadata:
    """Causal rows over one module's KV: query (b, j) at position q_pos[b, j] [B, Q] sees positions
    [0, q_pos] of its request. Invalid queries write to, and see only, the trash slot."""
    b, q = q_pos.shape
    device = q_pos.device
    kv_pos = torch.arange(kv_bound, device=device)
    trash = torch.full((b, 1), trash_slot, dtype=torch.long, device=device)
    kv_slots = torch.cat([trash, page_slots(page_rows, kv_pos.expand(b, -1), page_size)], dim=1)  # [B, 1+L]
    sees = valid[:, :, None] & (kv_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, L]
    mask = torch.cat([~valid[:, :, None], sees], dim=2)
    slot_mapping = torch.where(valid, page_slots(page_rows, q_pos.clamp(min=0), page_size), trash_slot)
    query_index = torch.arange(b * q, device=device).view(b, q)
    return TorchAttentionMetadata(slot_mapping.reshape(-1), query_index, None, kv_slots, mask[:, None])


def scratch_metadata(page_rows, pos, num_real, kv_bound: int, page_size: int) -> TorchAttentionMetadata:
    """One draft step: query b at position pos[b] writes a scratch entry there and sees the module's
    real entries [0, num_real[b]) plus that entry."""
    b, device = page_rows.shape[0], page_rows.device
    kv_pos = torch.arange(kv_bound, device=device)
    scratch = page_slots(page_rows, pos[:, None], page_size)  # [B, 1]
    kv_slots = torch.cat([page_slots(page_rows, kv_pos.expand(b, -1), page_size), scratch], dim=1)
    mask = torch.cat([kv_pos[None, :] < num_real[:, None], torch.ones(b, 1, dtype=torch.bool, device=device)],
                     dim=1)  # [B, L+1]
    return TorchAttentionMetadata(scratch.reshape(-1), torch.arange(b, device=device).view(b, 1), None,
                                  kv_slots, mask[:, None, None])


class MTPDrafter:
    """The worker's Drafter interface (prefill, draft_tree, extend) for MTP modules."""

    def __init__(self, model: MTPDraft, backend, pool: MTPStatePool, page_size: int, num_pages: int,
                 num_steps: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        if num_steps > model.num_modules:
            raise ValueError(f"speculative_num_steps={num_steps} needs {num_steps} MTP modules, but the draft "
                             f"checkpoint has {model.num_modules} (num_nextn_predict_layers); use "
                             f"speculative_num_steps <= {model.num_modules}")
        self.model = model
        self.backend = backend
        self.pool = pool
        self.page_size = page_size
        self.num_steps = num_steps  # modules past the last draft step are never run
        self.device = device
        # One KV layer per module used, plus one page past the pool's for the trash slot.
        self.kv_cache = KVCache(num_steps, num_pages + 1, page_size, num_kv_heads, head_dim, dtype, device)
        self.trash_slot = num_pages * page_size
        # The verify step's page rows, from its draft_tree to its extend (both in one launch).
        self._window: tuple[torch.Tensor, int] | None = None

    def _ctx(self, metadata) -> StepContext:
        return StepContext(self.backend, metadata, self.kv_cache.k, self.kv_cache.v)

    def _keep_first_draft(self, slots: torch.Tensor) -> None:
        """d_1 for the next tree: module 0's argmax after its newest real output."""
        self.pool.topk_ids[slots, 0] = self.model.module_logits(0, self.pool.module_out[slots, 0]).argmax(-1)

    def _advance(self, slots, page_rows, kv_bound: int, tokens, features, first_pos, lens) -> None:
        """Runs every module over each row's new tokens (see the module docstring).
        tokens [B, Q] (x[s+1..], padded past lens [B]), features [B, Q, H] (the target's hidden at
        s, s+1, ...), first_pos [B] = s (module 0's position of the first token)."""
        pool = self.pool
        b, q = tokens.shape
        j = torch.arange(q, device=tokens.device)
        real = j[None, :] < lens[:, None]  # [B, Q]
        ids = tokens.clamp(min=0).reshape(-1)
        newest = (torch.arange(b, device=tokens.device), lens - 1)
        hidden = features  # [B, Q, H]
        for k in range(self.num_steps):
            pos = first_pos[:, None] - k + j  # [B, Q]
            valid = real & (pos >= 0)
            metadata = window_metadata(page_rows, pos, valid, kv_bound, self.page_size, self.trash_slot)
            out = self.model.forward_module(k, ids, pos.clamp(min=0).reshape(-1), hidden.reshape(b * q, -1),
                                            self._ctx(metadata)).view(b, q, -1)
            if k + 1 < self.num_steps:
                # Module k+1 at position p needs module k's output at p: one query back.
                hidden = torch.cat([pool.module_out[slots, k][:, None], out[:, :-1]], dim=1)
            pool.module_out[slots, k] = out[newest]

    # ---- prefill: known tokens, CPU-planned --------------------------------------------------
    def prefill(self, feeds: list[PrefillFeed], sampled: torch.Tensor | None, sampled_row: dict[int, int]) -> None:
        """`sampled` [R] holds this step's sampled tokens; feed i's placeholder is sampled[sampled_row[i]]."""
        idx = [i for i, f in enumerate(feeds) if f.token_ids]
        if not idx:
            return
        b, q = len(idx), max(len(feeds[i].token_ids) for i in idx)
        max_pages = max(len(feeds[i].page_ids) for i in idx)
        tokens = torch.zeros(b, q, dtype=torch.long)
        pages = torch.zeros(b, max_pages, dtype=torch.long)
        flat_rows, placeholder_rows, placeholder_src = [], [], []
        for r, i in enumerate(idx):
            f = feeds[i]
            n = len(f.token_ids)
            tokens[r, :n] = torch.tensor(f.token_ids)
            pages[r, : len(f.page_ids)] = torch.tensor(f.page_ids)
            flat_rows += range(r * q, r * q + n)
            if f.token_ids[-1] < 0:
                placeholder_rows.append(r * q + n - 1)
                placeholder_src.append(sampled_row[i])
        lens = torch.tensor([len(feeds[i].token_ids) for i in idx])
        first = torch.tensor([feeds[i].first_token_index - self.model.token_offset for i in idx])
        kv_bound = int((first + lens).max())
        dev = dict(device=self.device, non_blocking=True)
        tokens, pages, lens, first = tokens.to(**dev), pages.to(**dev), lens.to(**dev), first.to(**dev)
        if placeholder_rows:  # the sampled token stays on the device: no host round trip
            tokens.view(-1)[torch.tensor(placeholder_rows, device=self.device)] = sampled[
                torch.tensor(placeholder_src, device=self.device)]
        feats = torch.cat([feeds[i].features for i in idx])
        features = feats.new_zeros(b * q, feats.shape[-1])
        features[torch.tensor(flat_rows, device=self.device)] = feats
        slots = torch.tensor([feeds[i].slot for i in idx]).to(**dev)
        self._advance(slots, pages, kv_bound, tokens, features.view(b, q, -1), first, lens)
        self.pool.draft_entries[slots] = first + lens
        final = [r for r, i in enumerate(idx) if feeds[i].final]
        if final:
            self._keep_first_draft(slots[torch.tensor(final, device=self.device)])

    # ---- decode: chain drafting and extend from device state --------------------------------
    def draft_tree(self, slots: torch.Tensor, page_rows: torch.Tensor, kv_bound: int,
                   num_draft_tokens: int) -> DraftTree:
        """A chain root -> d_1 -> ... -> d_S: step k+1 runs module k at position M-1 (main stream)."""
        assert num_draft_tokens == self.num_steps + 1, "MTP drafts a chain of num_steps tokens"
        self._window = (page_rows, kv_bound)
        pool = self.pool
        pos = pool.draft_entries[slots] - 1  # [B] M-1: module 0's newest real position
        token = pool.topk_ids[slots, 0]  # d_1
        hidden = pool.module_out[slots, 0]  # [B, H]
        drafts = [token]
        for k in range(1, self.num_steps):
            metadata = scratch_metadata(page_rows, pos, pos + 1 - k, kv_bound, self.page_size)
            hidden = self.model.forward_module(k, token, pos, hidden, self._ctx(metadata))
            token = self.model.module_logits(k, hidden).argmax(-1)
            drafts.append(token)
        return chain_tree(pool.verified_id[slots], torch.stack(drafts, dim=1))

    def extend(self, slots, metadata, tokens: torch.Tensor, features: torch.Tensor | None,
               accept_lens: torch.Tensor, first_pos: torch.Tensor) -> None:
        """Advances every module over each request's newly verified tokens ([B, Q], padded past
        accept_lens). The worker's `metadata` covers one causal window per request for one KV layer;
        the modules lag one position each, so each gets its own window over the same page rows."""
        assert self._window is not None, "extend follows the draft_tree of the same verify step"
        page_rows, kv_bound = self._window
        self._window = None
        self._advance(slots, page_rows, kv_bound, tokens, features, first_pos, accept_lens)
        self.pool.draft_entries[slots] = first_pos + accept_lens
        self._keep_first_draft(slots)

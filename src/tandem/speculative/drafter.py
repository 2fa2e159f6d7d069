"""The draft side of speculative decoding: its KV cache, prefill, tree drafting and extend.

Draft KV positions: token i of a request sits at draft position i - `token_offset` (EAGLE heads pair
token x[i] with the target's hidden state at i - 1). The draft cache uses the request's pages (same
slot arithmetic as the target) in tensors of its own. While drafting a tree, node (depth d, frontier
slot k) writes its KV at draft position `base + (d - 1) * topk + k`, past the request's real draft
entries; the extend after verification overwrites that scratch area with the accepted tokens.

All per-request state lives in the `SpecStatePool` (device memory), so decode steps never need the
CPU to know the previous step's results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kv_cache import KVCache
from tandem.layers.attention.base import AttentionBatch, positions_to_slots
from tandem.models.draft_base import DraftModel
from tandem.models.llama import StepContext
from tandem.runtime.uploads import to_device
from tandem.speculative import catch_up, plan
from tandem.speculative.state import SpecStatePool
from tandem.speculative.tree import DraftTree, TreeBuilder, chain_tree


@dataclass
class PrefillFeed:
    """Known tokens of one prefill chunk to run through the draft."""

    slot: int
    token_ids: list[int]  # a -1 placeholder at the end stands for the token sampled this step
    first_token_index: int  # index of token_ids[0] in the request's token sequence
    features: torch.Tensor | None  # [n, F] target feature paired with each token (None: standalone)
    page_ids: tuple[int, ...]
    final: bool  # the last token is the newest known one: keep its top-k for the next tree


class Drafter:
    def __init__(self, model: DraftModel, backend, pool: SpecStatePool, page_size: int, num_pages: int,
                 topk: int, num_steps: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.backend = backend
        self.pool = pool
        self.page_size = page_size
        self.topk = topk
        self.num_steps = num_steps
        self.device = device
        self.kv_cache = KVCache(model.num_kv_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)

    def _ctx(self, metadata) -> StepContext:
        return StepContext(self.backend, metadata, self.kv_cache.k, self.kv_cache.v)

    def _topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        if self.topk == 1:  # (torch.topk is a radix select of about 15 kernels on a GPU; max is one reduction)
            top_logp, top_ids = logp.max(dim=-1, keepdim=True)
        else:
            top_logp, top_ids = logp.topk(self.topk, dim=-1)
        return top_logp, self.model.to_target_ids(top_ids)

    def _top1(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's best next token [B, 1] in target ids: a chain step needs no log-probabilities."""
        return self.model.to_target_ids(self.model.compute_logits(hidden).argmax(dim=-1, keepdim=True))

    def _store_next(self, slots: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """Keeps what the next tree starts from: the top-k after the newest token, and its hidden."""
        logp, ids = self._topk(last_hidden)
        self.pool.topk_logp[slots] = logp
        self.pool.topk_ids[slots] = ids
        self.pool.draft_hidden[slots] = last_hidden

    # ---- prefill: known tokens, CPU-planned --------------------------------------------------
    def prefill(self, feeds: list[PrefillFeed], sampled: torch.Tensor | None, sampled_row: dict[int, int]) -> None:
        """`sampled` [R] holds this step's sampled tokens; feed i's placeholder is sampled[sampled_row[i]]."""
        feeds_idx = [i for i, f in enumerate(feeds) if f.token_ids]
        if not feeds_idx:
            return
        offset = self.model.token_offset
        input_ids, positions, slots, query_lens, kv_lens = [], [], [], [], []
        placeholder_rows, placeholder_src = [], []
        for i in feeds_idx:
            f = feeds[i]
            start = f.first_token_index - offset
            pos = range(start, start + len(f.token_ids))
            if f.token_ids[-1] < 0:
                placeholder_rows.append(len(input_ids) + len(f.token_ids) - 1)
                placeholder_src.append(sampled_row[i])
            input_ids += f.token_ids
            positions += pos
            slots += positions_to_slots(f.page_ids, pos, self.page_size)
            query_lens.append(len(f.token_ids))
            kv_lens.append(pos.stop)
        ids_t = to_device(input_ids, self.device, torch.long)
        if placeholder_rows:  # the sampled token stays on the device: no host round trip
            ids_t[to_device(placeholder_rows, self.device, torch.long)] = sampled[
                to_device(placeholder_src, self.device, torch.long)]
        pos_t = to_device(positions, self.device, torch.long)
        batch = AttentionBatch.paged(query_lens, [feeds[i].page_ids for i in feeds_idx], kv_lens, slots,
                                     self.page_size)
        ctx = self._ctx(self.backend.plan(batch, self.device))
        features = torch.cat([feeds[i].features for i in feeds_idx]) if self.model.target_hidden else None
        out = self.model(ids_t, pos_t, features, ctx, hidden_is_target=True)
        ends = torch.tensor(query_lens).cumsum(0) - 1
        entries = torch.tensor([feeds[i].first_token_index - offset + len(feeds[i].token_ids) for i in feeds_idx])
        slot_t = torch.tensor([feeds[i].slot for i in feeds_idx])
        self.pool.draft_entries[to_device(slot_t, self.device)] = to_device(entries, self.device)
        final = [j for j, i in enumerate(feeds_idx) if feeds[i].final]
        if final:
            self._store_next(to_device(slot_t[final], self.device), out[to_device(ends[final], self.device)])

    # ---- decode: tree drafting and extend from device state --------------------------------
    def draft_tree(self, slots: torch.Tensor, page_rows: torch.Tensor, kv_bound: int,
                   num_draft_tokens: int, chain_depth: int | None = None) -> DraftTree:
        """Expands a top-k tree per request with `num_steps - 1` draft forwards (main stream); with
        `chain_depth`, a chain of that many drafts instead (the adaptive policy's shorter options)."""
        pool, k = self.pool, self.topk
        if chain_depth is not None:
            return self._draft_chain(slots, page_rows, kv_bound, chain_depth)
        if k == 1 and num_draft_tokens == self.num_steps + 1:
            return self._draft_chain(slots, page_rows, kv_bound, self.num_steps)
        builder = TreeBuilder(pool.verified_id[slots], pool.topk_logp[slots], pool.topk_ids[slots])
        base = pool.draft_entries[slots]  # [B]
        b = slots.shape[0]
        parent_hidden = pool.draft_hidden[slots][:, None].expand(b, k, -1)  # [B, K, H]
        for _ in range(self.num_steps - 1):
            metadata, positions = plan.draft_step_metadata(page_rows, base, builder.frontier_paths, k,
                                                           kv_bound, self.page_size)
            out = self.model(builder.frontier_tokens.reshape(-1), positions, parent_hidden.reshape(b * k, -1),
                             self._ctx(metadata), hidden_is_target=False)
            logp, ids = self._topk(out)
            parent_slot = builder.expand(logp.view(b, k, k), ids.view(b, k, k))  # [B, K]
            out = out.view(b, k, -1)
            parent_hidden = out.gather(1, parent_slot[:, :, None].expand(-1, -1, out.shape[-1]))
        return builder.build(num_draft_tokens)

    def _draft_chain(self, slots: torch.Tensor, page_rows: torch.Tensor, kv_bound: int, depth: int) -> DraftTree:
        """A chain of `depth` drafts (top-1 at each step; depth 0: the root alone): the same forwards and
        tokens as a topk-1 tree, without the tree builder's scoring and selection."""
        pool = self.pool
        root = pool.verified_id[slots]
        if depth == 0:  # (chain_tree's cat and aranges are five kernels a step where nothing is drafted)
            return DraftTree(root[:, None], torch.full_like(root[:, None], -1), torch.zeros_like(root[:, None]),
                             max_depth=0, chain=True)
        base = pool.draft_entries[slots]  # [B]
        token = pool.topk_ids[slots][:, :1]  # [B, 1]: d_1 (the best of the kept top-k), kept by the last extend
        hidden = pool.draft_hidden[slots]  # [B, H]
        drafts = [token[:, 0]]
        # A chain's keys are a plain run of positions: one slot window serves every step.
        window = plan.draft_window(page_rows, kv_bound + self.num_steps - 1, self.page_size)
        for step in range(1, depth):
            metadata, positions = plan.chain_step_metadata(window, base, step)
            hidden = self.model(token.reshape(-1), positions, hidden, self._ctx(metadata), hidden_is_target=False)
            token = self._top1(hidden)
            drafts.append(token[:, 0])
        return chain_tree(root, torch.stack(drafts, dim=1))

    def extend(self, slots, metadata, tokens: torch.Tensor, features: torch.Tensor | None,
               accept_lens: torch.Tensor, first_pos: torch.Tensor) -> None:
        """Runs the draft over each request's newly verified tokens ([B, Q], padded past accept_lens),
        paired with the target features of the tokens before them ([B, Q, F])."""
        b, q = tokens.shape
        num_pos = torch.arange(q, device=tokens.device).expand(b, -1)
        positions = (first_pos[:, None] + num_pos).reshape(-1)
        feats = features.reshape(b * q, -1) if features is not None else None
        out = self.model(tokens.clamp(min=0).reshape(-1), positions, feats, self._ctx(metadata), hidden_is_target=True)
        last = out.view(b, q, -1)[torch.arange(b, device=tokens.device), accept_lens - 1]  # [B, H]
        self.pool.draft_entries[slots] = first_pos + accept_lens
        self._store_next(slots, last)

    def catch_up(self, slots: torch.Tensor, page_rows: torch.Tensor, kv_bound: int, sink_slot: int,
                 window: int | None = None) -> None:
        """Runs the draft over each row's deferred tokens (speculative/catch_up.py) and empties its lag
        buffer; rows without deferred tokens keep their state. `window`: queries per row, at least every
        row's lag (default: the whole buffer, as a CUDA graph must; an eager step passes the batch's
        largest lag, since on a CPU the draft's cost grows with the queries)."""
        pool = self.pool
        b, window = slots.shape[0], window or pool.catch_up_window
        lag = pool.lag[slots]  # [B]
        first_pos = pool.draft_entries[slots]
        metadata, positions = catch_up.catch_up_metadata(page_rows, first_pos, lag, window, kv_bound,
                                                         self.page_size, sink_slot)
        feats = (pool.lag_features[slots, :window].reshape(b * window, -1) if pool.lag_features is not None
                 else None)
        out = self.model(pool.lag_tokens[slots, :window].reshape(-1), positions, feats, self._ctx(metadata),
                         hidden_is_target=True)
        last = out.view(b, window, -1)[torch.arange(b, device=slots.device), (lag - 1).clamp(min=0)]  # [B, H]
        lagging = lag > 0
        logp, ids = self._topk(last)
        pool.topk_logp[slots] = torch.where(lagging[:, None], logp, pool.topk_logp[slots])
        pool.topk_ids[slots] = torch.where(lagging[:, None], ids, pool.topk_ids[slots])
        pool.draft_hidden[slots] = torch.where(lagging[:, None], last, pool.draft_hidden[slots])
        pool.draft_entries[slots] = first_pos + lag
        pool.lag.index_fill_(0, slots, 0)  # (no host scalar: this runs inside CUDA graphs)


def target_feature(draft_model, hidden, aux):
    """The target feature a draft pairs with each token (None for a standalone draft): the final hidden
    state (EAGLE), or the auxiliary layers' states side by side (EAGLE-3)."""
    kind = draft_model.target_hidden
    return None if kind is None else (torch.cat(aux, dim=-1) if kind == "aux" else hidden)

"""The draft side of speculative decoding: its KV cache, per-request state, tree drafting and extend.

Draft KV positions: token i of a request sits at draft position i - `token_offset` (EAGLE heads pair
token x[i] with the target's hidden state at i - 1). The draft cache uses the request's pages (same
slot arithmetic as the target) in tensors of its own. While drafting a tree, node (depth d, frontier
slot k) writes its KV at draft position `base + (d - 1) * topk + k`, past the request's real draft
entries; the extend after verification overwrites that scratch area with the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kv_cache import KVCache
from tandem.layers.attention.base import AttentionBatch, positions_to_slots
from tandem.models.draft_base import DraftModel
from tandem.models.llama import StepContext
from tandem.spec.tree import DraftTree, TreeBuilder


@dataclass
class DraftState:
    """A request's draft-side state between iterations (tensors stay on the device)."""

    num_entries: int = 0  # draft KV entries (positions 0 .. num_entries-1 are real)
    pending_hidden: torch.Tensor | None = None  # target hidden of a prefill chunk's last token, unpaired
    topk_logp: torch.Tensor | None = None  # [K] draft log-probs of the next token's top-k
    topk_ids: torch.Tensor | None = None  # [K] their target vocabulary ids
    hidden: torch.Tensor | None = None  # [H] draft output at the last fed token (fed at tree step 2)

    @property
    def ready(self) -> bool:
        return self.topk_ids is not None


@dataclass
class DraftFeed:
    """Tokens of one request to run through the draft (prefill or extend after verification)."""

    request_id: str
    token_ids: list[int]
    first_token_index: int  # index of token_ids[0] in the request's token sequence
    hidden: torch.Tensor | None  # [n, H_in] target hidden paired with each token (None: standalone)
    page_ids: tuple[int, ...]
    produce_topk: bool  # the last token is the newest known token: keep its top-k for the next tree


class Drafter:
    def __init__(self, model: DraftModel, backend, page_size: int, num_pages: int, topk: int, num_steps: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.topk = topk
        self.num_steps = num_steps
        self.device = device
        self.kv_cache = KVCache(model.num_kv_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        self.states: dict[str, DraftState] = {}

    def state(self, request_id: str) -> DraftState:
        return self.states.setdefault(request_id, DraftState())

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def _ctx(self, batch: AttentionBatch) -> StepContext:
        return StepContext(self.backend, self.backend.plan(batch, self.device), self.kv_cache.k, self.kv_cache.v)

    # ---- prefill / extend -------------------------------------------------------------------
    def feed(self, feeds: list[DraftFeed]) -> None:
        """Runs the draft over known tokens (causal), storing KV and, where asked, the next top-k."""
        feeds = [f for f in feeds if f.token_ids]
        if not feeds:
            return
        offset = self.model.token_offset
        ps = self.page_size
        input_ids, positions, slots, query_lens, kv_slots = [], [], [], [], []
        for f in feeds:
            start = f.first_token_index - offset
            pos = range(start, start + len(f.token_ids))
            seq = positions_to_slots(f.page_ids, range(pos.stop), ps)
            input_ids += f.token_ids
            positions += pos
            slots += seq[start:]
            query_lens.append(len(f.token_ids))
            kv_slots.append(seq)
            self.state(f.request_id).num_entries = pos.stop
        ctx = self._ctx(AttentionBatch(query_lens, kv_slots, slots))
        hidden_in = None
        if self.model.target_hidden is not None:
            hidden_in = torch.cat([f.hidden for f in feeds])
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        out = self.model(ids_t, pos_t, hidden_in, ctx, hidden_is_target=True)
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        wanted = [i for i, f in enumerate(feeds) if f.produce_topk]
        if not wanted:
            return
        last_h = out[last[wanted]]  # [R, H]
        logp, ids = self._topk(last_h)
        for j, i in enumerate(wanted):
            st = self.state(feeds[i].request_id)
            st.topk_logp, st.topk_ids, st.hidden = logp[j], ids[j], last_h[j]

    def _topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        top_logp, top_ids = logp.topk(self.topk, dim=-1)
        return top_logp, self.model.to_target_ids(top_ids)

    # ---- tree drafting ----------------------------------------------------------------------
    def draft_tree(self, request_ids: list[str], root_tokens: list[int], page_ids: list[tuple[int, ...]],
                   num_draft_tokens: int) -> DraftTree:
        """Expands a top-k tree for each request with `num_steps - 1` draft forwards."""
        states = [self.states[r] for r in request_ids]
        builder = TreeBuilder(
            torch.tensor(root_tokens, dtype=torch.long, device=self.device),
            torch.stack([s.topk_logp for s in states]),
            torch.stack([s.topk_ids for s in states]),
        )
        k, b = self.topk, len(states)
        parent_hidden = torch.stack([s.hidden for s in states]).unsqueeze(1).expand(b, k, -1)  # [B, K, H]
        prefix = [positions_to_slots(p, range(s.num_entries), self.page_size) for p, s in zip(page_ids, states)]
        for _ in range(self.num_steps - 1):
            depth = builder.depth
            paths = builder.frontier_paths.tolist()  # [B][K][depth]
            input_ids = builder.frontier_tokens.reshape(-1)
            positions, slots, kv_slots = [], [], []
            for i, s in enumerate(states):
                base = s.num_entries
                for slot in range(k):
                    # Scratch position of each ancestor (and the node itself) on this node's path.
                    path_pos = [base + d * k + paths[i][slot][d] for d in range(depth)]
                    path_slots = positions_to_slots(page_ids[i], path_pos, self.page_size)
                    positions.append(base + depth - 1)
                    slots.append(path_slots[-1])
                    kv_slots.append(prefix[i] + path_slots)
            ctx = self._ctx(AttentionBatch([1] * (b * k), kv_slots, slots))
            pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
            out = self.model(input_ids, pos_t, parent_hidden.reshape(b * k, -1), ctx, hidden_is_target=False)
            logp, ids = self._topk(out)
            parent_slot = builder.expand(logp.view(b, k, k), ids.view(b, k, k))  # [B, K]
            out = out.view(b, k, -1)
            parent_hidden = out.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        return builder.build(num_draft_tokens)

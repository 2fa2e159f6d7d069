"""EAGLE-2 draft trees: top-k expansion, rerank by cumulative log-prob.

Terms: K = topk, S = num_steps (tree depth drafted), N = num_draft_tokens (tree size
INCLUDING node 0, the root, which is the last verified token).

The draft model runs S times. Step 1 gives the K best children of the root; each later
step gives K children for each of the K frontier nodes (K*K candidates), of which the K
with the best cumulative log-prob become the next frontier. Every candidate ever made,
frontier or not, may end up in the tree: `build` keeps the N-1 best of all
K + (S-1)*K*K candidates. Chain drafting is K=1, N=S+1.

Everything is batched over B requests, runs on any device, and never reads a device
value on the host: all shapes come from K, S and N, which are Python ints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DraftTree:
    tokens: Tensor  # [B, N] int64; node 0 is the root (the last verified token)
    parents: Tensor  # [B, N] int64; -1 for the root; parents[b, i] < i, so parents precede children
    depths: Tensor  # [B, N] int64; root 0, depths[b, i] = depths[b, parents[b, i]] + 1
    # A bound on `depths` known on the host, so verify's output shapes [B, max_depth + 1] need no
    # device sync. None: computed from `depths` (a sync; fine in tests, avoid in the decode loop).
    max_depth: int | None = None
    # Known on the host: node i's parent is i - 1 in every row (topk = 1). Acceptance and the verify
    # mask then take shortcuts of a few kernels instead of a walk over the nodes.
    chain: bool = False

    def __post_init__(self) -> None:
        if self.max_depth is None:
            self.max_depth = int(self.depths.max())

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def ancestor_mask(parents: Tensor) -> Tensor:
    """[B, N, N] bool: [b, i, j] is True iff j == i or j is an ancestor of i (the verify attention mask).

    parents: [B, N] int64 with parents[b, i] < i, -1 for the root.
    """
    batch, num_nodes = parents.shape
    mask = torch.eye(num_nodes, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)  # [B, N, N]
    rows = torch.arange(batch, device=parents.device)
    for i in range(1, num_nodes):
        # Parents come first, so the parent's row is already complete: inherit it.
        parent = parents[:, i]  # [B]
        inherited = mask[rows, parent.clamp(min=0)] & (parent >= 0)[:, None]  # [B, N]
        mask[:, i] |= inherited
    return mask


def chain_ancestor_mask(batch: int, num_nodes: int, device) -> Tensor:
    """`ancestor_mask` of a chain: node i sees nodes 0..i."""
    return torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)


def chain_tree(root_tokens: Tensor, draft_tokens: Tensor) -> DraftTree:
    """The tree of chain drafting (topk=1): root -> d_1 -> ... -> d_S. root_tokens: [B]; draft_tokens: [B, S]."""
    batch, steps = draft_tokens.shape
    device = draft_tokens.device
    tokens = torch.cat([root_tokens[:, None], draft_tokens], dim=1).long()  # [B, S+1]
    parents = torch.arange(-1, steps, device=device).expand(batch, -1).clone()  # node i's parent is i-1
    depths = torch.arange(steps + 1, device=device).expand(batch, -1).clone()
    return DraftTree(tokens, parents, depths, max_depth=steps, chain=True)


class TreeBuilder:
    """Grows one EAGLE-2 draft tree per request, one draft step at a time.

    Usage, with the draft model in between:
        builder = TreeBuilder(verified_ids, first_logp, first_ids)          # frontier = step-1 top-k
        for _ in range(num_steps - 1):
            logp, ids = draft(builder.frontier_tokens, ...)                  # [B, K, K] each
            parent_slot = builder.expand(logp, ids)                          # gather parents' hidden states with it
        tree = builder.build(num_draft_tokens)

    Candidates are numbered in creation order: the K step-1 children first, then for each
    expansion the K*K children in (frontier slot, rank) order. All tie-breaking uses that
    number (lower first), so results are deterministic.
    """

    def __init__(self, root_tokens: Tensor, first_logp: Tensor, first_ids: Tensor) -> None:
        batch, topk = first_logp.shape
        device = first_logp.device
        first_logp = _no_nan(first_logp)
        self.topk = topk
        self._root_tokens = root_tokens.long()  # [B]
        self._slots = torch.arange(topk, device=device)  # [K]

        # Every candidate so far, as chunks in creation order (concatenated along dim 1 in `build`).
        self._cand_scores = [first_logp]  # [B, K], then [B, K*K] per expansion
        self._cand_tokens = [first_ids.long()]
        self._cand_parents = [torch.full_like(self._cand_tokens[0], -1)]  # parent's candidate number; -1 = root
        self._cand_depths = [1]  # one Python int per chunk
        self._num_cands = topk

        # The frontier: the K nodes the draft model extends next.
        self._frontier_scores = first_logp  # [B, K] cumulative log-prob
        self._frontier_cands = self._slots.expand(batch, -1)  # [B, K] candidate number of each frontier node
        self._frontier_tokens = self._cand_tokens[0]  # [B, K]
        self._frontier_paths = self._slots.expand(batch, -1)[:, :, None]  # [B, K, depth]

    @property
    def depth(self) -> int:
        """Depth of the current frontier (1 after __init__, S after S-1 expansions)."""
        return self._cand_depths[-1]

    @property
    def frontier_tokens(self) -> Tensor:
        """[B, K]: the tokens the caller feeds to the draft model next."""
        return self._frontier_tokens

    @property
    def frontier_paths(self) -> Tensor:
        """[B, K, depth]: [b, k, t-1] = frontier slot, at depth t, of frontier node k's ancestor (t = depth: itself).

        The draft model wrote the KV of the depth-t frontier into scratch slot (t, slot), so
        this says which scratch entries each frontier node attends to.
        """
        return self._frontier_paths

    def expand(self, child_logp: Tensor, child_ids: Tensor) -> Tensor:
        """Add the K*K children of the frontier and move the frontier one level down.

        child_logp, child_ids: [B, K, K]; row [b, i] is the draft's top-K (log-prob, token)
        for the children of frontier node i. Returns [B, K]: for each new frontier node, the
        OLD frontier slot of its parent (to gather the parent's draft hidden state).
        """
        batch, topk, _ = child_logp.shape
        assert topk == self.topk and child_ids.shape == child_logp.shape, (child_logp.shape, child_ids.shape)

        # Candidate c = i*K + j is child j of frontier node i.
        scores = (self._frontier_scores[:, :, None] + _no_nan(child_logp)).flatten(1)  # [B, K*K] cumulative log-prob
        tokens = child_ids.long().flatten(1)  # [B, K*K]
        parents = self._frontier_cands.repeat_interleave(topk, dim=1)  # [B, K*K]

        # The K best by score; the stable sort keeps ties in candidate order (lower first).
        best = _top_stable(scores, topk)  # [B, K] indices into the K*K children
        parent_slot = best // topk  # [B, K]

        self._cand_scores.append(scores)
        self._cand_tokens.append(tokens)
        self._cand_parents.append(parents)
        self._cand_depths.append(self.depth + 1)

        old_depth = self._frontier_paths.shape[2]
        ancestors = self._frontier_paths.gather(1, parent_slot[:, :, None].expand(-1, -1, old_depth))  # [B, K, d-1]
        self._frontier_paths = torch.cat([ancestors, self._slots.expand(batch, -1)[:, :, None]], dim=2)
        self._frontier_scores = scores.gather(1, best)
        self._frontier_tokens = tokens.gather(1, best)
        self._frontier_cands = self._num_cands + best
        self._num_cands += topk * topk
        return parent_slot

    def build(self, num_draft_tokens: int) -> DraftTree:
        """The tree of the root plus the best N-1 candidates, nodes in creation order.

        Why every chosen node's parent is chosen: log-probs are <= 0, so a parent's score is
        >= each child's, and on a tie the parent wins because it was created earlier. So the
        parent ranks strictly before its child in the selection order. And choosing nodes in
        creation order makes parents precede children (parents[i] < i).
        """
        num_pick = num_draft_tokens - 1
        assert 0 <= num_pick <= self._num_cands, (num_draft_tokens, self._num_cands)
        scores = torch.cat(self._cand_scores, dim=1)  # [B, C]
        tokens = torch.cat(self._cand_tokens, dim=1)  # [B, C]
        cand_parents = torch.cat(self._cand_parents, dim=1)  # [B, C]
        depths = torch.cat(
            [torch.full_like(chunk, d) for chunk, d in zip(self._cand_tokens, self._cand_depths)], dim=1
        )  # [B, C]
        batch, num_cands = scores.shape
        device = scores.device

        picked = _top_stable(scores, num_pick).sort(dim=1).values  # [B, N-1] candidate numbers, creation order

        # Candidate number -> node index (node 0 is the root, so the first picked is node 1).
        node_of = torch.zeros(batch, num_cands, dtype=torch.long, device=device)
        node_of.scatter_(1, picked, torch.arange(1, num_pick + 1, device=device).expand(batch, -1))
        parent_cands = cand_parents.gather(1, picked)  # [B, N-1]; -1 = the root
        parents = torch.where(parent_cands < 0, 0, node_of.gather(1, parent_cands.clamp(min=0)))

        root_col = torch.zeros(batch, 1, dtype=torch.long, device=device)
        return DraftTree(
            tokens=torch.cat([self._root_tokens[:, None], tokens.gather(1, picked)], dim=1),
            parents=torch.cat([root_col - 1, parents], dim=1),
            depths=torch.cat([root_col, depths.gather(1, picked)], dim=1),
            max_depth=min(self.depth, num_pick),
            chain=self.topk == 1,  # one candidate per depth, each the child of the one before
        )


def _top_stable(scores: Tensor, k: int) -> Tensor:
    """[B, k] indices of the k highest scores per row; ties go to the lower index.

    `torch.topk` does not promise an order among ties, so sort with a stable sort instead.
    """
    return scores.sort(dim=1, descending=True, stable=True).indices[:, :k]


def _no_nan(logp: Tensor) -> Tensor:
    """NaN log-probs as -inf. A dormant request (speculative/policy/) drafts from no state: its draft
    attends to KV entries never written, which can hold NaN, and NaN scores break the ordering that
    keeps every chosen node's parent chosen (the tree's parents and depths would disagree, and its
    accept walk would skip a depth). At -inf every score ties and creation order decides, as for any tie."""
    return torch.nan_to_num(logp, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


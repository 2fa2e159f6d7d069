"""Acceptance on a draft tree: which drafted tokens the target keeps, plus one token of its own.

The target's own token at every node is computed first, on the device (layers/sampler.py): its argmax
for a greedy row, its sample for a sampled row, drawn with the noise keyed by (seed, position) of the
token that node predicts. A child is accepted when its token equals the target's token at its parent;
the walk stops at the first node with no such child, and that node's target token is the bonus.

Why this is exact for sampled rows: the draft tree is a deterministic function of the context (top-k
of the draft), so along the accepted path every emitted token is the target's own draw at its
position, from the target's distribution given exactly the tokens before it; a draft only decides how
many of those draws one verify step yields. The chance of accepting some child is the target's mass
on the children, the same as rejection sampling with a one-hot draft, and the emitted tokens are the
ones plain decoding with the same seed would emit.

The walk is one pass over the nodes in index order. Because parents precede children
(parents[i] < i), that pass meets the children of the current node in index order, after the node
itself; a node that is not a child of the current node is skipped. Batched over B, device-agnostic,
and it reads nothing back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.speculative.tree import DraftTree


@dataclass
class AcceptResult:
    accept_lens: Tensor  # [B] int64: tokens produced this step = accepted drafts + 1 (the bonus); in [1, D+1]
    path: Tensor  # [B, D+1] int64: accepted node indices, path[:, 0] == 0 (root); -1 from accept_lens on
    out_tokens: Tensor  # [B, D+1] int64: tokens[path[1:accept_lens]] then the bonus token; -1 after it


def accept_target_tokens(tree: DraftTree, target_tokens: Tensor, coins: Tensor | None = None,
                         use_coins: Tensor | None = None) -> AcceptResult:
    """target_tokens: [B, N], the target's own token after each node (argmax or position-keyed sample).

    Move to the child whose token equals the target's token at the current node; stop when none does.
    The bonus token is the target's token at the last accepted node.

    BENCHMARK ONLY: rows with `use_coins` [B] set accept child c when `coins[b, c]` holds instead of
    when its token matches (synthetic acceptance, tandem.bench.synthetic). Both rules live in one
    function so one captured CUDA graph serves either.
    """
    if tree.tokens.shape[1] == 1:  # the root alone (adaptive depth 0): its target token, nothing to walk
        root = torch.zeros_like(target_tokens)
        return AcceptResult(accept_lens=root[:, 0] + 1, path=root, out_tokens=target_tokens)
    if tree.chain:
        return _accept_chain(tree, target_tokens, coins, use_coins)
    batch, num_nodes = tree.tokens.shape
    rows = torch.arange(batch, device=tree.tokens.device)
    cur = torch.zeros(batch, dtype=torch.long, device=tree.tokens.device)  # [B] deepest accepted node
    accepted = torch.zeros(batch, num_nodes, dtype=torch.bool, device=tree.tokens.device)  # [B, N]
    accepted[:, 0].fill_(True)  # fill_, not "= True": that copies a host value, which a CUDA graph capture rejects
    for c in range(1, num_nodes):
        is_child = tree.parents[:, c] == cur
        match = tree.tokens[:, c] == target_tokens[rows, cur]
        if coins is not None:
            match = torch.where(use_coins, coins[:, c], match)
        accept = is_child & match  # the first matching child wins
        accepted[:, c] = accept
        cur = torch.where(accept, c, cur)
    return _result(tree, accepted, bonus=target_tokens[rows, cur])


def _accept_chain(tree: DraftTree, target_tokens: Tensor, coins: Tensor | None, use_coins: Tensor | None
                  ) -> AcceptResult:
    """`accept_target_tokens` on a chain, without the walk: node c is accepted iff it and every node
    before it matches the target's token at its parent (c - 1)."""
    match = tree.tokens[:, 1:] == target_tokens[:, :-1]  # [B, N-1]
    if coins is not None:
        match = torch.where(use_coins[:, None], coins[:, 1:], match)
    prefix = match.long().cumprod(dim=1).bool()  # [B, N-1]
    root = torch.ones(prefix.shape[0], 1, dtype=torch.bool, device=prefix.device)  # always kept
    accepted = torch.cat([root, prefix], dim=1)
    cur = prefix.sum(dim=1)  # deepest accepted node
    return _result(tree, accepted, bonus=target_tokens.gather(1, cur[:, None]).squeeze(1))


def _result(tree: DraftTree, accepted: Tensor, bonus: Tensor) -> AcceptResult:
    """Pack the accepted nodes (a root-to-node chain, one per depth) and the bonus token.

    accepted: [B, N] bool, root included; bonus: [B].
    """
    batch, num_nodes = accepted.shape
    width = tree.max_depth + 1
    device = accepted.device
    accept_lens = accepted.sum(dim=1)  # [B] accepted drafts + root = accepted drafts + bonus

    # path[b, depth of c] = c for each accepted c; the rest go to a spare column that is dropped.
    path = torch.full((batch, width + 1), -1, dtype=torch.long, device=device)
    column = torch.where(accepted, tree.depths, width)  # [B, N]
    path.scatter_(1, column, torch.arange(num_nodes, device=device).expand(batch, -1))
    path = path[:, :width]

    out_tokens = torch.full((batch, width), -1, dtype=torch.long, device=device)  # [B, D+1]
    drafted = path[:, 1:]  # [B, D]
    out_tokens[:, :-1] = torch.where(drafted >= 0, tree.tokens.gather(1, drafted.clamp(min=0)), -1)
    out_tokens.scatter_(1, (accept_lens - 1)[:, None], bonus[:, None].long())
    return AcceptResult(accept_lens=accept_lens, path=path, out_tokens=out_tokens)

"""Acceptance on a draft tree: which drafted tokens the target keeps, plus one token of its own.

Both rules walk the tree from the root in one pass over the nodes in index order. Because
parents precede children (parents[i] < i), that pass meets the children of the current node
in index order, and all children of a node after the node itself; a node that is not a
child of the current node is skipped. So node c is "tried" exactly when its parent is the
deepest node accepted so far and every earlier sibling of c was rejected.

`greedy_accept` keeps a child whose token is the target's argmax. `tree_rejection_sample`
is lossless speculative sampling for a tree drafted deterministically (top-k): every output
token is distributed exactly as the target would sample it. Both are batched over B,
device-agnostic, and read nothing back to the host.
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


def greedy_accept(tree: DraftTree, target_argmax: Tensor, coins: Tensor | None = None,
                  use_coins: Tensor | None = None) -> AcceptResult:
    """target_argmax: [B, N], the target's greedy next token after each node.

    Move to the child whose token equals the target's argmax at the current node; stop when
    none does. The bonus token is the argmax at the last accepted node.

    BENCHMARK ONLY: rows with `use_coins` [B] set accept child c when `coins[b, c]` holds instead of
    when its token matches (synthetic acceptance, tandem.bench.synthetic). Both rules live in one
    function so one captured CUDA graph serves either.
    """
    if tree.chain:
        return _greedy_accept_chain(tree, target_argmax, coins, use_coins)
    batch, num_nodes = tree.tokens.shape
    rows = torch.arange(batch, device=tree.tokens.device)
    cur = torch.zeros(batch, dtype=torch.long, device=tree.tokens.device)  # [B] deepest accepted node
    accepted = torch.zeros(batch, num_nodes, dtype=torch.bool, device=tree.tokens.device)  # [B, N]
    accepted[:, 0].fill_(True)  # fill_, not "= True": that copies a host value, which a CUDA graph capture rejects
    for c in range(1, num_nodes):
        is_child = tree.parents[:, c] == cur
        match = tree.tokens[:, c] == target_argmax[rows, cur]
        if coins is not None:
            match = torch.where(use_coins, coins[:, c], match)
        accept = is_child & match  # the first matching child wins
        accepted[:, c] = accept
        cur = torch.where(accept, c, cur)
    return _result(tree, accepted, bonus=target_argmax[rows, cur])


def _greedy_accept_chain(tree: DraftTree, target_argmax: Tensor, coins: Tensor | None,
                         use_coins: Tensor | None) -> AcceptResult:
    """`greedy_accept` on a chain, without the walk: node c is accepted iff it and every node before it
    matches the target's argmax at its parent (c - 1)."""
    match = tree.tokens[:, 1:] == target_argmax[:, :-1]  # [B, N-1]
    if coins is not None:
        match = torch.where(use_coins[:, None], coins[:, 1:], match)
    prefix = match.long().cumprod(dim=1).bool()  # [B, N-1]
    root = torch.ones(prefix.shape[0], 1, dtype=torch.bool, device=prefix.device)  # always kept
    accepted = torch.cat([root, prefix], dim=1)
    cur = prefix.sum(dim=1)  # deepest accepted node
    return _result(tree, accepted, bonus=target_argmax.gather(1, cur[:, None]).squeeze(1))


def tree_rejection_sample(
    tree: DraftTree, target_probs: Tensor, uniforms: Tensor, bonus_noise: Tensor
) -> AcceptResult:
    """Lossless rejection sampling on a tree whose tokens were drafted deterministically (top-k).

    target_probs: [B, N, V], the target distribution after each node (`logits_to_probs`).
    uniforms:     [B, N] in [0, 1); uniforms[b, c] decides node c (column 0 unused).
    bonus_noise:  [B, V] ~ Exp(1), for the final draw by exponential race.

    The draft distribution q is one-hot on each drafted token, so the usual rule
    "accept t with probability min(1, p(t)/q(t)), else resample from max(p - q, 0)" becomes:
    accept child token t with probability p(t) / sum(p); on reject, zero p(t) and try the next
    child with the renormalised residual; if no child is accepted (or the node is a leaf),
    draw the bonus token from the residual.

    Why each output token follows the target p at its node (children t1, t2, ... in order):
      P(emit t1) = p(t1).
      P(emit t2) = P(reject t1) * p(t2) / (1 - p(t1)) = (1 - p(t1)) * p(t2) / (1 - p(t1)) = p(t2).
      Likewise each later child t_k: the residual mass left is 1 - p(t1) - ... - p(t_{k-1}),
      which is exactly the probability of reaching t_k, so P(emit t_k) = p(t_k).
      Any other token x: reached with probability 1 - sum_k p(t_k) (all children rejected),
      then drawn with probability p(x) / (1 - sum_k p(t_k)), so P(emit x) = p(x).
    After emitting a child's token we stand at that child, whose row of target_probs is the
    target's distribution given the tokens so far, and the same argument repeats.
    """
    batch, num_nodes = tree.tokens.shape
    vocab = target_probs.shape[-1]
    device = tree.tokens.device
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    rows = torch.arange(batch, device=device)

    # The residual at the current node is its target row with its rejected children's tokens
    # zeroed. The walk needs only its mass and p(t) of the next child, both [B]: no [B, V] work per node.
    node_mass = target_probs.sum(dim=-1, dtype=dtype)  # [B, N]
    repeated = _repeats_earlier_sibling(tree)  # [B, N]: its token was already zeroed by a rejected sibling

    cur = torch.zeros(batch, dtype=torch.long, device=device)  # [B] deepest accepted node
    mass = node_mass[:, 0]  # [B] residual mass left at `cur`
    accepted = torch.zeros(batch, num_nodes, dtype=torch.bool, device=device)  # [B, N]
    accepted[:, 0] = True
    for c in range(1, num_nodes):
        is_child = tree.parents[:, c] == cur
        token = tree.tokens[:, c]
        p_t = target_probs[rows, cur, token].to(dtype)  # [B] p(t) at the current node
        p_t = torch.where(repeated[:, c], 0.0, p_t)
        # Accept with probability p(t) / sum(residual). Written as u * mass < p(t): no division,
        # and a token of probability 0 is never accepted (mass >= 0 by the clamp below).
        accept = is_child & (uniforms[:, c].to(dtype) * mass < p_t)
        reject = is_child & ~accept
        mass = torch.where(accept, node_mass[:, c], torch.where(reject, (mass - p_t).clamp(min=0.0), mass))
        cur = torch.where(accept, c, cur)
        accepted[:, c] = accept

    # Every child of the final node was tried and rejected (children follow their parent in
    # index order), so the residual there is its target row with all children's tokens zeroed.
    target = target_probs[rows, cur].to(dtype)  # [B, V]
    is_child = tree.parents == cur[:, None]  # [B, N]
    zero_ids = torch.where(is_child, tree.tokens, vocab)  # non-children go to a spare column, dropped below
    zeroed = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device).scatter_(1, zero_ids, True)
    residual = target.masked_fill(zeroed[:, :vocab], 0.0)
    # The residual cannot be all zero mathematically: then the last rejected child held all of
    # the remaining mass, p(t) = sum(p), and was accepted with probability 1 (u < 1). Rounding in
    # `mass` can still reject it; fall back to the target row rather than draw from nothing.
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    residual = torch.where(empty, target, residual)
    # Exponential race: argmax p / E picks token x with probability p(x) / sum(p); p(x) = 0 never wins.
    noise = bonus_noise.to(dtype).clamp(min=torch.finfo(dtype).tiny)  # Exp(1) can round to 0
    bonus = (residual / noise).argmax(dim=-1)
    return _result(tree, accepted, bonus)


def draw_noise(
    batch: int, num_nodes: int, vocab: int, device: torch.device | str, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """The randomness `tree_rejection_sample` consumes: uniforms [B, N] in [0, 1) and Exp(1) noise [B, V]."""
    uniforms = torch.rand(batch, num_nodes, device=device, generator=generator)
    bonus_noise = torch.empty(batch, vocab, device=device).exponential_(generator=generator)
    return uniforms, bonus_noise


def _repeats_earlier_sibling(tree: DraftTree) -> Tensor:
    """[B, N] bool: node c has an earlier sibling with the same token.

    Top-k drafting never does this; for other trees it keeps the walk exact, since the
    residual already holds 0 for that token once the earlier sibling was rejected.
    """
    num_nodes = tree.num_nodes
    same = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (
        tree.tokens[:, :, None] == tree.tokens[:, None, :]
    )  # [B, N, N]
    earlier = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=tree.tokens.device).tril(diagonal=-1)
    return (same & earlier).any(dim=-1)


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

"""Draft-tree tests. TreeBuilder and ancestor_mask are checked against slow references written
here (one request at a time, plain lists and dicts), never against their own output."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.speculative.tree import DraftTree, TreeBuilder, ancestor_mask, chain_tree

# ---------------------------------------------------------------------------
# Slow reference: the EAGLE-2 procedure for ONE request, candidates as dicts.


def ref_eagle2(root, first_logp, first_ids, steps, num_draft_tokens):
    """first_logp / first_ids: [K] lists. steps: list of (logp, ids), each [K][K] lists, one per expansion.

    Returns (tokens, parents, depths) lists of the tree, and per expansion the new frontier's
    (parent slots, tokens, paths) as the builder should report them.
    """
    k = len(first_logp)
    cands = [dict(score=first_logp[j], token=first_ids[j], parent=None, depth=1) for j in range(k)]
    frontier = list(range(k))  # candidate numbers
    paths = {c: [slot] for slot, c in enumerate(frontier)}  # candidate -> frontier slots of its ancestors + itself
    history = []
    for logp, ids in steps:
        children = []
        for slot, parent in enumerate(frontier):
            for j in range(k):
                cands.append(
                    dict(
                        score=cands[parent]["score"] + logp[slot][j],
                        token=ids[slot][j],
                        parent=parent,
                        depth=cands[parent]["depth"] + 1,
                    )
                )
                children.append(len(cands) - 1)
        # Best K by score; on a tie the earlier candidate first.
        new_frontier = sorted(children, key=lambda c: (-cands[c]["score"], c))[:k]
        parent_slots = [frontier.index(cands[c]["parent"]) for c in new_frontier]
        new_paths = {c: paths[cands[c]["parent"]] + [slot] for slot, c in enumerate(new_frontier)}
        history.append(
            dict(parent_slots=parent_slots, tokens=[cands[c]["token"] for c in new_frontier],
                 paths=[new_paths[c] for c in new_frontier])
        )
        frontier, paths = new_frontier, new_paths

    chosen = sorted(range(len(cands)), key=lambda c: (-cands[c]["score"], c))[: num_draft_tokens - 1]
    chosen.sort()
    node_of = {c: i + 1 for i, c in enumerate(chosen)}
    tokens, parents, depths = [root], [-1], [0]
    for c in chosen:
        tokens.append(cands[c]["token"])
        parent = cands[c]["parent"]
        parents.append(0 if parent is None else node_of[parent])  # KeyError = parent not chosen: a bug
        depths.append(cands[c]["depth"])
    return (tokens, parents, depths), history


def random_logp(shape, rng: torch.Generator, ties: bool, dtype) -> torch.Tensor:
    """Log-probs <= 0. With ties: multiples of 1/4 in [-2, 0] (exact in float32, so sums tie exactly;
    0 makes a child tie its parent). Without: continuous, in float64 so the reference's Python floats
    add exactly like the tensors do."""
    if ties:
        return (-torch.randint(0, 9, shape, generator=rng) / 4).to(dtype)
    return -torch.rand(shape, generator=rng, dtype=torch.float64) * 3


def run_case(batch, topk, steps, num_draft_tokens, rng, ties):
    dtype = torch.float32 if ties else torch.float64
    root = torch.randint(0, 1000, (batch,), generator=rng)
    first_logp = random_logp((batch, topk), rng, ties, dtype)
    first_ids = torch.randint(0, 1000, (batch, topk), generator=rng)
    expansions = [
        (random_logp((batch, topk, topk), rng, ties, dtype), torch.randint(0, 1000, (batch, topk, topk), generator=rng))
        for _ in range(steps - 1)
    ]

    builder = TreeBuilder(root, first_logp, first_ids)
    assert builder.depth == 1
    assert builder.frontier_tokens.tolist() == first_ids.tolist()
    assert builder.frontier_paths.tolist() == [[[slot] for slot in range(topk)]] * batch
    reported = []
    for logp, ids in expansions:
        parent_slots = builder.expand(logp, ids)
        reported.append((parent_slots.tolist(), builder.frontier_tokens.tolist(), builder.frontier_paths.tolist()))
    assert builder.depth == steps
    tree = builder.build(num_draft_tokens)

    for b in range(batch):
        (tokens, parents, depths), history = ref_eagle2(
            root[b].item(),
            first_logp[b].tolist(),
            first_ids[b].tolist(),
            [(logp[b].tolist(), ids[b].tolist()) for logp, ids in expansions],
            num_draft_tokens,
        )
        for step, (slots, ftokens, fpaths) in enumerate(reported):
            assert slots[b] == history[step]["parent_slots"]
            assert ftokens[b] == history[step]["tokens"]
            assert fpaths[b] == history[step]["paths"]
        assert tree.tokens[b].tolist() == tokens
        assert tree.parents[b].tolist() == parents
        assert tree.depths[b].tolist() == depths
    check_invariants(tree)
    assert tree.max_depth == min(steps, num_draft_tokens - 1)
    return tree, root, first_ids, expansions


def check_invariants(tree: DraftTree):
    batch, n = tree.tokens.shape
    assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == torch.int64
    for b in range(batch):
        parents, depths = tree.parents[b].tolist(), tree.depths[b].tolist()
        assert parents[0] == -1 and depths[0] == 0
        for i in range(1, n):
            assert 0 <= parents[i] < i
            assert depths[i] == depths[parents[i]] + 1
            assert depths[i] <= tree.max_depth


# ---------------------------------------------------------------------------
# TreeBuilder


@pytest.mark.parametrize("ties", [False, True])
def test_builder_matches_reference(ties):
    rng = torch.Generator().manual_seed(1234 + ties)
    py = random.Random(99 + ties)
    for _ in range(150):
        topk, steps, batch = py.choice([1, 2, 3, 4]), py.randint(1, 5), py.randint(1, 5)
        max_tokens = 1 + topk + (steps - 1) * topk * topk
        num_draft_tokens = py.choice([1, 2, max_tokens, py.randint(1, max_tokens)])
        run_case(batch, topk, steps, num_draft_tokens, rng, ties)


def test_all_log_probs_zero_keeps_parents_before_children():
    """Every score ties: selection falls back to creation order, which still chooses parents first."""
    batch, topk, steps = 2, 3, 4
    builder = TreeBuilder(torch.tensor([7, 8]), torch.zeros(batch, topk), torch.arange(batch * topk).view(batch, topk))
    for s in range(steps - 1):
        ids = torch.arange(batch * topk * topk).view(batch, topk, topk) + 100 * (s + 1)
        assert builder.expand(torch.zeros(batch, topk, topk), ids).tolist() == [[0, 0, 0]] * batch
    tree = builder.build(1 + topk + 2)
    check_invariants(tree)
    # The K step-1 children, then the first two children of frontier slot 0.
    assert tree.parents.tolist() == [[-1, 0, 0, 0, 1, 1]] * batch
    assert tree.tokens[0].tolist() == [7, 0, 1, 2, 100, 101]


def test_nan_log_probs_still_build_a_well_formed_tree():
    """A row whose draft ran on garbage state (a dormant request's) has NaN log-probs at some levels; the
    other row is normal. Both trees keep every invariant (before, the NaN row's parents and depths
    disagreed and its accept walk skipped a depth)."""
    batch, topk, steps = 2, 3, 4
    rng = torch.Generator().manual_seed(5)
    first = -torch.rand(batch, topk, generator=rng)
    first[0, 1] = float("nan")
    builder = TreeBuilder(torch.tensor([7, 8]), first, torch.arange(batch * topk).view(batch, topk))
    for s in range(steps - 1):
        logp = -torch.rand(batch, topk, topk, generator=rng)
        logp[0, s % topk] = float("nan")
        builder.expand(logp, torch.arange(batch * topk * topk).view(batch, topk, topk) + 100 * (s + 1))
    tree = builder.build(1 + topk + 2 * topk)
    check_invariants(tree)


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_topk_one_is_a_chain(steps):
    rng = torch.Generator().manual_seed(steps)
    batch = 4
    for ties in (False, True):
        for num_draft_tokens in range(1, steps + 2):
            tree, root, first_ids, expansions = run_case(batch, 1, steps, num_draft_tokens, rng, ties)
            drafts = torch.cat([first_ids] + [ids[:, :, 0] for _, ids in expansions], dim=1)  # [B, S]
            chain = chain_tree(root, drafts[:, : num_draft_tokens - 1])
            assert torch.equal(tree.tokens, chain.tokens)
            assert torch.equal(tree.parents, chain.parents)
            assert torch.equal(tree.depths, chain.depths)
            assert tree.max_depth == chain.max_depth


def test_chain_tree():
    tree = chain_tree(torch.tensor([5, 6]), torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert tree.tokens.tolist() == [[5, 1, 2, 3], [6, 4, 5, 6]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2
    assert tree.depths.tolist() == [[0, 1, 2, 3]] * 2
    assert tree.max_depth == 3
    check_invariants(tree)


def test_frontier_paths_lead_to_ancestors():
    """Following frontier_paths through the recorded frontiers reproduces each node's ancestry
    as the builder's own parent slots tell it, and the tokens of the tree built afterwards."""
    rng = torch.Generator().manual_seed(5)
    batch, topk, steps = 3, 3, 5
    builder = TreeBuilder(torch.zeros(batch, dtype=torch.long), -torch.rand(batch, topk, generator=rng),
                          torch.randint(0, 50, (batch, topk), generator=rng))
    frontier_tokens = [builder.frontier_tokens]
    parent_slots = []
    for _ in range(steps - 1):
        parent_slots.append(builder.expand(-torch.rand(batch, topk, topk, generator=rng),
                                           torch.randint(0, 50, (batch, topk, topk), generator=rng)))
        frontier_tokens.append(builder.frontier_tokens)
    paths = builder.frontier_paths  # [B, K, S]
    assert paths.shape == (batch, topk, steps)
    for b in range(batch):
        for k in range(topk):
            path = paths[b, k].tolist()
            assert path[-1] == k
            for depth in range(steps, 1, -1):  # slot at depth d-1 = parent slot of the node at depth d
                assert path[depth - 2] == parent_slots[depth - 2][b, path[depth - 1]].item()
    # With every candidate kept, each frontier node is a depth-S node of the tree, and the tokens
    # along its frontier path are the tokens of its ancestors there.
    tree = builder.build(1 + topk + (steps - 1) * topk * topk)
    for b in range(batch):
        chains = set()
        for i in range(tree.num_nodes):
            if tree.depths[b, i] == steps:
                chain, node = [], i
                while node > 0:
                    chain.append(tree.tokens[b, node].item())
                    node = tree.parents[b, node].item()
                chains.add(tuple(reversed(chain)))
        for k in range(topk):
            along_path = tuple(frontier_tokens[d][b, s].item() for d, s in enumerate(paths[b, k].tolist()))
            assert along_path in chains


# ---------------------------------------------------------------------------
# ancestor_mask


def random_parents(batch, n, py: random.Random) -> torch.Tensor:
    return torch.tensor([[-1] + [py.randrange(i) for i in range(1, n)] for _ in range(batch)])


def ref_ancestor_mask(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        node = i
        while node != -1:
            mask[i][node] = True
            node = parents[node]
    return mask


def test_ancestor_mask_matches_reference():
    py = random.Random(0)
    for _ in range(50):
        batch, n = py.randint(1, 4), py.randint(1, 20)
        parents = random_parents(batch, n, py)
        mask = ancestor_mask(parents)
        assert mask.shape == (batch, n, n) and mask.dtype == torch.bool
        for b in range(batch):
            assert mask[b].tolist() == ref_ancestor_mask(parents[b].tolist())


def test_ancestor_mask_of_built_tree():
    rng = torch.Generator().manual_seed(3)
    tree, *_ = run_case(4, 4, 5, 1 + 4 + 4 * 16, rng, ties=True)
    mask = ancestor_mask(tree.parents)
    for b in range(4):
        assert mask[b].tolist() == ref_ancestor_mask(tree.parents[b].tolist())
    assert torch.equal(mask.sum(-1), tree.depths + 1)  # a node sees itself and its depth ancestors

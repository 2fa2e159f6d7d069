"""Acceptance tests. accept_target_tokens is checked against a slow reference walk written here (one
request at a time, plain lists), and sampled acceptance (the target's own position-keyed draw at
every node, then the same walk) against the target distribution itself with a chi-square test whose
power is computed, plus negative controls showing that the same check catches the classic mistakes."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tandem.speculative.tree import DraftTree, TreeBuilder
from tandem.layers.sampler import gumbel_race_reference
from tandem.speculative.verify import AcceptResult, accept_target_tokens

# ---------------------------------------------------------------------------
# Trees


def tree_from_lists(tokens: list[list[int]], parents: list[list[int]]) -> DraftTree:
    depths = []
    for row in parents:
        d = []
        for p in row:
            d.append(0 if p < 0 else d[p] + 1)
        depths.append(d)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def random_tree(batch: int, num_nodes: int, vocab: int, py: random.Random) -> DraftTree:
    """Any shape with parents[i] < i (children of a node need not be adjacent); tokens from a small
    vocab, so siblings sometimes repeat a token."""
    parents = [[-1] + [py.randrange(i) for i in range(1, num_nodes)] for _ in range(batch)]
    tokens = [[py.randrange(vocab) for _ in range(num_nodes)] for _ in range(batch)]
    return tree_from_lists(tokens, parents)


def built_tree(batch: int, topk: int, steps: int, num_draft_tokens: int, vocab: int, gen: torch.Generator):
    """A tree as the drafter makes it: distinct sibling tokens (top-k of a random draft distribution)."""
    def top(shape):
        logp = torch.log_softmax(torch.randn(*shape, vocab, generator=gen), dim=-1)
        return logp.topk(topk, dim=-1)

    first_logp, first_ids = top((batch,))
    builder = TreeBuilder(torch.randint(0, vocab, (batch,), generator=gen), first_logp, first_ids)
    for _ in range(steps - 1):
        builder.expand(*top((batch, topk)))
    return builder.build(num_draft_tokens)


def children(parents: list[int], node: int) -> list[int]:
    return [c for c in range(len(parents)) if parents[c] == node]


def padded(values: list[int], width: int) -> list[int]:
    return values + [-1] * (width - len(values))


def check_result_shape(result: AcceptResult, tree: DraftTree):
    batch = tree.tokens.shape[0]
    width = tree.max_depth + 1
    assert result.accept_lens.shape == (batch,) and result.accept_lens.dtype == torch.int64
    assert result.path.shape == result.out_tokens.shape == (batch, width)
    assert result.path.dtype == result.out_tokens.dtype == torch.int64
    assert bool((result.accept_lens >= 1).all()) and bool((result.accept_lens <= width).all())


# ---------------------------------------------------------------------------
# Greedy


def ref_greedy(tokens: list[int], parents: list[int], argmax: list[int], width: int):
    """Walk: go to the first child (node order) whose token is the target's argmax here."""
    cur, path = 0, [0]
    while True:
        match = [c for c in children(parents, cur) if tokens[c] == argmax[cur]]
        if not match:
            break
        cur = match[0]
        path.append(cur)
    out = [tokens[c] for c in path[1:]] + [argmax[cur]]
    return len(path), padded(path, width), padded(out, width)


def check_greedy(tree: DraftTree, argmax: torch.Tensor):
    result = accept_target_tokens(tree, argmax)
    check_result_shape(result, tree)
    for b in range(tree.tokens.shape[0]):
        n, path, out = ref_greedy(
            tree.tokens[b].tolist(), tree.parents[b].tolist(), argmax[b].tolist(), tree.max_depth + 1
        )
        assert result.accept_lens[b].item() == n
        assert result.path[b].tolist() == path
        assert result.out_tokens[b].tolist() == out
    return result


def force_path(tree: DraftTree, argmax: torch.Tensor, b: int, node: int):
    """Make the target agree with the drafts along the root -> node path of row b."""
    while node > 0:
        parent = tree.parents[b, node].item()
        argmax[b, parent] = tree.tokens[b, node]
        node = parent


def random_case(py: random.Random, gen: torch.Generator):
    """A random batch of trees and a target argmax per node that, for about half the rows, follows one
    path of the tree (so long accepts happen): (tree, argmax [B, N], vocab)."""
    batch, num_nodes, vocab = py.randint(1, 6), py.randint(1, 16), py.choice([2, 3, 5])
    tree = random_tree(batch, num_nodes, vocab, py)
    argmax = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    for b in range(batch):
        if py.random() < 0.5:
            force_path(tree, argmax, b, py.randrange(num_nodes))
    return tree, argmax, vocab


def test_greedy_matches_reference_on_random_trees():
    py = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    lens = set()
    for _ in range(200):
        tree, argmax, _ = random_case(py, gen)
        result = check_greedy(tree, argmax)
        lens.update((result.accept_lens - 1 == tree.depths.max(dim=1).values).tolist())
    assert lens == {True, False}  # both full-depth acceptance and early stops happened


def test_greedy_on_built_trees():
    py = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        topk, steps = py.choice([1, 2, 4]), py.randint(1, 5)
        num_draft_tokens = py.randint(1, 1 + topk + (steps - 1) * topk * topk)
        tree = built_tree(3, topk, steps, num_draft_tokens, vocab=8, gen=gen)
        argmax = torch.randint(0, 8, (3, num_draft_tokens), generator=gen)
        for b in range(3):
            force_path(tree, argmax, b, py.randrange(num_draft_tokens))
        check_greedy(tree, argmax)


def test_greedy_all_accepted_and_none_accepted():
    # Chain root(9) -> 1 -> 2 -> 3. Row 0: the target agrees everywhere; row 1: never.
    tree = tree_from_lists([[9, 1, 2, 3], [9, 1, 2, 3]], [[-1, 0, 1, 2]] * 2)
    argmax = torch.tensor([[1, 2, 3, 7], [5, 2, 3, 7]])
    result = check_greedy(tree, argmax)
    assert result.accept_lens.tolist() == [4, 1]
    assert result.path.tolist() == [[0, 1, 2, 3], [0, -1, -1, -1]]
    assert result.out_tokens.tolist() == [[1, 2, 3, 7], [5, -1, -1, -1]]  # bonus: 7 after the last draft; 5 alone


def test_greedy_picks_the_matching_child_not_the_first():
    # root -> {1: token 4, 2: token 6}, 2 -> {3: token 8}; the target wants 6 then 8 then 1.
    tree = tree_from_lists([[0, 4, 6, 8]], [[-1, 0, 0, 2]])
    result = check_greedy(tree, torch.tensor([[6, 0, 8, 1]]))
    assert result.path.tolist() == [[0, 2, 3]]
    assert result.out_tokens.tolist() == [[6, 8, 1]]


def test_root_only_tree():
    tree = tree_from_lists([[3], [4]], [[-1], [-1]])
    result = check_greedy(tree, torch.tensor([[7], [8]]))
    assert result.out_tokens.tolist() == [[7], [8]]
    probs = torch.tensor([[[0.0, 1.0]], [[1.0, 0.0]]])
    assert position_keyed_sample(tree, probs).out_tokens.tolist() == [[1], [0]]


# ---------------------------------------------------------------------------
# Sampled acceptance: the target's own draw at each node, keyed by (request seed, position)


def position_keyed_sample(tree: DraftTree, target_probs: torch.Tensor, bug: str | None = None) -> AcceptResult:
    """What the worker does for sampled rows: node c's target token is a Gumbel-race draw from
    target_probs[:, c] keyed by (row seed, position of the predicted token = depth + 1), then the walk.
    Row b is request b (seed b). `bug` switches on a classic mistake (negative controls)."""
    batch, num_nodes, vocab = target_probs.shape
    seeds = torch.arange(batch)
    logits = target_probs.double().log().float()  # -inf for probability 0: never drawn
    no_filter = torch.full((batch,), float("-inf"))
    ones = torch.ones(batch)
    tokens = []
    for c in range(num_nodes):
        depth = tree.depths[:, c]
        key = torch.zeros_like(depth) if bug == "root_noise_everywhere" else depth
        drawn = gumbel_race_reference(logits[:, c], ones, no_filter, seeds, key + 1)
        if bug == "greedy_verify":  # a sampled row verified against the argmax; the bonus is still sampled
            drawn = torch.where(tree.parents.eq(c).any(dim=1), target_probs[:, c].argmax(-1), drawn)
        tokens.append(drawn)
    result = accept_target_tokens(tree, torch.stack(tokens, dim=1))
    if bug == "fresh_bonus_draw":  # the bonus drawn again with other noise: a rejected child's token can win
        rows = torch.arange(batch)
        last = result.path.gather(1, (result.accept_lens - 1)[:, None]).squeeze(1)
        bonus = gumbel_race_reference(logits[rows, last], ones, no_filter, seeds + 10**9, tree.depths[rows, last] + 1)
        result.out_tokens.scatter_(1, (result.accept_lens - 1)[:, None], bonus[:, None])
    return result


def test_one_hot_target_equals_greedy():
    py = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(100):
        tree, argmax, vocab = random_case(py, gen)
        probs = torch.nn.functional.one_hot(argmax, vocab).float()  # [B, N, V]
        sampled = position_keyed_sample(tree, probs)
        greedy = accept_target_tokens(tree, argmax)
        assert torch.equal(sampled.accept_lens, greedy.accept_lens)
        assert torch.equal(sampled.path, greedy.path)
        assert torch.equal(sampled.out_tokens, greedy.out_tokens)


def test_sampled_tokens_never_have_probability_zero():
    py = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(100):
        batch, num_nodes, vocab = py.randint(1, 6), py.randint(1, 14), py.choice([2, 3, 6])
        tree = random_tree(batch, num_nodes, vocab, py)
        probs = torch.rand(batch, num_nodes, vocab, generator=gen) * (torch.rand(batch, num_nodes, vocab,
                                                                                 generator=gen) > 0.4)
        probs[..., 0] += 1e-3
        probs = probs / probs.sum(-1, keepdim=True)
        result = position_keyed_sample(tree, probs)
        check_result_shape(result, tree)
        for b in range(batch):
            for j in range(result.accept_lens[b].item()):
                assert probs[b, result.path[b, j], result.out_tokens[b, j]] > 0


# ---------------------------------------------------------------------------
# Statistical losslessness
#
# The tree: root 0 -> {1, 2, 3}, 2 -> {4, 5}, over a vocab of 6. Each node's target row is
# random, except that the drafted children hold fixed, sizeable mass, so every conditional
# sample below is large enough for the test to have power.

VOCAB = 6
SAMPLES = 700_000
ALPHA = 1e-4  # per chi-square test; the fixed seed makes the outcome deterministic anyway
BIAS_TV = 0.01  # the smallest bias (total variation) the test must catch ...
MIN_POWER = 0.99  # ... with at least this probability

STAT_TOKENS = [3, 1, 4, 0, 2, 5]  # node -> token
STAT_PARENTS = [-1, 0, 0, 0, 2, 2]
# p(token of node c) at its parent: every node is reached by >= 20% of the samples (the power test
# needs that), and 15% / 10% of the mass is left for the residual at the root / node 2.
CHILD_MASS = {1: 0.2, 2: 0.45, 3: 0.2, 4: 0.45, 5: 0.45}


def stat_target_probs() -> torch.Tensor:
    """[N, V] float32: each row random, with the fixed mass on its children's tokens."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    for node in range(len(STAT_TOKENS)):
        fixed = {STAT_TOKENS[c]: CHILD_MASS[c] for c in children(STAT_PARENTS, node)}
        free = torch.rand(VOCAB, generator=gen, dtype=torch.float64) + 0.2
        free[list(fixed)] = 0.0
        row = free / free.sum() * (1.0 - sum(fixed.values()))
        for t, m in fixed.items():
            row[t] = m
        rows.append(row)
    return torch.stack(rows).float()


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x) for an integer df, in closed form (no scipy)."""
    if x <= 0:
        return 1.0
    half = x / 2
    if df % 2 == 0:
        terms = range(df // 2)  # e^{-x/2} sum_{i < df/2} (x/2)^i / i!
        return math.fsum(math.exp(i * math.log(half) - half - math.lgamma(i + 1)) for i in terms)
    # erfc(sqrt(x/2)) + e^{-x/2} sum_{i=1}^{(df-1)/2} (x/2)^{i-1/2} / Gamma(i+1/2)
    tail = math.fsum(
        math.exp((i - 0.5) * math.log(half) - half - math.lgamma(i + 0.5)) for i in range(1, (df - 1) // 2 + 1)
    )
    return math.erfc(math.sqrt(half)) + tail


def chi2_critical(df: int, alpha: float) -> float:
    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def noncentral_chi2_sf(x: float, df: int, lam: float) -> float:
    """P(noncentral chi2(df, lam) > x) for lam > 0: a Poisson(lam/2) mixture of central chi2(df + 2j)."""
    terms = range(int(lam / 2 + 20 * math.sqrt(lam) + 50))
    return math.fsum(
        math.exp(j * math.log(lam / 2) - lam / 2 - math.lgamma(j + 1)) * chi2_sf(x, df + 2 * j) for j in terms
    )


def power_against_bias(n: int, df: int) -> float:
    """Power of the chi-square test against ANY shift of total variation >= BIAS_TV.

    A shift d (sum d = 0, sum |d| = 2 * TV) moves Pearson's statistic to a noncentral chi-square
    with lam = n * sum d_i^2 / p_i. Splitting d into the part that adds mass (set A) and the
    part that removes it, Cauchy-Schwarz gives sum_A d_i^2 / p_i >= TV^2 / P(A), and likewise
    for the rest, so lam >= n TV^2 (1/P(A) + 1/(1 - P(A))) >= 4 n TV^2. Power grows with lam,
    so the power at lam = 4 n TV^2 is a lower bound for every such bias.
    """
    return noncentral_chi2_sf(chi2_critical(df, ALPHA), df, 4 * n * BIAS_TV**2)


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; all probs here are > 0."""
    n = observed.sum().item()
    expected = probs.double() * n
    return float(((observed.double() - expected) ** 2 / expected).sum()), probs.numel() - 1


def lossless_failures(bug: str | None = None) -> list[str]:
    """Run sampled acceptance on SAMPLES copies of the tree (SAMPLES requests with their own seeds) and
    test that the first output token follows target[root], and that the token after the tokens of a
    root -> c path follows target[c]. Returns what failed (empty = consistent with lossless)."""
    probs = stat_target_probs()  # [N, V]
    tree = tree_from_lists([STAT_TOKENS], [STAT_PARENTS])
    tree = DraftTree(*(x.expand(SAMPLES, -1) for x in (tree.tokens, tree.parents, tree.depths)), tree.max_depth)
    out = position_keyed_sample(tree, probs.expand(SAMPLES, -1, -1), bug).out_tokens  # [SAMPLES, D+1]

    failures = []
    for node in range(len(STAT_TOKENS)):
        path = []  # tokens on the way root -> node
        c = node
        while c > 0:
            path.insert(0, STAT_TOKENS[c])
            c = STAT_PARENTS[c]
        rows = torch.ones(SAMPLES, dtype=torch.bool)
        for j, t in enumerate(path):
            rows &= out[:, j] == t
        following = out[rows, len(path)]
        if bool((following < 0).any()):
            failures.append(f"node {node}: output stopped after the tokens of an accepted path")
            continue
        stat, df = chi_square(torch.bincount(following, minlength=VOCAB), probs[node])
        pvalue = chi2_sf(stat, df)
        if pvalue < ALPHA:
            failures.append(f"node {node}: chi2 {stat:.1f} (df {df}), p = {pvalue:.2e}, n = {len(following)}")
    return failures


def expected_sample_sizes() -> dict[int, int]:
    """How many of the SAMPLES rows reach each node: the product of p(token) down its path."""
    probs = stat_target_probs().double()
    sizes = {}
    for node in range(len(STAT_TOKENS)):
        reach, c = 1.0, node
        while c > 0:
            reach *= probs[STAT_PARENTS[c], STAT_TOKENS[c]].item()
            c = STAT_PARENTS[c]
        sizes[node] = int(SAMPLES * reach)
    return sizes


def test_statistical_test_has_power():
    assert chi2_sf(11.0705, 5) == pytest.approx(0.05, rel=1e-4)  # textbook table values
    assert chi2_sf(9.4877, 4) == pytest.approx(0.05, rel=1e-4)
    assert chi2_critical(5, 1e-4) == pytest.approx(25.745, rel=1e-3)
    for node, n in expected_sample_sizes().items():
        power = power_against_bias(int(n * 0.98), VOCAB - 1)  # 2% slack for the sample's own noise
        assert power >= MIN_POWER, (node, n, power)


def test_sampled_acceptance_is_lossless():
    assert lossless_failures() == []


@pytest.mark.parametrize("bug", ["root_noise_everywhere", "greedy_verify", "fresh_bonus_draw"])
def test_check_catches_wrong_rules(bug):
    assert lossless_failures(bug) != []


def test_chain_shortcut_matches_the_walk():
    """Chains (topk 1) skip the node walk: accept lengths, paths and tokens as the reference walk,
    with token matches and with synthetic-acceptance coins."""
    from dataclasses import replace

    from tandem.speculative.tree import ancestor_mask, chain_ancestor_mask, chain_tree

    py = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for _ in range(100):
        batch, steps, vocab = py.randint(1, 6), py.randint(1, 6), py.choice([2, 3, 5])
        tree = chain_tree(torch.randint(0, vocab, (batch,), generator=gen),
                          torch.randint(0, vocab, (batch, steps), generator=gen))
        assert tree.chain
        argmax = torch.randint(0, vocab, (batch, steps + 1), generator=gen)
        for b in range(batch):
            if py.random() < 0.5:
                force_path(tree, argmax, b, py.randrange(steps + 1))
        check_greedy(tree, argmax)  # against the pure-Python walk
        coins = torch.rand(batch, steps + 1, generator=gen) < 0.6
        use = torch.rand(batch, generator=gen) < 0.5
        fast = accept_target_tokens(tree, argmax, coins, use)
        walk = accept_target_tokens(replace(tree, chain=False), argmax, coins, use)
        for field in ("accept_lens", "path", "out_tokens"):
            assert torch.equal(getattr(fast, field), getattr(walk, field)), field
        assert torch.equal(chain_ancestor_mask(batch, steps + 1, "cpu"), ancestor_mask(tree.parents))
    assert built_tree(2, 1, 4, 5, vocab=8, gen=gen).chain  # TreeBuilder marks its topk-1 trees
    assert not built_tree(2, 2, 3, 5, vocab=8, gen=gen).chain

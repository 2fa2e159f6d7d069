"""Synthetic acceptance, for `tandem bench --synthetic-acceptance P` only.

Random-weight presets accept almost nothing, so they cannot show what speculation gains at a given
acceptance rate. This rule replaces verification: each drafted node is accepted with probability P,
independently, and the walk from the root moves to the first accepted child of the current node
(for a chain: a prefix whose length is geometric, capped at num_steps). The target still runs the
whole verify forward and its own token (argmax or sample) is the bonus, so the work per step is what real
verification does; but the emitted tokens are the DRAFT's, not the target's output.

It is reachable only through `install`, which `tandem bench` calls: it is not an `Engine` argument,
a CLI flag of `generate`/`serve`, or a server option, and every bench output that used it carries
`LABEL`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.speculative.tree import DraftTree
from tandem.speculative.verify import AcceptResult, accept_target_tokens

LABEL = "SYNTHETIC ACCEPTANCE: outputs are not the model's"


def synthetic_accept(tree: DraftTree, target_argmax: Tensor, uniforms: Tensor, p: float) -> AcceptResult:
    """The walk of `accept_target_tokens` with a coin in place of the token match.

    target_argmax: [B, N], used only for the bonus token; uniforms: [B, N] in [0, 1) (column 0 unused).
    """
    use_coins = torch.ones(tree.tokens.shape[0], dtype=torch.bool, device=tree.tokens.device)
    return accept_target_tokens(tree, target_argmax, coins=uniforms < p, use_coins=use_coins)


def expected_accept_length(p: float, num_steps: int) -> float:
    """Mean tokens per verify step of a chain of num_steps drafts: 1 + p + p^2 + ... + p^num_steps."""
    return sum(p ** k for k in range(num_steps + 1))


class SyntheticAcceptance:
    """The coins `SpecWorker` uses in place of the token match (`_synthetic_coins`)."""

    def __init__(self, p: float, seed: int):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--synthetic-acceptance must be in [0, 1] (got {p})")
        self.p = p
        self.seed = seed
        self._gen: torch.Generator | None = None  # made on the logits' device at the first step

    def coins(self, shape, device) -> Tensor:
        """[B, N] bool: which nodes' coins came up (the input of a graphed decode iteration)."""
        return self.uniforms(shape, device) < self.p

    def uniforms(self, shape, device) -> Tensor:
        if self._gen is None:
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        return torch.rand(shape, generator=self._gen, device=device)


def install(engine, p: float, seed: int = 0) -> SyntheticAcceptance:
    """Makes `engine`'s verification synthetic (see the module docstring). `tandem bench` only."""
    spec = engine.runner.spec
    if spec is None:
        raise ValueError("--synthetic-acceptance needs speculative decoding (it replaces verification)")
    rule = SyntheticAcceptance(p, seed)
    spec.bench_synthetic_acceptance = rule
    return rule

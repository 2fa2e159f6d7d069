"""Synthetic acceptance, for `tandem bench --synthetic-acceptance P` only.

Random-weight presets accept almost nothing, so they cannot show what speculation gains at a given
acceptance rate. This rule replaces verification: each drafted node is accepted with probability P,
independently, and the walk from the root moves to the first accepted child of the current node
(for a chain: a prefix whose length is geometric, capped at num_steps). With a per-position profile
(`--synthetic-acceptance-profile A1,A2,A3`, chains only) the draft at position k is accepted with
probability A_k given the ones before it (the last rate repeats for deeper positions), so a measured
head's per-position acceptance can be replayed on another model's shapes. The target still runs the
whole verify forward and its own token (argmax or sample) is the bonus, so the work per step is what real
verification does; but the emitted tokens are the DRAFT's, not the target's output.

It is reachable only through `install`, which `tandem bench` calls: it is not an `Engine` argument,
a CLI flag of `generate`/`serve`, or a server option, and every bench output that used it carries
`LABEL`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.speculative.tree import DraftTree
from tandem.speculative.verify import AcceptResult, accept_target_tokens

LABEL = "SYNTHETIC ACCEPTANCE: outputs are not the model's"


Rate = float | Sequence[float]  # one probability for every draft, or one per chain position


def synthetic_accept(tree: DraftTree, target_argmax: Tensor, uniforms: Tensor, p: Rate) -> AcceptResult:
    """The walk of `accept_target_tokens` with a coin in place of the token match.

    target_argmax: [B, N], used only for the bonus token; uniforms: [B, N] in [0, 1) (column 0 unused).
    """
    use_coins = torch.ones(tree.tokens.shape[0], dtype=torch.bool, device=tree.tokens.device)
    coins = uniforms < node_thresholds(p, uniforms.shape[1], uniforms.device)
    return accept_target_tokens(tree, target_argmax, coins=coins, use_coins=use_coins)


def node_thresholds(p: Rate, num_nodes: int, device=None) -> Tensor:
    """[N] float: node j's coin comes up when its uniform is below entry j. A profile is indexed by
    position, which is the node index in a chain (node 0, the root, is never tossed)."""
    if isinstance(p, (int, float)):
        return torch.full((num_nodes,), float(p), device=device)
    rates = [1.0] + [p[min(j, len(p)) - 1] for j in range(1, num_nodes)]
    return torch.tensor(rates, dtype=torch.float32, device=device)


def check_rate(p: Rate) -> None:
    rates = [p] if isinstance(p, (int, float)) else list(p)
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"synthetic acceptance rates must be in [0, 1] (got {p})")


def parse_profile(text: str) -> tuple[float, ...]:
    """'0.8,0.7,0.6' -> (0.8, 0.7, 0.6), the --synthetic-acceptance-profile argument."""
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--synthetic-acceptance-profile takes comma-separated rates such as 0.8,0.7,0.6 "
                         f"(got {text!r})") from None
    check_rate(rates)
    return rates


def expected_accept_length(p: Rate, num_steps: int) -> float:
    """Mean tokens per verify step of a chain of num_steps drafts: 1 + p + p^2 + ... + p^num_steps, or
    1 + A1 + A1 A2 + ... with a profile."""
    return sum(reach_probabilities(p, num_steps)) + 1.0


def reach_probabilities(p: Rate, num_steps: int) -> list[float]:
    """Probability that chain position k (1..num_steps) is accepted."""
    out, reach = [], 1.0
    for k in range(1, num_steps + 1):
        reach *= p if isinstance(p, (int, float)) else p[min(k, len(p)) - 1]
        out.append(reach)
    return out


class SyntheticAcceptance:
    """The coins `SpecWorker` uses in place of the token match (`_synthetic_coins`)."""

    def __init__(self, p: Rate, seed: int):
        check_rate(p)
        self.p = p
        self.seed = seed
        self._gen: torch.Generator | None = None  # made on the logits' device at the first step

    def coins(self, shape, device) -> Tensor:
        """[B, N] bool: which nodes' coins came up (the input of a graphed decode iteration)."""
        return self.uniforms(shape, device) < node_thresholds(self.p, shape[-1], device)

    def uniforms(self, shape, device) -> Tensor:
        if self._gen is None:
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        return torch.rand(shape, generator=self._gen, device=device)


def install(engine, p: Rate, seed: int = 0) -> SyntheticAcceptance:
    """Makes `engine`'s verification synthetic (see the module docstring). `tandem bench` only."""
    spec = engine.runner.spec
    if spec is None:
        raise ValueError("--synthetic-acceptance needs speculative decoding (it replaces verification)")
    if not isinstance(p, (int, float)) and engine.config.speculative.eagle_topk != 1:
        raise ValueError("--synthetic-acceptance-profile is per chain position: it needs a chain "
                         "(--speculative-eagle-topk 1)")
    rule = SyntheticAcceptance(p, seed)
    spec.bench_synthetic_acceptance = rule
    return rule

"""Measured acceptance of a draft head: tandem's own `Engine` generates greedily with speculation and
every verify step's accept length (`RequestOutput.spec_accept_lengths`) is pooled."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class AcceptanceReport:
    mean_accept_length: float  # tau: tokens per verify step (accepted drafts + 1)
    num_verify_steps: int
    num_prompts: int
    num_generated_tokens: int
    histogram: dict[int, int] = field(default_factory=dict)  # accept length -> verify steps

    def as_dict(self) -> dict:
        return {"mean_accept_length": self.mean_accept_length, "num_verify_steps": self.num_verify_steps,
                "num_prompts": self.num_prompts, "num_generated_tokens": self.num_generated_tokens,
                "histogram": self.histogram}


def evaluate_acceptance(target_path: str, draft_path: str, prompts: Sequence[Sequence[int]] | Sequence[str],
                        max_new_tokens: int = 64, num_steps: int = 3, topk: int = 1,
                        num_draft_tokens: int | None = None, ignore_eos: bool = False,
                        **engine_kwargs) -> AcceptanceReport:
    """Greedy speculative generation (chain of `num_steps` drafts by default) over `prompts`."""
    from tandem import Engine, SamplingParams

    if not prompts:
        raise ValueError("no prompts to evaluate on")
    if num_draft_tokens is None:
        num_draft_tokens = num_steps + 1 if topk == 1 else min(8, 1 + topk + (num_steps - 1) * topk * topk)
    token_prompts = not isinstance(prompts[0], str)
    longest = max(len(p) for p in prompts) if token_prompts else None
    kwargs = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": draft_path,
              "speculative_num_steps": num_steps, "speculative_eagle_topk": topk,
              "speculative_num_draft_tokens": num_draft_tokens,
              "speculative_adaptive": "off",  # the head's acceptance at this depth, not the policy's choices
              **engine_kwargs}
    if longest is not None and "context_length" not in kwargs:
        kwargs["context_length"] = longest + max_new_tokens + 1  # keeps the CPU KV pool small
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos)
    with Engine(target_path, **kwargs) as engine:
        if token_prompts:
            outs = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=params)
        else:
            outs = engine.generate(list(prompts), params)
    lengths = [n for o in outs for n in o.spec_accept_lengths]
    return AcceptanceReport(
        mean_accept_length=sum(lengths) / len(lengths) if lengths else 0.0,
        num_verify_steps=len(lengths), num_prompts=len(outs),
        num_generated_tokens=sum(len(o.token_ids) for o in outs),
        histogram=dict(sorted(Counter(lengths).items())),
    )


def heldout_prompts(held_docs: list[list[int]], num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Prompts cut from held-out documents: a seeded choice of documents, at a seeded offset in each."""
    rng = random.Random(seed)
    docs = [d for d in held_docs if len(d) >= 2]
    rng.shuffle(docs)
    prompts = []
    for d in docs[:num_prompts]:
        n = min(prompt_len, len(d) - 1)
        start = rng.randrange(0, len(d) - n)
        prompts.append(d[start:start + n])
    return prompts

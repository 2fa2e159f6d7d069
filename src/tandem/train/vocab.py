"""The reduced draft vocabulary of an EAGLE-3 head: the corpus's most frequent target tokens.

Public format: `d2t[i]` (int64) is the offset from draft id i to its target id (`i + d2t[i]`), the
kept target ids sorted ascending; `t2d` (bool over the target vocabulary) marks the kept ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch


@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # [draft_vocab] int64
    t2d: torch.Tensor  # [target_vocab] bool

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] target id of each draft id (ascending)."""
        return torch.arange(len(self.d2t)) + self.d2t


def token_counts(sequences: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(torch.as_tensor(seq, dtype=torch.long), minlength=vocab_size)
    return counts


def build_draft_vocab(sequences: Iterable[Sequence[int]], target_vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """Keeps the `draft_vocab_size` most frequent tokens (ties and unseen tokens: lower id first)."""
    if draft_vocab_size > target_vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({target_vocab_size})")
    counts = token_counts(sequences, target_vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep id order
    kept = torch.sort(order[:draft_vocab_size]).values
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return DraftVocab(d2t=kept - torch.arange(draft_vocab_size), t2d=t2d)

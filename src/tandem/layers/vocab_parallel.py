"""Vocabulary-parallel embedding and logits: rank r holds a contiguous block of token rows.

The vocabulary is padded up to a multiple of the tensor-parallel size; padded rows are zero and
their logits are cut off after the all-gather, so sampling always sees exactly the full vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tandem.layers.linear import WeightShapeError


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows_per_rank
        self.end = min(self.start + self.rows_per_rank, vocab_size)  # rows [start, end) are real
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden))
        self.weight.weight_loader = self._load

    def _load(self, param, tensor, shard_id=None) -> None:
        want = (self.vocab_size, param.shape[1])
        if tuple(tensor.shape) != want:
            raise WeightShapeError(f"expected shape {want}, checkpoint has {tuple(tensor.shape)}")
        n = self.end - self.start
        dst = param.data[:n]
        if isinstance(tensor, torch.Tensor):
            dst.copy_(tensor[self.start:self.end])
        else:
            dst.copy_(tensor.read_slice(0, self.start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocabulary float32 logits from this layout's rows (`weight`: an untied lm_head's)."""
        local = F.linear(hidden, self.weight if weight is None else weight).float()
        return self.tp.all_gather_last(local)[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied lm_head in the embedding's row layout (its logits go through `logits`)."""

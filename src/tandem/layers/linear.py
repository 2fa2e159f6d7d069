"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Each parameter gets a `weight_loader(param, tensor, shard_id)`, so the checkpoint loader is one loop
over safetensors (nano-vllm style). Merged layers (q/k/v, gate/up) load each shard into its slice;
the shard ids they expect are listed in `param.shard_ids` so the loader can report missing ones.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class WeightShapeError(ValueError):
    pass


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(f"expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    copy_checked(param.data, tensor)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        for p in self.parameters():
            p.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix (one matmul instead of several)."""

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for p in self.parameters():
            p.weight_loader = self._load_shard
            p.shard_ids = tuple(shard_sizes)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
        offset, size = self.shard_offsets[shard_id]
        copy_checked(param.data.narrow(0, offset, size), tensor)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([size for _, size in self.shard_offsets.values()], dim=-1))

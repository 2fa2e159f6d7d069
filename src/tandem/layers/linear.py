"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Each parameter gets a `weight_loader(param, tensor, shard_id)`, so the checkpoint loader is one loop
over safetensors (nano-vllm style). Merged layers (q/k/v, gate/up) load each shard into its slice;
the shard ids they expect are listed in `param.shard_ids` so the loader can report missing ones.

Tensor parallelism: column-parallel layers (`MergedLinear` with `shard_blocks`) keep a block of
output rows of each checkpoint tensor; row-parallel layers (`RowParallelLinear`) keep a block of input
columns and sum over ranks. Their loaders cut this rank's block out of the checkpoint tensor, which
may be a lazy handle (`read`/`read_slice`, models/loader.py), so a rank reads only its slice.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tandem.distributed.parallel_state import split_evenly


class WeightShapeError(ValueError):
    pass


def materialize(src) -> torch.Tensor:
    return src if isinstance(src, torch.Tensor) else src.read()


def copy_checked(dst: torch.Tensor, src) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(f"expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(materialize(src))


def copy_block(dst: torch.Tensor, src, dim: int, index: int) -> None:
    """Copies block `index` (blocks of dst's size along `dim`) of the checkpoint tensor `src` into dst."""
    size = dst.shape[dim]
    if isinstance(src, torch.Tensor):
        dst.copy_(src.narrow(dim, index * size, size))
    else:
        dst.copy_(src.read_slice(dim, index * size, size))


def default_weight_loader(param: nn.Parameter, tensor, shard_id=None) -> None:
    copy_checked(param.data, tensor)


def _block_loader(dim: int, index: int, num_blocks: int):
    """A loader for a parameter holding block `index` of `num_blocks` equal blocks along `dim`."""

    def load(param, tensor, shard_id=None) -> None:
        full = list(param.shape)
        full[dim] *= num_blocks
        if tuple(tensor.shape) != tuple(full):
            raise WeightShapeError(f"expected shape {tuple(full)}, checkpoint has {tuple(tensor.shape)}")
        copy_block(param.data if isinstance(param, nn.Parameter) else param, tensor, dim, index)

    return load


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        for p in self.parameters():
            p.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """Input columns split over the ranks (the input is a column-parallel output); partial products
    are summed over ranks, then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp):
        super().__init__(split_evenly(in_features, tp.size, "input features"), out_features, bias)
        self.tp = tp
        self.weight.weight_loader = _block_loader(1, tp.rank, tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix (one matmul instead of several).

    `shard_sizes` are the sizes on this rank; `shard_blocks` (tensor parallelism) says which block of
    that size each checkpoint tensor contributes here (absent: the whole tensor)."""

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool, shard_blocks: dict | None = None):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets = {}
        self.shard_blocks = shard_blocks or {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for p in self.parameters():
            p.weight_loader = self._load_shard
            p.shard_ids = tuple(shard_sizes)

    def _load_shard(self, param: nn.Parameter, tensor, shard_id) -> None:
        offset, size = self.shard_offsets[shard_id]
        dst = param.data.narrow(0, offset, size)
        block = self.shard_blocks.get(shard_id)
        if block is None:
            copy_checked(dst, tensor)
        else:
            index, num_blocks = block
            _block_loader(0, index, num_blocks)(dst, tensor)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([size for _, size in self.shard_offsets.values()], dim=-1))

"""One tensor-parallel group and the collectives the model needs, passed explicitly to the layers.

`TPGroup.single()` (tp=1) makes every collective a no-op, so the model code reads the same at any
size. Model collectives run on `group` (NCCL on GPUs, gloo on CPUs); the scheduler's messages run on
`control`, a gloo group with no practical timeout, because an idle engine sends nothing for hours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # model collectives (None at size 1)
    control: object = None  # gloo: pickled scheduler outputs from rank 0

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (after row-parallel layers)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_min(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's x along the last dim, in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrites x on every rank with rank 0's x."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def control_barrier(self) -> None:
        dist.barrier(group=self.control)

    def broadcast_object(self, obj=None):
        """Rank 0 sends `obj` (pickled) on the control group; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def split_evenly(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what} ({n}) is not divisible by tp_size ({size})")
    return n // size


def kv_heads_layout(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(KV heads on this rank, index of this rank's block of them in the checkpoint).

    With fewer KV heads than ranks each KV head is replicated on tp.size // num_kv_heads ranks: the
    ranks whose query heads read it (query heads are split evenly, in order)."""
    if num_kv_heads >= tp.size:
        return split_evenly(num_kv_heads, tp.size, "num_key_value_heads"), tp.rank
    if tp.size % num_kv_heads:
        raise ValueError(f"tp_size ({tp.size}) must be a multiple of num_key_value_heads ({num_kv_heads}) "
                         "when it exceeds it")
    return 1, tp.rank // (tp.size // num_kv_heads)


def check_tp_shapes(arch, tp_size: int) -> None:
    """Raises ValueError, before any process starts, if the model cannot be split over tp_size ranks."""
    split_evenly(arch.num_heads, tp_size, "num_attention_heads")
    split_evenly(arch.intermediate_size, tp_size, "intermediate_size")
    kv_heads_layout(arch.num_kv_heads, TPGroup(0, tp_size))

"""When to use the fused triton kernels (layers/fused_kernels.py): on a GPU, with triton installed,
unless TANDEM_DISABLE_FUSED_KERNELS=1. Everywhere else the layers run their torch code, which is
also the reference the kernels are tested against."""

from __future__ import annotations

import functools

import torch

from tandem import envs


@functools.cache
def _available() -> bool:
    if envs.disable_fused_kernels():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _available()


def kernels():
    from tandem.layers import fused_kernels  # imports triton: only once a GPU tensor asks for it

    return fused_kernels

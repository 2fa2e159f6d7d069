"""RMSNorm with Hugging Face Llama numerics (normalise in float32, scale in the model dtype)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.fused import kernels, use_fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the add fused on a GPU."""
        if x.dim() == 2 and use_fused(x) and x.stride(1) == 1 and (residual is None or residual.stride(1) == 1):
            return kernels().rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

"""Programmatic dependent launch (PDL, Hopper and later) for tandem's small Triton kernels.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still
finishing; it then waits (`griddepcontrol.wait`, `gdc_wait` in Triton) until that kernel has completed
and its writes are visible, before it reads or writes any tensor. In a CUDA-graphed decode step of a
few hundred small kernels this hides part of the launch gap between them (docs/performance.md).

Off with TANDEM_DISABLE_PDL=1, on GPUs before sm90, and under the Triton interpreter. Each kernel
that takes `PDL` must call `gdc_wait` before its first global load or store of anything an earlier
kernel may write (model weights excepted: nothing writes them during a step).
"""

from __future__ import annotations

import functools

import torch

from tandem import envs


@functools.cache
def _device_supports(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    if not x.is_cuda or envs.disable_pdl():
        return False
    return _device_supports(x.device.index if x.device.index is not None else torch.cuda.current_device())


def launch_kwargs(x: torch.Tensor) -> dict:
    """The keyword arguments of a Triton launch: the kernel's `PDL` constexpr, and the launch flag
    (passed only when on: the interpreter knows no such option)."""
    return {"PDL": True, "launch_pdl": True} if enabled(x) else {"PDL": False}

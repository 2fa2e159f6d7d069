"""CUDA graphs: capture a tensor function once per padded batch size, replay it with fresh inputs.

An eager decode step launches hundreds of small kernels from Python, and on an H200 the GPU
finishes each long before the host launches the next (docs/performance.md): the step is bound by
launches, not by the GPU. A captured graph replays all of them with one launch.

A `GraphedFunction` wraps `fn(*inputs) -> tuple of outputs` where every input and output has the
batch as its leading dimension. For each batch size in its list it captures `fn` on *static* input
tensors. A call with a batch of `b` rows picks the smallest captured size `bs >= b`, copies the
inputs into rows [0, b) of the static tensors, fills rows [b, bs) with each input's *pad value*, replays,
and returns rows [0, b) of the static outputs. Pad values must make the padded rows harmless: the
callers point them at a KV page and a state row reserved for padding (the "sink"), never at a real
request's memory, because padded rows write KV and state like real ones.

Rules for `fn` (checked by capture itself, which fails loudly on a violation): no host sync, no
host-to-device copy of Python data, shapes derived from input shapes only.

The returned outputs are views of the static output tensors: the next replay of the same graph
overwrites them, so a caller must be done with them (in stream order) by then. Every phase gets a
memory pool of its own, because one phase's outputs are still needed while the next phase replays.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """Every size up to 8, then steps of 8 up to 64, then 16: padding wastes at most ~1/8 of a step."""
    sizes = [1, 2, 3, 4, 5, 6, 7, 8] + list(range(16, 65, 8)) + list(range(80, 513, 16))
    return [s for s in sizes if s < max_batch_size] + [max_batch_size]


@dataclass(frozen=True)
class GraphInput:
    """How to build one static input: its shape past the batch dimension, dtype and pad value."""

    tail_shape: tuple[int, ...]
    dtype: torch.dtype
    pad: float | int | bool = 0


class GraphedFunction:
    def __init__(self, name: str, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[GraphInput],
                 device: torch.device):
        self.name = name
        self.fn = fn
        self.inputs = list(inputs)
        self.device = device
        # On a CPU (tests, TANDEM_CUDA_GRAPH_EMULATE=1) "replay" calls fn on the static inputs.
        self.emulated = device.type != "cuda"
        self.pool = None if self.emulated else torch.cuda.graph_pool_handle()  # this phase's sizes only
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static_in: dict[int, list[torch.Tensor]] = {}
        self.static_out: dict[int, tuple[torch.Tensor, ...]] = {}

    @property
    def max_batch_size(self) -> int:
        return max(self.graphs) if self.graphs else 0

    def fits(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_batch_size

    def capture(self, batch_size: int, stream: torch.cuda.Stream) -> None:
        static = [torch.full((batch_size, *spec.tail_shape), spec.pad, dtype=spec.dtype, device=self.device)
                  for spec in self.inputs]
        if self.emulated:
            self.graphs[batch_size] = None
            self.static_in[batch_size] = static
            return
        # The static inputs were filled on the current stream; the capture stream must see them filled.
        # Without this wait the eager run below raced the fills and read whatever memory the caching
        # allocator handed back (a freed engine's tensors): device-side index asserts at start-up, seen
        # on an H200 when another engine in the same process had left garbage.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # One eager run first: lazy initialisation (cuBLAS handles, triton compiles) must not happen
        # inside the capture. Its writes land on the sink rows the pad values point at.
        with torch.cuda.stream(stream):
            self.fn(*static)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = self.fn(*static)
        self.graphs[batch_size] = graph
        self.static_in[batch_size] = static
        self.static_out[batch_size] = tuple(out)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b = args[0].shape[0]
        bs = min(s for s in self.graphs if s >= b)
        for static, arg, spec in zip(self.static_in[bs], args, self.inputs):
            static[:b].copy_(arg)
            if bs > b:
                # Always re-pad: an earlier, larger batch left real rows (real pages) here.
                static[b:].fill_(spec.pad)
        if self.emulated:
            return tuple(t[:b] for t in self.fn(*self.static_in[bs]))
        self.graphs[bs].replay()
        return tuple(t[:b] for t in self.static_out[bs])


def capture_all(functions: Sequence[GraphedFunction], batch_sizes: Sequence[int], device: torch.device) -> None:
    """Captures every function at every batch size (largest first, so smaller graphs reuse the pool's
    memory), showing progress and reporting the time and memory it took."""
    from tqdm import tqdm

    if device.type != "cuda":  # emulation (tests): nothing to capture, just the static inputs
        with torch.inference_mode():
            for f in functions:
                for bs in batch_sizes:
                    f.capture(bs, None)
        return
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    stream = torch.cuda.Stream(device)
    jobs = [(f, bs) for bs in sorted(batch_sizes, reverse=True) for f in functions]
    # No garbage collection during the captures: finalising an earlier engine's objects there (freeing
    # CUDA events or memory) is a CUDA call the capture forbids, and it invalidates the capture (on an
    # H200, a test process that built a speculative engine after others).
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode():
            for f, bs in tqdm(jobs, desc="capturing CUDA graphs", unit="graph", leave=False):
                f.capture(bs, stream)
    finally:
        if gc_was_enabled:
            gc.enable()
    torch.cuda.synchronize(device)
    used = torch.cuda.memory_reserved(device) - before
    logger.info("captured %d CUDA graphs (%s; batch sizes %s) in %.1f s, using %.0f MiB of GPU memory",
                len(jobs), ", ".join(f.name for f in functions), list(batch_sizes),
                time.perf_counter() - start, used / 2**20)

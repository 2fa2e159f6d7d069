"""Piecewise CUDA graphs: the target's forward over a prefill or mixed batch as graphs between attentions.

A decode step has one shape per batch size, so runtime/cuda_graphs.py captures all of it. A step with
a prompt chunk does not: its attention depends on every row's query and KV length. But everything
else in a layer (norms, projections, rotary and KV store, MLP) depends only on the token count. So
the forward is cut at each attention into L + 1 segments, each captured per padded token count:

    segment 0:      embed, layer 0's input norm, q/k/v, rotary (and the KV store)
    segment i:      layer i-1's o_proj, post-attention norm and MLP, then layer i's input half
    segment L:      the last layer's output half and the final norm

and a step replays them with each layer's attention launched eagerly in between. On an H200 an eager
8B-shape forward of a 128-token chunk is bound by ~400 kernel launches from Python, not by the GPU
(docs/performance.md); here it is L + 1 graph launches and L attention calls.

Segments talk through static buffers sized for the largest count (q, k, v, the attention output, the
residual stream, the final hidden and EAGLE-3's auxiliary states), so the graphs of all counts share
them and one memory pool holds only each segment's intermediates, which die inside it (graphs replay in
capture order, one at a time, on one stream). A padded token embeds id 0 at position 0 and writes its
KV to the sink slot (the page reserved for padded rows); rows of a matmul or a norm never mix, so
real rows are unaffected. On a CPU (tests, TANDEM_CUDA_GRAPH_EMULATE=1) the segments run eagerly on
the same buffers, which exercises the padding and the buffer plumbing.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from tandem.models.llama import LlamaForCausalLM, StepContext

logger = logging.getLogger(__name__)


def capture_token_counts(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 24, 32, 48, ... 256 (powers of two and their halfway points), then
    eighths of each power of two (256, 288, 320, ...). Large steps are GPU-bound, so their padding costs
    in proportion (on an H200, 1,664-token prefills padded to 2,048 under halfway points took 27% longer
    than eager ones): above 256 tokens, padding wastes at most an eighth."""
    counts, n = [], 16
    while n < 256:
        counts += [n, n + n // 2]
        n *= 2
    while n < max_tokens:
        counts += [n + j * n // 8 for j in range(8)]
        n *= 2
    return [c for c in counts if c < max_tokens] + [max_tokens]


class PiecewiseForward:
    """`model(input_ids, positions, ctx, aux_layer_ids)` for up to `max_tokens` tokens, replayed."""

    def __init__(self, model: LlamaForCausalLM, aux_layer_ids: tuple[int, ...], max_tokens: int, sink_slot: int,
                 device: torch.device):
        self.model = model
        self.layers = list(model.model.layers)
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.counts = capture_token_counts(max_tokens)
        self.sink_slot = sink_slot
        self.device = device
        self.emulated = device.type != "cuda"
        attn = self.layers[0].self_attn
        dtype = model.model.embed_tokens.weight.dtype
        t, hidden = max_tokens, model.config.hidden_size

        def buf(*shape, dtype=dtype, fill=0):
            return torch.full((t, *shape), fill, dtype=dtype, device=device)

        self.input_ids, self.positions = buf(dtype=torch.long), buf(dtype=torch.long)
        self.slots = buf(dtype=torch.long, fill=sink_slot)
        self.q = buf(attn.num_heads, attn.head_dim)
        self.k, self.v = buf(attn.num_kv_heads, attn.head_dim), buf(attn.num_kv_heads, attn.head_dim)
        self.attn_out = buf(attn.num_heads, attn.head_dim)
        self.residual, self.hidden = buf(hidden), buf(hidden)
        self.aux = [buf(hidden) for _ in self.aux_layer_ids]
        self.stored: list[bool] = [False] * len(self.layers)  # whether layer i's segment stores its k/v
        self.graphs: dict[int, list[torch.cuda.CUDAGraph | None]] = {}

    @property
    def max_tokens(self) -> int:
        return self.counts[-1]

    def fits(self, num_tokens: int, aux_layer_ids: tuple[int, ...]) -> bool:
        return bool(self.graphs) and 0 < num_tokens <= self.max_tokens and tuple(aux_layer_ids) == self.aux_layer_ids

    # ---- the segments ---------------------------------------------------------------------------
    def _keep_aux(self, layer_id: int, n: int, stream: torch.Tensor) -> None:
        if layer_id in self.aux_layer_ids:
            self.aux[self.aux_layer_ids.index(layer_id)][:n].copy_(stream)

    def _input_half(self, i: int, n: int, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext) -> None:
        layer = self.layers[i]
        slots = self.slots[:n] if ctx.backend.accepts_stored_kv else None
        q, k, v, self.stored[i], residual = layer.attention_input(
            self.positions[:n], x, residual, ctx.k_caches[i], ctx.v_caches[i], slots)
        self.q[:n].copy_(q)
        self.k[:n].copy_(k)
        self.v[:n].copy_(v)
        self.residual[:n].copy_(residual)

    def _segment(self, i: int, n: int, ctx: StepContext) -> None:
        """Segment i over the first n rows of the buffers (see the module's docstring)."""
        if i == 0:
            x = self.model.model.embed_tokens(self.input_ids[:n])
            self._keep_aux(0, n, x)
            self._input_half(0, n, x, None, ctx)
            return
        x, residual = self.layers[i - 1].attention_output(self.attn_out[:n], self.residual[:n])
        if i < len(self.layers):
            if i in self.aux_layer_ids:
                self._keep_aux(i, n, x + residual)
            self._input_half(i, n, x, residual, ctx)
            return
        x, residual = self.model.model.norm(x, residual=residual)
        self.hidden[:n].copy_(x)
        self._keep_aux(i, n, residual)

    # ---- capture and replay ---------------------------------------------------------------------
    def capture(self, ctx: StepContext) -> None:
        """Captures every segment at every count, largest count first (`ctx` gives the KV caches and
        the backend; its metadata is not read). With padding only in the buffers, every KV write
        of the warm-up runs and the captures lands in the sink slot."""
        num_segments = len(self.layers) + 1
        if self.emulated:
            self.graphs = {n: [None] * num_segments for n in self.counts}
            return
        from tqdm import tqdm

        torch.cuda.synchronize(self.device)
        before, start = torch.cuda.memory_reserved(self.device), time.perf_counter()
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        gc.collect()  # (no collection inside a capture: see cuda_graphs.capture_all)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.inference_mode():
                jobs = [(n, i) for n in sorted(self.counts, reverse=True) for i in range(num_segments)]
                for n, i in tqdm(jobs, desc="capturing piecewise CUDA graphs", unit="graph", leave=False):
                    with torch.cuda.stream(stream):
                        self._segment(i, n, ctx)  # warm-up: lazy initialisation must not happen in a capture
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._segment(i, n, ctx)
                    self.graphs.setdefault(n, []).append(graph)
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize(self.device)
        logger.info("captured %d piecewise CUDA graphs (token counts %s) in %.1f s, using %.0f MiB of GPU memory",
                    len(jobs), self.counts, time.perf_counter() - start,
                    (torch.cuda.memory_reserved(self.device) - before) / 2**20)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext):
        """The model's forward (final hidden [N, H] and the auxiliary states), as views of the buffers:
        the next call overwrites them, so a caller must be done with them (in stream order) by then."""
        n = input_ids.shape[0]
        count = next(c for c in self.counts if c >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(ctx.metadata.slot_mapping)
        if count > n:  # re-pad: an earlier, larger batch left real slots here
            self.input_ids[n:count].zero_()
            self.positions[n:count].zero_()
            self.slots[n:count].fill_(self.sink_slot)
        graphs = self.graphs[count]
        for i, graph in enumerate(graphs):
            if i > 0:
                layer = i - 1
                attn = self.layers[layer].self_attn
                ctx.backend.forward_into(self.attn_out[:n], self.q[:n], self.k[:n], self.v[:n], ctx.k_caches[layer],
                                         ctx.v_caches[layer], ctx.metadata, attn.scale, kv_stored=self.stored[layer])
            if graph is None:
                self._segment(i, count, ctx)
            else:
                graph.replay()
        return self.hidden[:n], [a[:n] for a in self.aux]


def piecewise_supported(model) -> bool:
    """Whether the model has the Llama decoder layout the segments are cut from."""
    return isinstance(model, LlamaForCausalLM)


__all__ = ["PiecewiseForward", "capture_token_counts", "piecewise_supported"]

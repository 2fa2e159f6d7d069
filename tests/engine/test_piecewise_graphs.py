"""Piecewise CUDA graphs on a CPU (TANDEM_CUDA_GRAPH_EMULATE=1: each segment runs eagerly on the static,
padded buffers). What they add besides the capture: padding to a captured token count, padded tokens'
KV writes sent to the sink slot, the buffers between segments and EAGLE-3's auxiliary states. The
reference is the model's own eager forward (tested against transformers in tests/models) and, end to
end, the prefix-cache workload's tokens without graphs."""

import pytest
import torch

from tandem import Engine
from tandem.layers.attention.base import AttentionBatch, positions_to_slots
from tandem.models.llama import StepContext
from tandem.runtime.piecewise_graphs import PiecewiseForward, capture_token_counts
from tests.engine.test_prefix_cache import BASE, CONFIGS, TARGET, reference, run_conversation  # noqa: F401 (fixture)


@pytest.fixture
def emulate_graphs(monkeypatch):
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")


def test_capture_token_counts():
    counts = capture_token_counts(2048)
    assert counts[:9] == [16, 24, 32, 48, 64, 96, 128, 192, 256] and counts[-3:] == [1792, 1920, 2048]
    assert all(b - a <= a // 8 for a, b in zip(counts[8:], counts[9:]))  # padding at most an eighth above 256
    assert capture_token_counts(100) == [16, 24, 32, 48, 64, 96, 100]
    assert capture_token_counts(16) == [16]


def mixed_batch(page_size: int):
    """Three rows as a mixed step has them: a first prompt chunk, a later chunk over 8 cached
    positions, and one decode at position 20 (13 tokens: padded to 16)."""
    rows = [((1, 2), 0, 7), ((3, 4, 5), 8, 5), ((6, 7, 8), 20, 1)]  # (pages, start, tokens)
    ids, positions, slots = [], [], []
    for r, (pages, start, n) in enumerate(rows):
        ids += [(17 * r + 5 * j) % 200 + 3 for j in range(n)]
        positions += range(start, start + n)
        slots += positions_to_slots(pages, range(start, start + n), page_size)
    batch = AttentionBatch.paged([n for _, _, n in rows], [p for p, _, _ in rows], [s + n for _, s, n in rows],
                                 slots, page_size)
    return torch.tensor(ids), torch.tensor(positions), batch


@torch.inference_mode()
def test_segments_equal_the_eager_forward():
    engine = Engine(TARGET, **BASE, speculative_algorithm=None)
    runner = engine.runner
    model, num_layers = runner.model, runner.arch.num_layers
    ids, positions, batch = mixed_batch(runner.page_size)
    metadata = runner.backend.plan(batch, runner.device)
    torch.manual_seed(0)
    k0 = [torch.randn_like(k) for k in runner.kv_cache.k]  # earlier positions' KV: random
    v0 = [torch.randn_like(v) for v in runner.kv_cache.v]
    aux = (0, 1, num_layers)  # the embedding, a middle layer's input, the last layer's output
    eager_k, eager_v = [k.clone() for k in k0], [v.clone() for v in v0]
    want, want_aux = model(ids, positions, StepContext(runner.backend, metadata, eager_k, eager_v), aux_layer_ids=aux)

    pieces = PiecewiseForward(model, aux, 64, runner.sink_slot, runner.device)
    graph_k, graph_v = [k.clone() for k in k0], [v.clone() for v in v0]
    ctx = StepContext(runner.backend, metadata, graph_k, graph_v)
    pieces.capture(ctx)
    pieces(torch.arange(40) % 50, torch.arange(40), StepContext(  # a larger batch first: its rows must be re-padded
        runner.backend, runner.backend.plan(AttentionBatch.paged([40], [tuple(range(10, 20))], [40],
                                                                 positions_to_slots(tuple(range(10, 20)), range(40),
                                                                                    runner.page_size),
                                                                 runner.page_size), runner.device),
        [k.clone() for k in k0], [v.clone() for v in v0]))
    assert pieces.fits(13, aux) and not pieces.fits(65, aux) and not pieces.fits(13, ())
    got, got_aux = pieces(ids, positions, ctx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_aux, want_aux):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    sink = slice(runner.sink_slot, runner.sink_slot + runner.page_size)
    for layer in range(num_layers):
        # Every real slot holds what the eager forward wrote (padded tokens may write only the sink: on a
        # GPU the segments store k/v, all rows of them; here the backend stores the real rows').
        real = torch.ones(graph_k[layer].shape[0], dtype=torch.bool)
        real[sink] = False
        torch.testing.assert_close(graph_k[layer][real], eager_k[layer][real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(graph_v[layer][real], eager_v[layer][real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["plain", "chain", "tree", "adaptive"])
def test_the_prefix_cache_workload_is_unchanged(name, reference, emulate_graphs, monkeypatch):
    calls = []
    replay = PiecewiseForward.__call__
    monkeypatch.setattr(PiecewiseForward, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or replay(self, *a))
    engine = Engine(TARGET, **BASE, **CONFIGS[name], piecewise_cuda_graph_max_tokens=64, chunked_prefill_size=48)
    assert engine.runner.piecewise.max_tokens == 48  # capped at the step's token budget
    outputs = run_conversation(engine)
    assert [[o.token_ids for o in outs] for outs in outputs] == reference
    assert calls and max(calls) <= 48, "no step replayed the piecewise graphs"
    if CONFIGS[name].get("speculative_adaptive") == "off":
        # The draft reads the target's features (EAGLE-3: three layers' residual streams) from the
        # segments' buffers: acceptance equals the eager prefill's.
        eager = run_conversation(Engine(TARGET, **BASE, **CONFIGS[name], piecewise_cuda_graph_max_tokens=0,
                                        chunked_prefill_size=48))
        assert accept_lengths(outputs) == accept_lengths(eager)


def accept_lengths(outputs):
    return [[o.spec_accept_lengths for o in outs] for outs in outputs]

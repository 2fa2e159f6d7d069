"""Piecewise CUDA graphs captured for real: a mixed batch (a first prompt chunk, a later chunk over
cached positions, a decode) replayed between eager attentions gives the eager forward's hidden states,
EAGLE-3 auxiliary states and KV, on both attention backends (float32); padded tokens write the sink
slot only. End to end, tests/gpu/test_prefix_cache_gpu.py and test_overlap_gpu.py run with the graphs
on (the default) against eager references."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tandem import Engine  # noqa: E402
from tandem.models.llama import StepContext  # noqa: E402
from tandem.runtime.piecewise_graphs import PiecewiseForward  # noqa: E402
from tests.engine.test_piecewise_graphs import mixed_batch  # noqa: E402
from tests.models.tiny_checkpoints import make_checkpoint  # noqa: E402


@pytest.mark.parametrize("backend", ["triton", "torch"])
@torch.inference_mode()
def test_replayed_segments_equal_the_eager_forward(tmp_path, backend):
    make_checkpoint("llama3", str(tmp_path), seed=0)
    engine = Engine(str(tmp_path), device="cuda", dtype="float32", page_size=8, max_total_tokens=4096,
                    attention_backend=backend)
    runner = engine.runner
    assert runner.piecewise is not None  # on by default with CUDA graphs
    model, num_layers = runner.model, runner.arch.num_layers
    ids, positions, batch = mixed_batch(runner.page_size)
    ids, positions = ids.cuda(), positions.cuda()
    metadata = runner.backend.plan(batch, runner.device)
    torch.manual_seed(0)
    k0 = [torch.randn_like(k) for k in runner.kv_cache.k]
    v0 = [torch.randn_like(v) for v in runner.kv_cache.v]
    aux = (0, 1, num_layers)
    eager_k, eager_v = [k.clone() for k in k0], [v.clone() for v in v0]
    want, want_aux = model(ids, positions, StepContext(runner.backend, metadata, eager_k, eager_v), aux_layer_ids=aux)

    graph_k, graph_v = [k.clone() for k in k0], [v.clone() for v in v0]
    ctx = StepContext(runner.backend, metadata, graph_k, graph_v)
    pieces = PiecewiseForward(model, aux, 64, runner.sink_slot, runner.device)
    pieces.capture(ctx)
    assert all(g is not None for g in pieces.graphs[16])
    got, got_aux = pieces(ids, positions, ctx)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for g, w in zip(got_aux, want_aux):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    sink = slice(runner.sink_slot, runner.sink_slot + runner.page_size)
    for layer in range(num_layers):
        real = torch.ones(graph_k[layer].shape[0], dtype=torch.bool, device="cuda")
        real[sink] = False
        torch.testing.assert_close(graph_k[layer][real], eager_k[layer][real], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(graph_v[layer][real], eager_v[layer][real], rtol=1e-4, atol=1e-4)
        if pieces.stored[layer]:  # the segment stores k/v for every row, padded ones into the sink
            assert not torch.equal(graph_k[layer][sink], k0[layer][sink])

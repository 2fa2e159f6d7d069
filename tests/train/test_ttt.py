"""Training-time test against slow references: the causal + diagonal attention, the unrolled head
against tandem's own inference attention over a paged scratch cache, the target features against
transformers, and the loss alignment."""

import pytest
import torch

from tandem.layers.attention.base import AttentionBatch
from tandem.layers.attention.torch_backend import TorchAttentionBackend
from tandem.models.llama import StepContext
from tandem.train.attention import DenseTTTAttention, GridMetadata, ttt_attention
from tandem.train.head import build_head, head_config, init_head
from tandem.train.target import load_frozen_target, target_features
from tandem.train.ttt import ttt_forward, ttt_loss
from tandem.train.vocab import build_draft_vocab
from tests.models.tiny_checkpoints import make_checkpoint

T = 9  # sequence length
STEPS = 3


def slow_ttt_attention(q, keys, values, scale):
    """Query (b, h, t) of step j = len(keys) sees step-1 keys at s <= t and steps 2..j at t only."""
    b, h, t, d = q.shape
    groups = h // keys[0].shape[1]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            kh = hi // groups
            for ti in range(t):
                ks = [keys[0][bi, kh, s] for s in range(ti + 1)] + [k[bi, kh, ti] for k in keys[1:]]
                vs = [values[0][bi, kh, s] for s in range(ti + 1)] + [v[bi, kh, ti] for v in values[1:]]
                w = torch.softmax(torch.stack([q[bi, hi, ti] @ k for k in ks]) * scale, dim=0)
                out[bi, hi, ti] = sum(wi * vi for wi, vi in zip(w, vs))
    return out


def test_ttt_attention_matches_slow_reference():
    gen = torch.Generator().manual_seed(0)
    b, h, kv_h, t, d = 2, 4, 2, 6, 8
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    keys = [torch.randn(b, kv_h, t, d, generator=gen, dtype=torch.float64) for _ in range(4)]
    values = [torch.randn(b, kv_h, t, d, generator=gen, dtype=torch.float64) for _ in range(4)]
    for j in (2, 3, 4):
        got = ttt_attention(q, keys[:j], values[:j], 0.3)
        torch.testing.assert_close(got, slow_ttt_attention(q, keys[:j], values[:j], 0.3))
    # the first step (empty cache) is plain causal attention, through the backend interface
    k_cache, v_cache = [], []
    flat = lambda x: x.transpose(1, 2).reshape(b * t, x.shape[1], d)  # noqa: E731
    got = DenseTTTAttention().forward(flat(q), flat(keys[0]), flat(values[0]), k_cache, v_cache,
                                      GridMetadata(b, t), 0.3)
    want = flat(slow_ttt_attention(q, keys[:1], values[:1], 0.3))
    torch.testing.assert_close(got, want)
    assert len(k_cache) == 1


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ttt_target"))
    hf_model = make_checkpoint("llama3", path, seed=0)
    target, arch = load_frozen_target(path, "cpu", "float32", max_positions=T + STEPS)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, arch.vocab_size, (2, T), generator=gen)
    vocab = build_draft_vocab(ids.tolist(), arch.vocab_size, 200)
    head = build_head(head_config(arch, 200), target, T + STEPS, "cpu")
    init_head(head, target, vocab, seed=0)
    with torch.no_grad():  # larger than the training init, so attention patterns matter
        for p in head.parameters():
            if p.requires_grad and p.dim() == 2:
                p.mul_(10.0)
    return hf_model, target, head, vocab, ids


def test_target_features_match_transformers(target_and_head):
    hf_model, target, head, vocab, ids = target_and_head
    feats = target_features(target, ids, head.aux_layer_ids, vocab.target_ids)
    with torch.no_grad():
        out = hf_model(ids, output_hidden_states=True)
    # "entering layer i" is transformers' hidden_states[i]
    want_aux = torch.cat([out.hidden_states[i] for i in head.aux_layer_ids], dim=-1)
    torch.testing.assert_close(feats.aux, want_aux, atol=1e-4, rtol=1e-4)
    p_full = torch.softmax(out.logits.float(), dim=-1)[..., vocab.target_ids]
    torch.testing.assert_close(feats.probs, p_full / p_full.sum(-1, keepdim=True), atol=1e-5, rtol=1e-4)
    assert torch.equal(feats.argmax, out.logits.argmax(-1))


def inference_reference(head, ids, aux, steps):
    """What the engine's drafter computes: step 1 is a causal prefill over a paged cache; a node of
    step j at position t is a one-token row attending to the prefix 0..t plus its own ancestors."""
    backend = TorchAttentionBackend()
    attn = head.midlayer.self_attn
    b, t = ids.shape
    outs = [torch.zeros(b, t, head.fc.weight.shape[0]) for _ in range(steps)]
    padded = torch.cat([ids, torch.zeros(b, steps, dtype=torch.long)], dim=1)
    for bi in range(b):
        cache = [torch.zeros(steps * t, attn.num_kv_heads, attn.head_dim)], \
                [torch.zeros(steps * t, attn.num_kv_heads, attn.head_dim)]
        slot = lambda step, pos: (step - 1) * t + pos  # noqa: E731
        batch = AttentionBatch([t], [list(range(t))], list(range(t)))
        ctx = StepContext(backend, backend.plan(batch, "cpu"), *cache)
        outs[0][bi] = head(padded[bi, 1:t + 1], torch.arange(t), aux[bi], ctx, hidden_is_target=True)
        for j in range(2, steps + 1):
            kv = [list(range(p + 1)) + [slot(i, p) for i in range(2, j + 1)] for p in range(t)]
            batch = AttentionBatch([1] * t, kv, [slot(j, p) for p in range(t)])
            ctx = StepContext(backend, backend.plan(batch, "cpu"), *cache)
            outs[j - 1][bi] = head(padded[bi, j:t + j], torch.arange(t) + j - 1, outs[j - 2][bi], ctx,
                                   hidden_is_target=False)
    return outs


@pytest.mark.parametrize("steps", [1, STEPS])
def test_unrolled_head_matches_inference_drafting(target_and_head, steps):
    _, target, head, vocab, ids = target_and_head
    feats = target_features(target, ids, head.aux_layer_ids, vocab.target_ids)
    with torch.no_grad():
        got = ttt_forward(head, ids, feats.aux, steps)
        want = inference_reference(head, ids, feats.aux, steps)
    assert len(got) == steps
    for j in range(steps):
        torch.testing.assert_close(got[j], want[j], atol=1e-4, rtol=1e-4, msg=f"step {j + 1}")


def test_loss_alignment_and_gradients(target_and_head):
    _, target, head, vocab, ids = target_and_head
    feats = target_features(target, ids, head.aux_layer_ids, vocab.target_ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, T - 2:] = False  # the second sequence is two tokens shorter
    hiddens = ttt_forward(head, ids, feats.aux, STEPS)
    out = ttt_loss(head, hiddens, valid, feats.probs, feats.argmax, 0.8)
    # slow reference: step j at position t predicts x[t+j+1], labelled by the target at t+j
    want, counts = 0.0, []
    for j in range(1, STEPS + 1):
        terms = []
        for bi in range(2):
            for t in range(T):
                if t + j < T and valid[bi, t + j]:
                    logp = torch.log_softmax(head.compute_logits(hiddens[j - 1][bi, t]), dim=-1)
                    terms.append(-(feats.probs[bi, t + j] * logp).sum())
        counts.append(len(terms))
        want = want + 0.8 ** (j - 1) * torch.stack(terms).mean()
    assert out.step_count == counts == [T - 1 + T - 3, T - 2 + T - 4, T - 3 + T - 5]
    torch.testing.assert_close(out.loss, want)
    out.loss.backward()
    for name in ("fc.weight", "midlayer.self_attn.qkv_proj.weight", "midlayer.mlp.down_proj.weight",
                 "lm_head.weight", "midlayer.hidden_norm.weight"):
        grad = head.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert head.d2t.grad is None
    assert all(p.grad is None for p in target.parameters())
    head.zero_grad(set_to_none=True)
